"""`doctor` against fake toolkits in tmp_path (nvcc/gcc scripts printing real banners), through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _diag_toolkit import gcc_n, host_tools, toolkit
from tensorwatch_otel.cli import main
from tensorwatch_otel.diagnostics import _cuda_tables as tables
from tensorwatch_otel.diagnostics._doctor_checks import check_arch, diagnose
from tensorwatch_otel.diagnostics._doctor_probe import Facts, Toolkit, parse_gcc, parse_nvcc


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A clean environment: only our fake folders on PATH, no CUDA variables."""
    for var in ("CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "opt"
    root.mkdir()
    bindir = host_tools(tmp_path / "usr" / "bin")

    def use(path_dirs, **env):
        monkeypatch.setenv("PATH", os.pathsep.join(str(d) for d in path_dirs))
        for k, v in env.items():
            monkeypatch.setenv(k, str(v))

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;8.6+PTX")
    return root, bindir, use


def doctor(capsys, *argv):
    code = main(["doctor", "--json", *argv])
    doc = json.loads(capsys.readouterr().out)
    return code, doc, {f["id"]: f for f in doc["findings"]}


def test_matching_toolkit_is_healthy(machine, capsys):
    root, bindir, use = machine
    home = toolkit(root, "12.1")
    use([home / "bin", bindir], LD_LIBRARY_PATH=home / "lib64")
    code, doc, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert code == 0, found
    assert doc["ok"] is True and doc["problems"] == 0 and found == {}
    assert doc["facts"]["cuda_home"] == str(home) and doc["facts"]["cuda_home_source"] == "nvcc on PATH"
    assert doc["facts"]["toolkit"]["release"] == "12.1" and doc["facts"]["toolkit"]["build"] == "V12.1.105"
    assert doc["facts"]["gcc_version"] == "11.4.0" and doc["facts"]["target_cuda"] == "12.1"


def test_minor_mismatch_is_a_warning(machine, capsys):
    root, bindir, use = machine
    home = toolkit(root, "12.4")
    use([home / "bin", bindir], LD_LIBRARY_PATH=home / "lib64")
    code, doc, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert code == 0
    assert list(found) == ["cuda-minor-mismatch"]
    assert found["cuda-minor-mismatch"]["severity"] == "warning"
    assert "CUDA 12.4, torch was built with 12.1" in found["cuda-minor-mismatch"]["what"]


def test_major_mismatch_is_a_problem_with_install_fix(machine, capsys):
    root, bindir, use = machine
    home = toolkit(root, "11.8")
    use([home / "bin", bindir], LD_LIBRARY_PATH=home / "lib64")
    code, doc, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert code == 1 and doc["problems"] == 1
    f = found["cuda-major-mismatch"]
    assert f["severity"] == "problem"
    assert f"export PATH={root}/cuda-12.1/bin:$PATH" in f["fix"]
    assert f["fix"][-1].endswith("https://download.pytorch.org/whl/cu118")


def test_wrong_toolkit_first_on_path(machine, capsys):
    root, bindir, use = machine
    old, new = toolkit(root, "11.0", build="V11.0.221"), toolkit(root, "12.1")
    use([old / "bin", new / "bin", bindir], LD_LIBRARY_PATH=f"{old}/lib64:{new}/lib64")
    code, doc, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert code == 1
    assert [t["release"] for t in doc["facts"]["side_by_side"]] == ["11.0", "12.1"]
    assert doc["facts"]["cuda_home"] == str(old)  # what torch would pick
    assert found["cuda-major-mismatch"]["fix"] == [
        f"export CUDA_HOME={new}", f"export PATH={new}/bin:$PATH",
        f"export LD_LIBRARY_PATH={new}/lib64:$LD_LIBRARY_PATH"]
    # Following the fix: CUDA_HOME now right, but PATH and LD_LIBRARY_PATH still prefer 11.0.
    os.environ["CUDA_HOME"] = str(new)
    code, doc, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert code == 1 and set(found) == {"path-order", "ld-library-path-order"}
    assert found["path-order"]["fix"] == [f"export PATH={new}/bin:$PATH"]
    assert found["ld-library-path-order"]["fix"] == [f"export LD_LIBRARY_PATH={new}/lib64:$LD_LIBRARY_PATH"]


def test_missing_lib64_and_missing_cudart(machine, capsys):
    root, bindir, use = machine
    home = toolkit(root, "12.1", lib64=False)
    use([home / "bin", bindir])
    code, _, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert code == 1
    assert found["lib64-missing"]["what"] == f"{home}/lib64 does not exist"
    assert found["lib64-missing"]["fix"] == ["sudo apt install cuda-cudart-dev-12-1  # or reinstall the toolkit"]
    (home / "lib64").mkdir()
    code, _, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert code == 1 and list(found) == ["cudart-missing"]


def test_gcc_too_new_points_at_an_installed_older_gcc(machine, capsys):
    root, bindir, use = machine
    home = toolkit(root, "11.8")
    host_tools(bindir, gcc="12.2.0")
    older = gcc_n(bindir, 11)
    gcc_n(bindir, 9)
    use([home / "bin", bindir], LD_LIBRARY_PATH=home / "lib64")
    code, doc, found = doctor(capsys, "--torch-cuda", "11.8", "--cuda-root", str(root))
    assert code == 1 and list(found) == ["gcc-too-new"]
    f = found["gcc-too-new"]
    assert "gcc 12.2.0" in f["what"] and "(gcc <= 11)" in f["what"]
    assert f["fix"] == [f"ln -s {older} {home}/bin/gcc", f"ln -s {bindir}/g++-11 {home}/bin/g++"]
    # After the fix nvcc's own bin/gcc wins, as it does for nvcc itself.
    os.symlink(older, home / "bin" / "gcc")
    code, doc, found = doctor(capsys, "--torch-cuda", "11.8", "--cuda-root", str(root))
    assert code == 0 and doc["facts"]["gcc_version"] == "11.3.0"


def test_bad_arch_list(machine, capsys, monkeypatch):
    root, bindir, use = machine
    home = toolkit(root, "12.1")
    use([home / "bin", bindir], LD_LIBRARY_PATH=home / "lib64")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;sm_86;Ampere 9.5")
    code, _, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert code == 1 and list(found) == ["arch-list-invalid"]
    assert "'sm_86', '9.5'" in found["arch-list-invalid"]["what"]
    assert found["arch-list-invalid"]["fix"] == ['export TORCH_CUDA_ARCH_LIST="8.0;8.6+PTX"']
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;10.0")  # 10.0 needs CUDA 12.8
    code, _, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert code == 1 and list(found) == ["arch-unsupported-by-nvcc"]
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    code, _, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert list(found) == ["arch-list-unset"]
    assert found["arch-list-unset"]["fix"] == ['export TORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;8.9;9.0+PTX"']


def test_arch_coverage_of_visible_gpus():
    f = Facts(torch_cuda="12.1", gpu_caps=[(8, 6), (9, 0)], arch_list_env="7.0;8.0",
              toolkit=Toolkit("/x", "/x/bin/nvcc", "12.1", "V12.1.105", True, True))
    found = check_arch(f)
    assert [x.id for x in found] == ["arch-list-uncovered"]
    assert "capability 9.0" in found[0].what and "8.6" not in found[0].what  # sm_80 cubins run on 8.6
    assert found[0].fix == ['export TORCH_CUDA_ARCH_LIST="7.0;8.0;9.0+PTX"']
    f.arch_list_env = "Volta;8.0+PTX"  # PTX of 8.0 JIT-compiles for 9.0
    assert check_arch(f) == []


def test_cpu_only_torch_is_reported_not_a_crash(machine, capsys):
    root, bindir, use = machine
    home = toolkit(root, "12.1")
    use([home / "bin", bindir], LD_LIBRARY_PATH=home / "lib64")
    code, doc, found = doctor(capsys, "--cuda-root", str(root))
    import torch

    if torch.version.cuda is not None:
        pytest.skip("installed torch is a CUDA build")
    assert code == 1 and list(found) == ["torch-cpu-only"]
    assert found["torch-cpu-only"]["fix"] == ["pip install torch --index-url https://download.pytorch.org/whl/cu121"]


def test_no_toolkit_at_all(machine, capsys):
    root, bindir, use = machine
    use([bindir])
    code, doc, found = doctor(capsys, "--torch-cuda", "12.1", "--cuda-root", str(root))
    assert code == 1 and doc["facts"]["cuda_home"] is None
    assert found["cuda-home-missing"]["severity"] == "problem"


def test_text_output_and_subprocess_entry_point(tmp_path):
    root = tmp_path / "opt"
    old, new = toolkit(root, "11.8"), toolkit(root, "12.1")
    bindir = host_tools(tmp_path / "bin", ninja=False)
    env = {"PATH": os.pathsep.join([str(old / "bin"), str(new / "bin"), str(bindir)]),
           "TORCH_CUDA_ARCH_LIST": "8.6", "HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "tensorwatch_otel", "doctor", "--torch-cuda", "12.1", "--cuda-root", str(root)]
    text = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert text.returncode == 1, text.stderr
    assert "PROBLEM [cuda-major-mismatch]" in text.stdout
    assert f"    export PATH={new}/bin:$PATH" in text.stdout
    assert "PROBLEM [ninja-missing] ninja is not on PATH" in text.stdout
    assert text.stdout.rstrip().endswith("doctor: 2 problem(s), 0 warning(s)")
    js = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env, timeout=120)
    doc = json.loads(js.stdout)
    assert js.returncode == 1 and doc["problems"] == 2
    assert {f["id"] for f in doc["findings"]} == {"cuda-major-mismatch", "ninja-missing", "ld-library-path-unset"}


@pytest.mark.parametrize("argv, message", [
    (["--torch-cuda", "12"], "argument --torch-cuda: --torch-cuda expects MAJOR.MINOR"),
    (["--torch-cuda", "cu121"], "argument --torch-cuda"),
    (["--cuda-root", "/no/such/dir"], "--cuda-root '/no/such/dir' is not a directory"),
])
def test_bad_options_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["doctor", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_version_parsers_and_gcc_table():
    assert parse_nvcc("Cuda compilation tools, release 11.4, V11.4.48") == ("11.4", "V11.4.48")
    assert parse_gcc("gcc (GCC) 13.2.1 20231011 (Red Hat 13.2.1-4)\n") == "13.2.1"
    assert parse_gcc("gcc (Ubuntu 9.4.0-1ubuntu1~20.04.2) 9.4.0") == "9.4.0"
    assert [tables.max_gcc(v) for v in [(10, 2), (11, 0), (11, 3), (11, 8), (12, 3), (12, 6), (12, 9), (13, 1)]] == \
        [8, 9, 10, 11, 12, 13, 14, 15]
    assert tables.max_gcc((11, 4), "V11.4.48") == 10 and tables.max_gcc((11, 4), "V11.4.152") == 11


def test_shm_and_ninja_findings():
    f = Facts(planned_cuda="12.1", shm_bytes=64 * 2**20, ninja=None)
    ids = {x.id: x.severity for x in diagnose(f)}
    assert ids["shm-small"] == "warning" and ids["ninja-missing"] == "problem"
