"""The CPU kernel's C source is a file of the package (tensorwatch_otel/core/measure/cpu_kernel.c): its
own C test (tests/c/test_cpu_kernel.c) checks it without Python or torch in between, and the
build reads that same file (core/measure/cpu_kernel_build.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tensorwatch_otel.core.measure import cpu_kernel_build

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_the_kernel_source_is_the_packaged_file() -> None:
    path = os.path.join(ROOT, "tensorwatch_otel", "core", "measure", cpu_kernel_build.SOURCE_FILE)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    assert cpu_kernel_build.source() == text
    assert "void tw_abs_minmax_many(" in text


def test_the_c_kernel_passes_its_own_edge_value_checks(tmp_path: "os.PathLike[str]") -> None:
    cc = cpu_kernel_build.find_compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine: the kernel is not built here either")
    exe = os.path.join(str(tmp_path), "test_cpu_kernel")
    build = subprocess.run([cc, "-O2", "-fopenmp", "-Wall", "-Werror", "-o", exe,
                            os.path.join(HERE, "c", "test_cpu_kernel.c"), "-lm"],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().startswith("ok ") and run.stdout.strip().endswith(" 0 failed"), run.stdout


def test_a_built_wheel_ships_the_kernel_source(tmp_path: "os.PathLike[str]") -> None:
    out = str(tmp_path)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, ROOT],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stdout + r.stderr
    wheels = [f for f in os.listdir(out) if f.endswith(".whl")]
    assert len(wheels) == 1
    with zipfile.ZipFile(os.path.join(out, wheels[0])) as z:
        assert "tensorwatch_otel/core/measure/cpu_kernel.c" in z.namelist()
