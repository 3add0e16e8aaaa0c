"""Which batches the watcher measures: one in `every_n_batches` (FixedSampling), or, with
`max_overhead`, one in N where N keeps the watcher's own share of the step within the budget
(OverheadBudget). Either way detection (the step guard) runs on every batch.

The budget's figures: the watcher times its own work with `time.perf_counter` (the frames of a
measured batch, each batch's end, the outermost call, the optimizer-step hooks), and a batch's
length is the wall time from its start to the next batch's start. The share is the watcher's
seconds over the rest of the step's seconds. On a CPU the hooks' time is their cost; on CUDA it
is the time to launch their kernels, not the kernels' device time, so the share there is a lower
bound. Torch's dispatch of a hooked module call and the gradient hooks (`gradients=True`) are
not timed. Wall time: on a machine shared with other work, preemption stretches the step and the
watcher's work alike on average, and makes each sample noisier (the medians absorb single ones).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from typing import AbstractSet, Callable, Deque, Optional, Tuple

from ..events import SamplingRateEvent

log = logging.getLogger(__name__)

#: The longest interval the budget chooses: statistics are never older than this many batches.
MAX_INTERVAL = 1000
#: Recent batches whose costs the medians are taken over (one slow batch is one sample of them).
_SAMPLES = 9
#: A new interval leaves this much of the budget unused (estimates move between evaluations).
_HEADROOM = 1.1
#: The interval shortens only when it is this much longer than the budget needs (hysteresis).
_SHORTEN_AT = 1.5


class FixedSampling:
    """`every_n_batches` alone: batch b is measured when b % every_n_batches == 0 or it is
    traced. Nothing is timed."""

    timed = False
    overhead: Optional[float] = None

    def __init__(self, every_n_batches: int, traced: AbstractSet[int]) -> None:
        self.every_n_batches = every_n_batches
        self._traced = traced

    def watches(self, batch: int) -> bool:
        return batch % self.every_n_batches == 0 or batch in self._traced

    @staticmethod
    def clock() -> float:
        return 0.0

    def spend(self, t0: float) -> None:
        pass


class BatchCosts:
    """The budget's figures: the last samples of a measured batch's cost, an unmeasured one's and
    a step's length (without the watcher's seconds), and the watcher's and the step's seconds
    since the last measured batch began (the current interval)."""

    def __init__(self) -> None:
        self._measured_costs: Deque[float] = deque(maxlen=_SAMPLES)
        self._unmeasured_costs: Deque[float] = deque(maxlen=_SAMPLES)
        self._steps: Deque[float] = deque(maxlen=_SAMPLES)  # batch lengths less the watcher's seconds
        self._interval_spent = 0.0  # since the last measured batch began
        self._interval_step = 0.0

    def add(self, spent: float, step: float) -> None:
        """A batch ended: the watcher's seconds in it and the rest of its length."""
        self._steps.append(step)
        self._interval_spent += spent
        self._interval_step += step

    def add_unmeasured(self, spent: float) -> None:
        self._unmeasured_costs.append(spent)

    def add_measured(self, spent: float) -> None:
        self._measured_costs.append(spent)

    def new_interval(self) -> Optional[float]:
        """A measured batch begins a new interval: the watcher's share of the step over the one
        that ends (None: it holds no step)."""
        share = self._interval_spent / self._interval_step if self._interval_step > 0 else None
        self._interval_spent = self._interval_step = 0.0
        return share

    def medians(self) -> Optional[Tuple[float, float, float]]:
        """(measured, unmeasured, step) over the last samples; None until two measured batches and
        two batch lengths are known."""
        if len(self._measured_costs) < 2 or len(self._steps) < 2:
            return None
        measured = statistics.median(self._measured_costs)
        unmeasured = statistics.median(self._unmeasured_costs) if self._unmeasured_costs else 0.0
        return measured, unmeasured, statistics.median(self._steps)


