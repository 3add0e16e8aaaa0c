"""The engine benchmarks keep running: the module-count sweep and the compiled step, one quick
run each, figures present and sane, the prototype in-graph recorders doing what they claim."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _run(script, tmp_path, *args, timeout=240):
    """One quick run on one thread (two threads on a loaded 2-core machine wait for each other)."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick", "--threads", "1", *args,
                           "--json", str(out)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_bench_modules_quick(tmp_path):
    result, stdout = _run("bench_modules.py", tmp_path, "--clock", "cpu")
    assert [row["modules"] for row in result["sizes"]] == [10, 100] and result["clock"] == "cpu"
    for row in result["sizes"]:
        v = row["variants"]
        assert set(v) == {"unwatched", "watch", "sampled", "null"}
        assert v["unwatched"]["ratio_median"] == 1.0
        for name in ("watch", "sampled", "null"):
            r = v[name]
            assert len(r["ratios"]) == 2 and 0.05 < r["ratio_median"] < 50, (row["modules"], name, r)
            assert r["ratio_min"] <= r["median_interval_90"][0] <= r["median_interval_90"][1] <= r["ratio_max"]
            assert r["ratio_min"] <= r["ratio_mean"] <= r["ratio_max"] and r["step_ms_median"] > 0
    assert "watch at 100 modules: median" in stdout and "sampled at 100 modules: mean" in stdout


@pytest.mark.slow
def test_bench_call_cost_quick(tmp_path):
    # (its --quick model and input are bench_compiled's: run just before that test in the same
    # worker, one of the two compiles the graphs the other loads from inductor's cache)
    result, stdout = _run("bench_call_cost.py", tmp_path)
    assert set(result["step_ms_median"]) == {"eager", "eager_watched", "compiled", "compiled_watched"}
    assert all(v > 0 for v in result["step_ms_median"].values())
    assert result["module_calls"] == 12 and len(result["step_ms"]["compiled_watched"]) == 2
    assert "per watched module call" in stdout


@pytest.mark.slow
def test_bench_compiled_quick(tmp_path):
    result, stdout = _run("bench_compiled.py", tmp_path)
    assert result["skip_nnmodule_hook_guards"] is False and result["backend"] == "inductor"
    v = result["variants"]
    assert set(v) == {"unwatched", "null", "watched", "watched_sampled", "wrapped", "custom", "plain",
                      "custom_sampled", "plain_sampled", "custom_kernel", "kernel_grad"}
    for name, r in v.items():
        assert len(r["ratios"]) == 2 and 0.05 < r["ratio_median"] < 50, (name, r)
    first = result["first_step"]
    for name in ("custom", "plain", "custom_kernel", "kernel_grad"):  # every hook traced, no break, as eager
        assert first[name]["graphs"] >= 1 and first[name]["graph_breaks"] == 0, first[name]
        m = result["eager_match"][name]
        assert m["rel_diff_abs_max"] < 1e-4 and m["rows"] == 2 * 13, m
    from tensorwatch_otel.core.env import graph_stats_mode

    in_graph = graph_stats_mode(os.environ) != "0"  # the default for CPU graphs: no op of ours in the graph
    for name in ("watched", "watched_sampled", "wrapped"):  # the package: every module, inside the graph
        assert first[name]["graph_breaks"] == 0 and first[name]["frames"] == result["eager_frames"] == 13, first
        if in_graph:
            assert first[name]["custom_op_calls"] <= 2, first[name]  # (the root's own call keeps its ops)
        else:
            assert first[name]["custom_op_calls"] >= 2 * 12, first[name]  # a pre and a post op per module
    a = result["watched_attributed"]  # the ops' bodies timed inside the watched step
    assert a["op_calls_per_step"] == first["watched"]["custom_op_calls"], a
    if not in_graph:
        assert 0 < a["share_median"] < 1 and a["op_dispatch_us"] > 0, a
    rows = result["eager_match"]["custom"]["rows"]
    # each (module, tensor) one op call in the generated code; the plain ops fused into kernels
    assert first["custom"]["custom_op_calls"] == first["custom_kernel"]["custom_op_calls"] == rows
    assert first["plain"]["custom_op_calls"] == 0 and first["unwatched"]["graph_breaks"] == 0
    assert first["plain"]["kernels"] - first["unwatched"]["kernels"] < rows // 2, first
    g = result["eager_match"]["kernel_grad"]  # output gradients measured in the compiled backward
    assert g["grad_rows_written"] == g["grad_rows"] == 13 and g["grad_rel_diff_abs_max"] < 1e-4, g
    assert first["kernel_grad"]["custom_op_calls"] == rows + 13
    assert result["recompiles_while_timed"] == 0  # sampling toggles a flag: no recompile
    for name, s in result["switches"].items():
        assert s["flag_off"] == {"recompiles": 0, "buffer_written": False}, (name, s)
        assert s["flag_on"] == {"recompiles": 0, "buffer_written": True}, (name, s)
        assert not s["hooks_removed"]["buffer_written"] and s["hooks_added"]["buffer_written"], (name, s)
        # after one compile each way, attach and detach flip between cached graphs
        assert s["hooks_removed_2"]["recompiles"] == s["hooks_added_2"]["recompiles"] == 0, (name, s)
    for name, d in result["detection"].items():
        assert not d["all_finite"] and d["born_in"] == [d["expected"]] == ["blocks.0.mlp.fc1"], (name, d)
    assert "recompiles while timed: 0" in stdout and "custom detection: inf born in" in stdout
