"""benchmarks/bench_trainer.py keeps running: one quick round, figures present and sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.slow
def test_bench_trainer_quick(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_trainer.py"), "--quick", "--rounds", "1",
                           "--steps", "1", "--warmup", "1", "--threads", "1", "--variants", "watch,sampled",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    v = json.loads(out.read_text())["variants"]
    assert set(v) == {"unwatched", "watch", "sampled"}
    assert v["unwatched"]["ratio_median"] == 1.0
    for name in ("watch", "sampled"):
        assert 0.05 < v[name]["ratio_median"] < 50, (name, v[name])
        assert v[name]["step_ms_median"] > 0
