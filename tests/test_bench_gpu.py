"""benchmarks/bench_gpu.py keeps running: its CPU smoke run (`--device cpu --quick`) times every
CPU variant and counts one slot-buffer read per step on the device path forced on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_gpu.py")


@pytest.mark.slow
def test_bench_gpu_cpu_quick(tmp_path):
    out = tmp_path / "out.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--quick", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    v = result["variants"]
    try:
        import triton  # noqa: F401
        expected = {"unwatched", "watched", "watched_device"}
    except ImportError:
        expected = {"unwatched", "watched"}
    assert set(v) == expected and result["quick"] and result["device"] == "cpu"
    assert v["unwatched"]["ratio"] == 1.0
    # the baseline carries no hook of ours; every watched variant's model does
    assert v["unwatched"]["hooked_modules"] == 0
    assert all(row["hooked_modules"] > 5 for name, row in v.items() if name != "unwatched")
    for name, row in v.items():
        assert len(row["step_ms"]) == result["rounds"] == 2 and row["step_ms_median"] > 0, name
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0 and row["aten_ops"] > 0, name
        assert row["d2h_copies"] == 0, name  # nothing leaves a device on a CPU
    assert v["watched"]["buffer_reads"] == 0 and v["unwatched"]["buffer_reads"] == 0
    if "watched_device" in v:
        # the device path: one read of the slot buffer per step, every measured tensor's slot in it
        assert v["watched_device"]["buffer_reads"] == 1 and v["watched_device"]["slots_read"] >= 2 * 7
    assert "watched: " in proc.stdout and "unwatched" in proc.stdout
    # the GPU check's one table (benchmarks/gpu_summary.py) reads it: one row per variant
    summary = subprocess.run([sys.executable, os.path.join(os.path.dirname(BENCH), "gpu_summary.py"), str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr[-2000:]
    table = summary.stdout.splitlines()
    assert table[0].split()[:3] == ["variant", "step", "ms"] and "cg skip" in table[0]
    assert sorted(line.split()[0] for line in table[2:]) == sorted(expected)


@pytest.mark.slow
def test_bench_gpu_fused_optimizer_with_the_guards_flag(tmp_path):
    """The options the GPU check's `eager_fused` phase uses run: AdamW(fused=True) with
    on_detect="raise" (the step guard's verdict handed to the optimizer as its found_inf, its
    values in the next batch's read: still one buffer read per step)."""
    pytest.importorskip("triton")
    out = tmp_path / "out.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--quick", "--threads", "1", "--variants",
                           "unwatched,watched_device", "--fused", "--on-detect", "raise", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["fused"] and result["on_detect"] == "raise"
    row = result["variants"]["watched_device"]
    assert row["buffer_reads"] == 1 and row["hooked_modules"] > 5
    assert "(fused=True)" in proc.stdout