class OverheadBudget:
    """One batch in `every_n_batches` measured, the interval chosen to keep the watcher's share
    of the step within `max_overhead`.

    The first question about a batch number (`watches`) begins that batch: the one before it
    ends there, and its length and the watcher's seconds in it (`spend`) become samples. Until
    two measured and two batch lengths are known every `floor`-th batch is measured; then, at
    the end of each measured batch, the interval is chosen again: the smallest n with
    (measured + (n - 1) * unmeasured) / (n * step) <= max_overhead (medians of the last
    samples; step without the watcher), given 10% headroom, between `floor` and `limit`. It
    lengthens as soon as the budget needs it and shortens only when 1.5 times longer than
    needed. The first batch and traced batches are always measured, and kept out of the samples
    (warm-up, traces). A change is handed to `emit` as a SamplingRateEvent and logged.
    """

    timed = True

    def __init__(self, max_overhead: float, floor: int, traced: AbstractSet[int], *,
                 emit: Optional[Callable[[SamplingRateEvent], None]] = None, rank: int = 0,
                 clock: Callable[[], float] = time.perf_counter, limit: int = MAX_INTERVAL) -> None:
        self.max_overhead = max_overhead
        self.every_n_batches = floor
        #: the watcher's share of the step over the last complete interval (a measured batch and
        #: the unmeasured ones after it), None until one is complete
        self.overhead: Optional[float] = None
        self.clock = clock
        self._floor = floor
        self._limit = max(limit, floor)
        self._traced = traced
        self._emit = emit
        self._rank = rank
        self._batch = -1  # the batch begun last
        self._measured = False  # whether it is measured
        self._sampled = False  # whether its cost is a sample of a measured batch's
        self._start = 0.0
        self._spent = 0.0  # the watcher's seconds in it so far
        self._last_measured = -1
        self._costs = BatchCosts()
        self._warned = False

    def watches(self, batch: int) -> bool:
        """Whether `batch` is measured; the first question about a later batch begins it."""
        if batch == self._batch:
            return self._measured
        if batch < self._batch:  # an older batch (another thread's): only what is certain
            return batch == self._last_measured or batch in self._traced
        self._begin(batch)
        return self._measured

    def spend(self, t0: float) -> None:
        """The watcher worked from `t0` (a reading of `clock`) until now."""
        self._spent += self.clock() - t0

    def _begin(self, batch: int) -> None:
        now = self.clock()
        if self._batch >= 0:
            self._end(now)
        self._batch, self._start, self._spent = batch, now, 0.0
        forced = batch == 0 or batch in self._traced
        self._measured = forced or batch - self._last_measured >= self.every_n_batches
        self._sampled = self._measured and not forced
        if self._measured:
            self._last_measured = batch
            share = self._costs.new_interval()
            if share is not None:
                self.overhead = share

    def _end(self, now: float) -> None:
        """The batch begun last ends at `now`."""
        if self._batch == 0:  # the first batch's length holds the warm-up
            return
        spent = self._spent
        step = max(now - self._start - spent, 1e-9)
        self._costs.add(spent, step)
        if not self._measured:
            self._costs.add_unmeasured(spent)
        elif self._sampled:
            self._costs.add_measured(spent)
            self._choose()

    def _choose(self) -> None:
        medians = self._costs.medians()
        if medians is None:
            return
        measured, unmeasured, step = medians
        need = self._need(measured, unmeasured, step, self.max_overhead)
        n = self.every_n_batches
        if n < need or (n > self._floor and n >= _SHORTEN_AT * need):
            target = self._need(measured, unmeasured, step, self.max_overhead / _HEADROOM)
            if target != n:
                self._change(target, _share(n, measured, unmeasured, step),
                             _share(target, measured, unmeasured, step))

    def _need(self, measured: float, unmeasured: float, step: float, budget: float) -> int:
        """The smallest interval within `budget` (max_overhead, or less its headroom), between
        floor and limit."""
        room = budget * step - unmeasured  # what measuring may add per batch
        if room <= 0:
            if not self._warned:
                self._warned = True
                m = self.max_overhead
                # (the interval chosen with headroom can find no room where max_overhead itself has some)
                within = f"max_overhead={m:g}" if budget >= m else \
                    f"max_overhead={m:g} less its headroom ({m:g} / {_HEADROOM:g} = {100 * budget:.2f}%)"
                log.warning("tensorwatch_otel: the watcher's work in an unmeasured batch (the step guard, the "
                            "batch's bookkeeping) alone takes %.2f%% of the step, more than %s; "
                            "measuring one batch in %d", 100 * unmeasured / step, within, self._limit)
            return self._limit
        extra = measured - unmeasured
        n = math.ceil(extra / room) if extra > 0 else 1
        return min(max(n, self._floor), self._limit)

    def _change(self, n: int, overhead: float, expected: float) -> None:
        self.every_n_batches = n
        log.info("tensorwatch_otel: measuring one batch in %d from batch %d (the watcher's share of the step "
                 "was %.2f%%, now about %.2f%%; max_overhead=%g)", n, self._batch + 1, 100 * overhead,
                 100 * expected, self.max_overhead)
        if self._emit is not None:
            self._emit(SamplingRateEvent(self._batch + 1, self._rank, n, overhead, expected, self.max_overhead,
                                         time.time()))


def _share(n: int, measured: float, unmeasured: float, step: float) -> float:
    """The watcher's share of the step when one batch in `n` is measured."""
    return (measured + (n - 1) * unmeasured) / (n * step)
