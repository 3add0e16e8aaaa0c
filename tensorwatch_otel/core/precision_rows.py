"""A batch record's `target_dtypes` part: per measured tensor its counts row on the device (and,
on histogram batches, its histogram row), brought to the host with the record's statistics in
one transfer, then the underflow/overflow shares and the host histogram rows derived from them.

A Record (core/record.py) holds one when the watch has `target_dtypes` and hands it its
statistics to read; the counts and histogram rows are built by core/measure/magnitude.py."""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Tuple, Union, cast

import torch

from .frame_stats import Magnitude
from .frame_draft import Stat
from .measure import magnitude as _mag
from .measure.slot_buffer import SlotStat
from .process import said_once
from .readback import Row, shares_and_rows

log = logging.getLogger(__name__)
SHARES_FAILED = "underflow/overflow shares failed"  # said_once's key: logged once per process

Counts = Union[torch.Tensor, SlotStat, None]


class PrecisionRows:
    """Per measured tensor k: its counts row (None: no float values; on the device path the
    tensor's SlotStat, read with its buffer) and its histogram row (None but on histogram
    batches); after `read`, `underflow[k * len(targets) + j]` and `overflow[...]` (NaN where
    none applies) and `magnitude(k)`. `histogram`: whether this batch takes the histograms,
    decided by the recorder at the batch's first measurement (None until then)."""

    __slots__ = ("targets", "plan", "histogram", "_counts", "_mags", "_rows", "_floats", "underflow",
                 "overflow")

    def __init__(self, targets: Tuple[str, ...]):
        self.targets = targets
        self.plan = _mag.plan_for(targets)
        self.histogram: Optional[bool] = None
        self._counts: List[Counts] = []
        self._mags: List[Optional[torch.Tensor]] = []
        self._rows: List[Optional[Row]] = []  # per k: (host matrix, its row, dtype) or None
        self._floats: List[bool] = []  # per k: the tensor had float values (shares apply)
        self.underflow: List[float] = []
        self.overflow: List[float] = []

    def add(self, counts: List[Counts], mags: List[Optional[torch.Tensor]]) -> None:
        """A frame's rows, one of each per measured tensor."""
        self._counts += counts
        self._mags += mags

    def read(self, stats: List[Stat], have: int,
             extra: Optional[torch.Tensor]) -> Tuple[List[float], Optional[float]]:
        """(the values of `stats[have:]`, the value of `extra`): the statistics not read yet and
        the rows of their tensors in one transfer (all as float64: statistics and counts below
        2**53 exactly), then the shares."""
        k0, k1 = have // 2, len(stats) // 2
        counts, mags = self._counts[k0:k1], self._mags[k0:k1]
        if any(s.__class__ is SlotStat for s in stats[have:]):
            return self._read_slotted(stats, have, extra, counts, mags)
        # with target_dtypes every statistic off the device path is a device tensor
        # (magnitude.measure_counts)
        parts = cast(List[torch.Tensor], stats[have:]) + ([extra] if extra is not None else [])
        if not parts:
            return [], None
        rows = [c for c in counts if isinstance(c, torch.Tensor)] + [m for m in mags if m is not None]
        try:
            head = torch.stack(parts).to(torch.float64)
            flat = torch.cat([head, torch.cat(rows).to(torch.float64)]) if rows else head
        except RuntimeError:  # several devices (a model split over GPUs)
            flat = torch.cat([torch.stack([p.to("cpu").to(torch.float64) for p in parts])]
                             + [r.to("cpu", torch.float64) for r in rows])
        flat = flat.to("cpu", copy=True)
        n = len(parts)
        values = flat[:n].tolist()
        result = values.pop() if extra is not None else None
        self._shares_or_nan(k0, counts, mags, flat[n:], values)
        return values, result

    def _read_slotted(self, stats: List[Stat], have: int, extra: Optional[torch.Tensor], counts: List[Counts],
                      mags: List[Optional[torch.Tensor]]) -> Tuple[List[float], Optional[float]]:
        """`read` on the device path: the SlotStats (abs min/max and counts row in one) come with
        their buffer's one copy; the device tensors among the statistics and rows (odd tensors
        measured with torch ops, histogram rows, `extra`) travel in that copy too when there is
        one buffer on their device, else in one copy of their own."""
        pending = stats[have:]
        tensors = [s for s in pending if isinstance(s, torch.Tensor)] + ([extra] if extra is not None else [])
        rows = [c for c in counts if isinstance(c, torch.Tensor)] + [m for m in mags if m is not None]
        packed = [t.reshape(1).to(torch.float64) for t in tensors] + [r.reshape(-1).to(torch.float64) for r in rows]
        unread = {s.buffer for s in pending if isinstance(s, SlotStat) and not s.read}
        flat: List[float] = []
        if len(unread) == 1 and packed and all(p.device == next(iter(unread)).device for p in packed):
            flat = next(iter(unread)).read(torch.cat(packed))
        else:
            for buf in unread:
                buf.read()
            if packed:
                try:
                    flat = torch.cat(packed).to("cpu", copy=True).tolist()
                except RuntimeError:  # several devices (a model split over GPUs)
                    flat = torch.cat([p.to("cpu") for p in packed]).tolist()
        it = iter(flat)
        values = [s if s.__class__ is float else next(it) if isinstance(s, torch.Tensor)
                  else cast(SlotStat, s).hi if (have + i) & 1 else cast(SlotStat, s).lo for i, s in enumerate(pending)]
        result = next(it) if extra is not None else None
        row_values: List[float] = []
        for c in counts:
            if isinstance(c, SlotStat):
                row_values += c.counts
            elif c is not None:
                row_values += [next(it) for _ in range(c.numel())]
        row_values += it  # the histogram rows
        self._shares_or_nan(have // 2, counts, mags, torch.tensor(row_values, dtype=torch.float64), values)
        return values, result

    def _shares_or_nan(self, k0: int, counts: List[Counts], mags: List[Optional[torch.Tensor]],
                       flat: torch.Tensor, values: List[float]) -> None:
        try:
            rows, under, over = shares_and_rows(self.plan, len(self.targets), counts, mags, flat, values)
        except Exception as exc:  # the shares must not stop training: NaN, said once
            if said_once(SHARES_FAILED):
                log.error("tensorwatch_otel: could not derive the underflow/overflow shares (%s: %s); "
                          "they are NaN, training goes on", type(exc).__name__, exc)
            self._rows += [None] * (len(counts) - (len(self._rows) - k0))
            self._floats += [False] * (len(counts) - (len(self._floats) - k0))  # no fields
            nan = [math.nan] * (len(counts) * len(self.targets))
            self.underflow[k0 * len(self.targets):] = nan
            self.overflow[k0 * len(self.targets):] = list(nan)
            return
        self._rows += rows
        self._floats += [c is not None for c in counts]
        self.underflow += under
        self.overflow += over

    def magnitude(self, k: int) -> Optional[Magnitude]:
        """The histogram of measured tensor k (after `read`), or None."""
        row = self._rows[k] if k < len(self._rows) else None
        if row is None:
            return None
        mat, r, dt = row
        return _mag.magnitude_of(mat[r], dt)

    def of(self, k: int) -> Tuple[Optional[Dict[str, float]], Optional[Dict[str, float]], Optional[Magnitude]]:
        """(underflow, overflow, magnitude) of measured tensor k for its TensorStat (None for a
        tensor without float values or not read back)."""
        if k >= len(self._floats) or not self._floats[k]:
            return None, None, None
        nt = len(self.targets)
        u, o = self.underflow[k * nt:(k + 1) * nt], self.overflow[k * nt:(k + 1) * nt]
        return dict(zip(self.targets, u)), dict(zip(self.targets, o)), self.magnitude(k)
