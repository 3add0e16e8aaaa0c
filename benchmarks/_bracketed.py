"""Bracketed rounds: every variant's step sits between two steps of the unwatched model.

Each variant trains its own copy of the model (same weights at the start), watched for the
whole run the way a user leaves it on. A round runs, in an order rotated each round,

    U  v1  U  v2  U  ...  vk  U

one step at a time, and each variant's ratio is its step over the mean of the two unwatched
steps around it: the two sides of a ratio are a few seconds apart, so drift over minutes (other
tenants of a shared machine) hits both alike. Every step follows a step of another copy, so
none of them starts with the caches of its own last step.
"""

from __future__ import annotations

import contextlib
import copy
import io
import statistics
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch

from bench_step import WATCH_OPTIONS, Trainer, _prometheus_sink, quartiles


class Copies:
    """name -> one training step of that variant's own model copy. Watchers stay attached
    until close()."""

    def __init__(self, base, ids, labels, names: List[str], autocast: Optional[torch.dtype] = None,
                 scrape_interval: float = 15.0):
        import tensorwatch_otel as tw

        self.steps: Dict[str, Callable[[], float]] = {}
        self._watchers = []
        for name in ["unwatched"] + [n for n in names if n != "unwatched"]:
            trainer = Trainer(copy.deepcopy(base), ids, labels, autocast)
            if name in WATCH_OPTIONS:
                sinks = [_prometheus_sink(scrape_interval)] if name == "prometheus" else []
                self._watchers.append(tw.watch(trainer.model, sinks=sinks, on_detect="report",
                                               **WATCH_OPTIONS[name]))
            elif name == "peer":
                from transformers.debug_utils import DebugUnderflowOverflow

                DebugUnderflowOverflow(trainer.model)
                self.steps[name] = _quiet(trainer.step)
                continue
            self.steps[name] = trainer.step

    def warm_up(self, n: int) -> None:
        for step in self.steps.values():
            for _ in range(n):
                step()

    def close(self) -> None:
        for w in self._watchers:
            w.detach()
        self._watchers.clear()
        self.steps.clear()


def _quiet(step: Callable[[], float]) -> Callable[[], float]:
    """The peer prints its report on a detection: keep the benchmark's output clean."""
    def run() -> float:
        with contextlib.redirect_stdout(io.StringIO()):
            return step()
    return run


def run_bracketed(steps: Dict[str, Callable[[], float]], rounds: int) -> Dict[str, dict]:
    """Bracketed rounds (see the module text); per variant the median, quartiles, min and max of
    its ratios over rounds. Prints progress to stderr and a table to stdout."""
    unwatched = steps["unwatched"]
    order = [n for n in steps if n != "unwatched"]
    ratios: Dict[str, List[float]] = {n: [] for n in order}
    step_s: Dict[str, List[float]] = {n: [] for n in steps}
    for r in range(rounds):
        rotated = order[r % len(order):] + order[:r % len(order)] if order else []
        before = unwatched()
        step_s["unwatched"].append(before)
        for name in rotated:
            t = steps[name]()
            after = unwatched()
            step_s[name].append(t)
            step_s["unwatched"].append(after)
            ratios[name].append(t / ((before + after) / 2))
            before = after
        print(f"round {r + 1}/{rounds}: " + "  ".join(
            f"{n} {ratios[n][-1]:.3f}" for n in order), file=sys.stderr)
    return summarise(ratios, step_s, rounds)


def summarise(ratios: Dict[str, List[float]], step_s: Dict[str, List[float]], rounds: int) -> Dict[str, dict]:
    out: Dict[str, dict] = {"unwatched": _entry([1.0] * rounds, step_s["unwatched"])}
    out.update({name: _entry(r, step_s[name]) for name, r in ratios.items()})
    print(f"\n{'variant':<16} {'ratio median':>12} {'q1':>7} {'q3':>7} {'min':>7} {'max':>7} "
          f"{'step ms (median)':>17}")
    for name, e in out.items():
        print(f"{name:<16} {e['ratio_median']:>12.3f} {e['ratio_q1']:>7.3f} {e['ratio_q3']:>7.3f} "
              f"{e['ratio_min']:>7.3f} {e['ratio_max']:>7.3f} {e['step_ms_median']:>17.0f}")
    return out


def _entry(ratios: List[float], times: List[float]) -> dict:
    q1, q3 = quartiles(ratios)
    return {"ratio_median": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
            "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios,
            "step_ms_median": statistics.median(times) * 1000, "step_ms": [t * 1000 for t in times]}


def median_interval(ratios: List[float], level: float = 0.9) -> Tuple[float, float]:
    """A distribution-free interval for the median: order statistics (binomial, p = 1/2) that
    hold it with probability >= level; the extremes when there are too few rounds."""
    n = len(ratios)
    s = sorted(ratios)
    from math import comb

    cdf, k = 0.0, 0
    tail = (1 - level) / 2
    while k < n:  # largest k with P(Binomial(n, 1/2) <= k - 1) <= tail
        nxt = cdf + comb(n, k) / 2 ** n
        if nxt > tail:
            break
        cdf, k = nxt, k + 1
    if k == 0:
        return s[0], s[-1]
    return s[k - 1], s[n - k]
