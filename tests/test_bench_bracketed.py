"""The bracketed schedule of benchmarks/bench_paired.py: each variant's step is compared with the
unwatched steps right around it, so a machine that drifts during the run does not bias the
ratios, and the interval it reports for a median is the order-statistics one."""

from __future__ import annotations

import math
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from _bracketed import median_interval, run_bracketed  # noqa: E402


class DriftingMachine:
    """Step times on a machine that slows down steadily: every step costs its variant's work
    times the machine's current slowness, which grows by `drift` per step taken."""

    def __init__(self, work: dict, drift: float):
        self.work, self.drift, self.slowness, self.log = work, drift, 1.0, []

    def steps(self):
        def make(name):
            def step():
                t = self.work[name] * self.slowness
                self.slowness += self.drift
                self.log.append(name)
                return t
            return step
        return {name: make(name) for name in self.work}


def test_a_steady_drift_cancels_out_of_every_ratio():
    work = {"unwatched": 1.0, "watch": 1.04, "null": 1.0, "peer": 1.5}
    machine = DriftingMachine(work, drift=0.01)  # 1% slower per step: 30% over the run
    out = run_bracketed(machine.steps(), rounds=5)
    for name, w in work.items():
        e = out[name]
        # the unwatched steps around a step are one step before and after: their mean is the
        # machine's slowness at that step, exactly, under a linear drift
        assert e["ratio_min"] == pytest.approx(w, rel=1e-9) and e["ratio_max"] == pytest.approx(w, rel=1e-9)
        assert len(e["ratios"]) == 5
    assert out["unwatched"]["step_ms_median"] > 0


def test_every_step_lies_between_two_unwatched_ones_in_a_rotated_order():
    machine = DriftingMachine({"unwatched": 1.0, "a": 1.0, "b": 1.0, "c": 1.0}, drift=0.0)
    run_bracketed(machine.steps(), rounds=3)
    log = machine.log
    assert len(log) == 21  # U v U v U v U per round, 3 rounds
    rounds = [log[i * 7:(i + 1) * 7] for i in range(3)]
    assert all(r[0::2] == ["unwatched"] * 4 for r in rounds)
    assert [r[1::2] for r in rounds] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


def test_the_segments_scheme_is_what_drift_biases():
    """The reason for the bracketed schedule: in segments, a variant run after the unwatched
    one pays for the drift in between. The same machine, in segments of 3 steps, shows it."""
    machine = DriftingMachine({"unwatched": 1.0, "watch": 1.0}, drift=0.01)
    steps = machine.steps()
    base = sorted(steps["unwatched"]() for _ in range(3))[1]
    watched = sorted(steps["watch"]() for _ in range(3))[1]
    assert watched / base > 1.02  # equal work, yet 3% "overhead"
    out = run_bracketed(steps, rounds=3)
    assert out["watch"]["ratio_median"] == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("n", [1, 3, 5, 9, 15, 21, 41])
def test_median_interval_is_order_statistics_that_hold_the_median(n):
    values = [float(i) for i in range(n)]
    random.Random(n).shuffle(values)
    lo, hi = median_interval(values)
    s = sorted(values)
    assert lo in values and hi in values and lo <= s[n // 2] <= hi
    k = s.index(lo) + 1  # 1-based order statistic
    assert s.index(hi) == n - k  # symmetric
    if n >= 6:  # enough rounds for a 90% interval narrower than the whole range
        # P(Binomial(n, 1/2) <= k - 1) <= 5%, and k is the largest such
        tail = sum(math.comb(n, j) for j in range(k)) / 2 ** n
        assert tail <= 0.05 < tail + math.comb(n, k) / 2 ** n
    else:
        assert (lo, hi) == (s[0], s[-1])


def test_median_interval_for_fifteen_rounds_is_the_fourth_values_from_each_end():
    assert median_interval([float(i) for i in range(1, 16)]) == (4.0, 12.0)


def test_settle_runs_before_every_step_outside_the_timing():
    machine = DriftingMachine({"unwatched": 1.0, "watch": 1.1}, drift=0.0)
    settled = []
    out = run_bracketed(machine.steps(), rounds=2, settle=lambda: settled.append(len(machine.log)))
    assert settled == list(range(len(machine.log)))  # once before each of the 6 steps
    assert out["watch"]["ratios"] == [pytest.approx(1.1)] * 2


def test_hook_only_variants_share_the_unwatched_copy_and_leave_no_hook_behind():
    """watch (and the other hook-only variants) step the unwatched model with a watcher
    attached for that step only; sampled keeps its watcher on a copy of its own."""
    from _bracketed import Copies
    from bench_step import build_model

    base, ids, labels = build_model(True)
    copies = Copies(base, ids, labels, ["null", "watch", "prometheus", "sampled"], scrape_interval=0)
    try:
        steps = copies.steps
        shared = steps["unwatched"].__self__.model
        assert steps["null"].__self__ is steps["unwatched"].__self__
        sampled = steps["sampled"].__self__.model
        assert sampled is not shared

        def hooks(model):
            return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

        before = [p.detach().clone() for p in shared.parameters()]
        for name in ("watch", "prometheus"):
            assert steps[name]() > 0
            assert hooks(shared) == 0
        assert any(not torch.equal(a, b) for a, b in zip(before, shared.parameters()))  # it trained
        assert hooks(sampled) > 0
    finally:
        copies.close()
    assert hooks(sampled) == 0
