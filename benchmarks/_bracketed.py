"""Bracketed rounds: every variant's step sits between two steps of the unwatched model.

A round runs, in an order rotated each round,

    U  v1  U  v2  U  ...  vk  U

one step at a time, and each variant's ratio is its step over the mean of the two unwatched
steps around it: the two sides of a ratio are a few seconds apart, so drift over minutes (other
tenants of a shared machine) hits both alike.

The unwatched step and the variants that only add hooks (watch, gradients, optimizer_state,
prometheus, module, and null: no hooks at all) train one shared copy of the model: a watcher is
attached for the variant's step and detached after it, outside the timing. Two copies of the
same model can differ by a few percent in step time (where their memory landed), which a
shared copy keeps out of these ratios. `sampled` and `budget` need one watcher to see consecutive batches
and the peer cannot detach: each trains a copy of its own (same weights at the start), so their
ratios also hold that copy-to-copy difference.
"""

from __future__ import annotations

import contextlib
import copy
import io
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch

from bench_step import WATCH_OPTIONS, Trainer, _prometheus_sink, summarise


TOGGLED = ("watch", "gradients", "optimizer_state", "prometheus", "module", "fp8", "fp8_fp16_bf16")


class Copies:
    """name -> one training step of that variant (see the module text). close() detaches the
    watchers that stay attached."""

    def __init__(self, base, ids, labels, names: List[str], autocast: Optional[torch.dtype] = None,
                 scrape_interval: float = 15.0):
        import tensorwatch_otel as tw

        shared = Trainer(copy.deepcopy(base), ids, labels, autocast)
        self.steps: Dict[str, Callable[[], float]] = {"unwatched": shared.step}
        self._watchers: list = []
        self._sinks: list = []
        for name in names:
            if name == "null":
                self.steps[name] = shared.step
            elif name in TOGGLED:
                sinks = [_prometheus_sink(scrape_interval)] if name == "prometheus" else []
                self._sinks += sinks
                self.steps[name] = _toggled(shared, WATCH_OPTIONS[name], sinks)
            elif name in ("sampled", "budget"):
                own = Trainer(copy.deepcopy(base), ids, labels, autocast)
                self._watchers.append(tw.watch(own.model, sinks=[], on_detect="report",
                                               **WATCH_OPTIONS[name]))
                self.steps[name] = own.step
            elif name == "peer":
                from transformers.debug_utils import DebugUnderflowOverflow

                own = Trainer(copy.deepcopy(base), ids, labels, autocast)
                DebugUnderflowOverflow(own.model)
                self.steps[name] = _quiet(own.step)

    def warm_up(self, n: int) -> None:
        for step in self.steps.values():
            for _ in range(n):
                step()

    def close(self) -> None:
        for w in self._watchers:
            w.detach()
        for sink in self._sinks:
            sink.close()
        self._watchers.clear()
        self._sinks.clear()
        self.steps.clear()


def _toggled(trainer: Trainer, options: dict, sinks: list) -> Callable[[], float]:
    """One step of the shared copy with a watcher attached for it (the attaching and detaching
    are not timed; the sinks live across steps, as they would in a run)."""
    import tensorwatch_otel as tw

    def step() -> float:
        with tw.watch(trainer.model, sinks=sinks, on_detect="report", **options):
            return trainer.step()
    return step


def _quiet(step: Callable[[], float]) -> Callable[[], float]:
    """The peer prints its report on a detection: keep the benchmark's output clean."""
    def run() -> float:
        with contextlib.redirect_stdout(io.StringIO()):
            return step()
    return run


def run_bracketed(steps: Dict[str, Callable[[], float]], rounds: int,
                  settle: Optional[Callable[[], object]] = None) -> Dict[str, dict]:
    """Bracketed rounds (see the module text); per variant the median, quartiles, min and max of
    its ratios over rounds. `settle` runs before every step, untimed (bench_paired: a full
    garbage collection, so no step pays for the garbage of the one before it). Prints progress
    to stderr and a table to stdout."""
    if settle is not None:
        steps = {name: _settled(step, settle) for name, step in steps.items()}
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
    return summarise({"unwatched": [1.0] * rounds, **ratios}, step_s)


def _settled(step: Callable[[], float], settle: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        settle()
        return step()
    return run


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
