"""Power-of-two histograms of |x| per (module, tensor), for the OpenTelemetry exponential
histogram ``tensorwatch.tensor.magnitude`` (scale 0: bucket i holds |x| in (2**i, 2**(i+1)];
exact zeros in the zero bucket), summed over the batches sampled at each collection.

Reading a batch's counts costs Python work per tensor (``Record.magnitude(k)``), too much for
every batch of a big model (and the watcher counts it only on a cadence of batches, see
core/measure/magnitude.HISTOGRAM_EVERY). So the training thread only keeps a reference to the latest
batch that has one, and each collection (every export interval) adds that batch's exact counts once: the histogram
is the run's distribution sampled one batch per collection, which is what a heatmap of its
increase needs, at one batch's cost per export interval.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple


class _Totals:
    __slots__ = ("zeros", "offset", "counts", "start_ns")

    def __init__(self, start_ns: int):
        self.zeros = 0
        self.offset = 0
        self.counts: List[int] = []
        self.start_ns = start_ns

    def add(self, zeros: int, offset: int, counts: Sequence[int]) -> None:
        self.zeros += int(zeros)
        n = len(counts)
        if not n:
            return
        if not self.counts:
            self.offset, self.counts = int(offset), [int(c) for c in counts]
            return
        lo = min(self.offset, offset)
        hi = max(self.offset + len(self.counts), offset + n)
        if lo != self.offset or hi != self.offset + len(self.counts):
            merged = [0] * (hi - lo)
            merged[self.offset - lo:self.offset - lo + len(self.counts)] = self.counts
            self.offset, self.counts = lo, merged
        base = offset - self.offset
        mine = self.counts
        for i, c in enumerate(counts):
            mine[base + i] += int(c)


class MagnitudeTotals:
    """Sums of the sampled batches' magnitude counts, by Window column (0: never exported)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: Optional[tuple] = None  # the latest batch not yet added
        self._totals: Dict[int, _Totals] = {}
        self.sampled = 0  # batches added so far

    # -- training thread ----------------------------------------------------------------------
    def add_record(self, rec, index, n: int, t_ns: int) -> None:
        """A batch record: ``rec.magnitude(k)`` for its first n measured tensors, ``index`` (a
        tensor) their columns. Replaces a latest batch not yet added."""
        self._latest = ("rec", rec, index, n, t_ns)

    def add_values(self, mags: Sequence, index, t_ns: int) -> None:
        """Magnitudes already built (frames), in the order of ``index``."""
        self._latest = ("list", mags, index, len(mags), t_ns)

    # -- collection thread ----------------------------------------------------------------------
    def _fold(self) -> None:
        item, self._latest = self._latest, None
        if item is None:
            return
        kind, src, index, n, t_ns = item
        totals = self._totals
        cols = index.tolist()
        for k in range(min(n, len(cols))):
            col = cols[k]
            if not col:
                continue
            m = src.magnitude(k) if kind == "rec" else src[k]
            if m is None:
                continue
            entry = totals.get(col)
            if entry is None:
                entry = totals[col] = _Totals(t_ns)
            entry.add(m.zeros, m.offset, m.counts)
        self.sampled += 1

    def collect(self) -> List[Tuple[int, int, int, Tuple[int, ...], int]]:
        """(column, zeros, offset, counts, start time ns) of every column seen so far."""
        with self._lock:
            self._fold()
            return [(col, t.zeros, t.offset, tuple(t.counts), t.start_ns) for col, t in self._totals.items()]

    def rows(self, keys: Sequence[Optional[Sequence[str]]]) -> list:
        """collect() with the columns' (label, tensor, module_class) from Window keys."""
        return [(keys[col][0], keys[col][2], keys[col][1], zeros, offset, counts, start)
                for col, zeros, offset, counts, start in self.collect() if col < len(keys)]
