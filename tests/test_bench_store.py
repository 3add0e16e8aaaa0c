"""benchmarks/bench_store.py keeps running: the quick form against a real TCPStore, figures
present and consistent, the extrapolation's load per step following the askers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_store_quick(tmp_path):
    out = tmp_path / "store.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_store.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    rows = {(r["clients"], r["n"]): r for r in result["rows"]}
    assert set(rows) == {("processes", 1), ("processes", 2), ("threads", 1), ("threads", 4)}
    for r in rows.values():
        assert r["calls"] > 0 and r["req_per_s"] > 0
        assert 0 < r["check_us_p10"] <= r["check_us_median"] <= r["check_us_p90"] <= r["check_us_p99"] \
            <= r["check_us_max"]
    assert result["capacity_req_per_s"] == max(r["req_per_s"] for r in rows.values())
    ext = {(e["ranks"], e["askers"]): e for e in result["extrapolation"]}
    for ranks in (1024, 8192, 16384):
        every, per_node = ext[(ranks, "every rank")], ext[(ranks, "one per node (8 ranks/node)")]
        assert (every["checks_per_step"], per_node["checks_per_step"]) == (ranks, ranks // 8)
        assert per_node["server_utilisation"] == pytest.approx(every["server_utilisation"] / 8, rel=0.01, abs=1e-4)
    assert result["crowded_req_per_s"] > 0 and ext[(1024, "every rank")]["burst_drain_ms_crowded"] > 0
    assert result["assumptions"]
