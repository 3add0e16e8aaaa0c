"""The two rotating buckets of a metrics window (_aggregate.Window): per-column extremes of the
batches of the last half window and of the half before it, rotated as batches arrive.

Rows: abs_min, abs_max, range_used, then the underflow and overflow shares of each target dtype;
column 0 is the trash (filtered or capped tensors, never exported).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

UNSEEN = -1.0  # abs values and ratios are >= 0: a max below 0 means "not in this bucket"


class Buckets:
    """The two rotating buckets of a window: rows of extremes (abs_min, abs_max, range_used, then
    the underflow and overflow shares of each target dtype) by column. The current one is folded
    into; it becomes the previous one after half the window, so the two cover between half the
    window and the whole of it."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._rows = 3
        self._cur = self._new(64)
        self._prev: Optional[torch.Tensor] = None
        self._cur_start = -math.inf

    def _new(self, columns: int) -> torch.Tensor:
        b = torch.empty((self._rows, columns), dtype=torch.float64)
        b[0].fill_(math.inf)  # abs_min
        b[1:].fill_(UNSEEN)  # abs_max, range_used, shares
        return b

    def current(self, now: float, columns: int, rows: int) -> torch.Tensor:
        """The bucket to fold a batch into at `now`, rotated when due and grown to `columns`
        columns (the trash column 0 included) and `rows` rows."""
        age = now - self._cur_start
        if self.window_s <= 0 or age >= self.window_s / 2:
            self._prev = self._cur if 0 < self.window_s and age < self.window_s else None
            self._cur = self._new(self._cur.shape[1])
            self._cur_start = now
        if columns > self._cur.shape[1] or rows > self._cur.shape[0]:
            self._grow(columns, rows)
        return self._cur

    def _grow(self, columns: int, rows: int) -> None:
        self._rows = rows
        size = max(columns, 2 * self._cur.shape[1]) if columns > self._cur.shape[1] else self._cur.shape[1]
        self._cur = self._grown(self._cur, size)
        if self._prev is not None:
            self._prev = self._grown(self._prev, size)

    def _grown(self, old: torch.Tensor, size: int) -> torch.Tensor:
        new = self._new(size)
        new[:old.shape[0], :old.shape[1]] = old
        return new

    def both(self) -> torch.Tensor:
        """A copy of the current bucket with the previous one folded in."""
        cur, prev = self._cur, self._prev
        if prev is not None:
            n = min(cur.shape[1], prev.shape[1])
            both = cur.clone()
            both[0, :n] = torch.minimum(cur[0, :n], prev[0, :n])
            both[1:, :n] = torch.maximum(cur[1:, :n], prev[1:, :n])
        else:
            both = cur.clone()
        return both
