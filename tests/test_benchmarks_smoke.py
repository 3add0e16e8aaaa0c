"""The benchmark scripts keep running: one quick round each, figures present and sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _run(script, tmp_path, *args):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick", *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
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
        assert 0.1 < v[name]["ratio_median"] < 50, (name, v[name])
        assert v[name]["step_ms_median"] > 0
    assert "peer / watch step time" in stdout


@pytest.mark.slow
def test_bench_sinks_quick(tmp_path):
    result, stdout = _run("bench_sinks.py", tmp_path, "--rounds", "1", "--steps", "1", "--big-modules", "50")
    assert {"unwatched", "watch", "prometheus", "otel_metrics"} <= set(result["variants"])
    big = result["big_model_scrape"]
    assert big["modules"] >= 50 and big["series"] > 0 and big["scrape_median_s"] > 0
    assert "prometheus / watch" in stdout
