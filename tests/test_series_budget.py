"""The series-budget simulation (benchmarks/bench_series.py) in its --quick form: a real Prometheus
scrapes simulated ranks served by real PrometheusMetrics sinks; fleet mode stays within its budget
and the fleet-wide per-module maximum from the recording rules is exact above the cutoff."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

# mostly waiting (a server's interval, a timeout): scripts/test.sh runs the tests marked `waits`
# beside the CPU-bound parallel pass, in a process of their own
pytestmark = pytest.mark.waits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_series.py")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_series", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_model_shape_is_70b_sized():
    bench = _bench()
    pairs = bench.model_pairs(80)
    assert 2_850 <= len(pairs) <= 3_000  # "about 2,900 series per gauge"
    assert len(set(pairs)) == len(pairs)
    frames = bench.frames_for(pairs, bench.values(pairs, 3, 64, 80, 1), 0)
    assert sum(len(f.tensors) for f in frames) == len(pairs)
    assert frames[0].batch_start and not frames[1].batch_start


def test_budget_formula():
    bench = _bench()
    # 64 ranks, top:16, one detail rank, 2,968 pairs: far below the 64 x 8,900 of detail="all"
    b = bench.fleet_budget(64, 16, 1, 2_968)
    assert b == 63 * (96 + bench.PER_RANK + bench.SCRAPE_META) + 3 * 2_968 + bench.PER_RANK + \
        bench.SCRAPE_META + 3 * 2_968 + 10
    assert b < 64 * 3 * 2_968 / 10


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None and not os.path.exists("/usr/bin/prometheus"),
                    reason="needs the prometheus binary")
def test_bench_series_quick(tmp_path):
    out = tmp_path / "series.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    pairs = r["model"]["pairs"]
    (full,) = r["all"]
    # every endpoint serves its three tensor gauges per pair plus a few per-rank series
    assert 3 * pairs <= full["series_per_endpoint"] <= 3 * pairs + 30
    assert full["samples_per_scrape"]["median"] >= 3 * pairs
    assert 0 < full["scrape_duration_s"]["median"] < 5
    assert full["heap_bytes_per_series"] > 0
    fleet = r["fleet"]
    assert fleet["within_budget"] and fleet["head_series"] <= fleet["budget_series"]
    # 8 ranks of top:4 plus rank 0 in full: well below 8 x detail="all"
    assert fleet["head_series"] < 8 * full["series_per_endpoint"] * 0.6
    view = fleet["view"]
    assert view["pairs_above_cutoff"] >= 1 and view["pairs_wrong"] == 0 and view["values_above_truth"] == 0
    assert view["pairs_exact_above_cutoff"] == view["pairs_above_cutoff"]
    # the planted hot pair lives on a rank that is not a detail rank, and PromQL finds it
    assert view["hot_rank"] != 0 and view["hot_pair_abs_max"] == pytest.approx(view["hot_pair_expected"])
    assert {"1024", "8192", "16384", "assumptions"} == set(r["extrapolation"])
