"""The benchmark scripts keep running: one quick round each, figures present and sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _run(script, tmp_path, *args):
    """One quick run on one thread: two threads on a loaded 2-core machine make every parallel
    region wait for a descheduled thread (seconds become minutes)."""
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick", "--threads", "1", *args,
                           "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_bench_step_quick(tmp_path):
    result, stdout = _run("bench_step.py", tmp_path, "--rounds", "1", "--steps", "1", "--warmup", "1",
                          "--variants", "watch,sampled,module,peer")
    v = result["variants"]
    assert set(v) == {"unwatched", "watch", "sampled", "module", "peer"}
    assert v["unwatched"]["ratio_median"] == 1.0
    for name in ("watch", "sampled", "module", "peer"):
        assert v[name]["ratio_q1"] <= v[name]["ratio_median"] <= v[name]["ratio_q3"]
        assert 0.1 < v[name]["ratio_median"] < 50, (name, v[name])
        assert v[name]["step_ms_median"] > 0
    assert "peer / watch step time" in stdout


@pytest.mark.slow
def test_bench_paired_budget_quick(tmp_path):
    """The budget variant (max_overhead): its steady-state attributed figures and its chosen interval."""
    result, stdout = _run("bench_paired.py", tmp_path, "--rounds", "1", "--variants", "budget",
                          "--attribute-steps", "12", "--max-overhead", "0.001", "--no-counts")
    assert set(result["variants"]) == {"unwatched", "budget"}
    a = result["attributed"]["budget"]
    assert a["interval"] >= 1 and a["steady_steps"] == 9 and a["steady_blocks"] == 9 // a["interval"]
    if a["steady_blocks"]:
        assert a["steady_min"] <= a["steady_median"] <= a["steady_max"] and a["steady_pooled"] > 1.0
    assert "steady state: one batch in" in stdout and "budget: median" in stdout


@pytest.mark.slow
def test_bench_sinks_quick(tmp_path):
    result, stdout = _run("bench_sinks.py", tmp_path, "--rounds", "1", "--steps", "1", "--big-modules", "50")
    assert {"unwatched", "watch", "prometheus", "otel_metrics"} <= set(result["variants"])
    big = result["big_model_scrape"]
    assert big["modules"] >= 50 and big["series"] > 0 and big["scrape_median_s"] > 0
    assert "prometheus / watch" in stdout


@pytest.mark.timing  # (the variants' hook times in order: run alone, scripts/test.sh)
@pytest.mark.slow
def test_bench_paired_quick(tmp_path):
    # the process's CPU time: the variants' hook times are compared below, a median of four
    # steps each, and on the wall clock a loaded machine's preemption once put the sampled
    # variant's above the full watch's (18.7 ms against 18.2; 1.6 against 8 ms when quiet)
    result, stdout = _run("bench_paired.py", tmp_path, "--rounds", "1", "--clock", "cpu")
    assert result["schedule"] == "bracketed"
    v = result["variants"]
    assert set(v) == {"unwatched", "null", "watch", "peer", "sampled", "gradients", "optimizer_state", "prometheus"}
    assert v["unwatched"]["ratio_median"] == 1.0 and result["model"] == "t5" and result["device"] == "cpu"
    for name, r in v.items():
        assert 0.1 < r["ratio_median"] < 50, (name, r)
        assert r["ratio_min"] <= r["ratio_q1"] <= r["ratio_median"] <= r["ratio_q3"] <= r["ratio_max"]
        assert len(r["ratios"]) == 1 and r["step_ms_median"] > 0
    c = result["counts"]
    # the watcher adds device work and at most one host sync per step (the optimizer-step guard's
    # read; none on a CPU with the compiled kernel, whose values are on the host at once;
    # gradients=True has none); the peer reads values on the host
    from tensorwatch_otel.core.measure import cpu_kernel_build
    guard_sync = 0 if cpu_kernel_build.find_compiler() else 1
    assert c["watch"]["extra_ops"] > 0 and c["gradients"]["extra_ops"] > c["watch"]["extra_ops"]
    assert c["watch"]["host_syncs"] == c["unwatched"]["host_syncs"] + guard_sync
    assert c["gradients"]["host_syncs"] == c["unwatched"]["host_syncs"]
    assert c["peer"]["host_syncs"] > c["unwatched"]["host_syncs"]
    assert c["null"]["extra_ops"] == 0 and c["null"]["host_syncs"] == c["unwatched"]["host_syncs"]
    assert "watch: median" in stdout and "noise (null variant)" in stdout and "peer / watch step time" in stdout
    a = result["attributed"]  # the in-step share, for the watched variants only
    assert set(a) == {"watch", "sampled", "gradients", "optimizer_state", "prometheus"}
    for name, r in a.items():
        assert r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"] and r["ratio_min"] > 1.0, (name, r)
        if name == "sampled":  # an unsampled step: only the root's hooks run (core/frames/quiet.py)
            assert r["module_calls"] == 1, r
        else:
            assert r["module_calls"] == a["watch"]["module_calls"] > 10
    assert a["sampled"]["hook_ms_median"] < a["watch"]["hook_ms_median"] < a["gradients"]["hook_ms_median"]
    assert "attributed" in stdout and "; attributed " in stdout
    for r in v.values():  # one round: the interval of the median is that round's ratio
        assert r["median_interval_90"] == [r["ratio_median"]] * 2


@pytest.mark.slow
def test_bench_paired_segments_quick(tmp_path):
    result, stdout = _run("bench_paired.py", tmp_path, "--rounds", "2", "--schedule", "segments",
                          "--variants", "null,watch", "--attribute-steps", "0", "--no-counts")
    assert result["schedule"] == "segments" and result["steps_per_round"] == 1
    v = result["variants"]
    assert set(v) == {"unwatched", "null", "watch"} and "attributed" not in result
    for r in v.values():
        assert len(r["ratios"]) == 2 and r["median_interval_90"] == [r["ratio_min"], r["ratio_max"]]
    assert "watch: median" in stdout


@pytest.mark.slow
def test_bench_tensor_quick(tmp_path):
    result, stdout = _run("bench_tensor.py", tmp_path)
    rows = result["rows"]
    assert {(r["dtype"], r["numel"]) for r in rows} == {(d, n) for d in ("fp32", "bf16") for n in (1000, 100_000)}
    for r in rows:
        assert r["ratio"]["amax"] == 1.0 and r["amax_us"] > 0
        assert {"measure", "abs_chunked", "abs_full", "norm_pair", "sign"} <= set(r["ratio"])
        assert all(0 < x < 1e4 for x in r["ratio"].values()), r
    assert "ratio of median time to x.amax()" in stdout


@pytest.mark.slow
def test_bench_gc_quick(tmp_path):
    result, stdout = _run("bench_gc.py", tmp_path)
    assert result["modules"] == 100 and result["rounds"] == 1
    v = result["variants"]
    assert set(v) == {"unwatched", "watch", "sampled"} and v["unwatched"]["ratio_median"] == 1.0
    for name in ("watch", "sampled"):
        assert 0.2 < v[name]["ratio_median"] < 20 and v[name]["step_ms_median"] > 0, (name, v[name])
        # the watcher's hooks, handles and references are objects the collector tracks
        assert v[name]["tracked_median"] > v["unwatched"]["tracked_median"], v
    assert all(r["gc_ms_median"] >= 0 for r in v.values())
    assert "the collector as in a training loop" in stdout
