"""target_dtypes: a module call's tensors with their magnitude counts (`MagnitudeFrames`, the
recorder's, core/frames/recorder.py).

param() and tensor() with a counts row per measured tensor (d.counts), read with the abs
min/max, and on histogram batches a histogram row (d.mags) (core/measure/magnitude.py); the same
caches, a cached measurement reused only with its rows. On the device path, outside histogram
batches, the tensors the fused kernel reads are gathered as the plain ones are and counted in
the frame's launch (counted_on_device); the others, and every tensor of a histogram batch, take
measure_counts (torch ops or the CPU kernel) at once.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple, Union

import torch

from ..frame_draft import FrameDraft
from ..record import Record
from ..measure.magnitude import HISTOGRAM_EVERY, measure_counts
from ..measure.slot_buffer import SlotStat
from .frame_batch import UNREAD, ActsSeen, FrameBatch, ParamsSeen, StatPair

PLAIN = (torch.nn.Parameter, torch.Tensor)  # data_ptr() is cheap and defined for these


class MagnitudeFrames:
    """The counts rows of one recorder's measurements, and which batches take histograms."""

    def __init__(self) -> None:
        # id(abs-min entry) -> (that entry, its counts row, its histogram row): the rows of a
        # measurement the recorder's caches reuse (core/measure/magnitude.py); on the device path
        # the entry and the counts row are the tensor's SlotStat
        self.seen: Dict[int, Tuple[Union[torch.Tensor, SlotStat], Union[torch.Tensor, SlotStat, None],
                                   Optional[torch.Tensor]]] = {}
        self._hist_batch = (-1, False, 0)  # (batch number, histogram batch?, watched batches seen)

    def clear(self) -> None:
        self.seen.clear()

    def counted(self, slot: SlotStat) -> None:
        """A device kernel's SlotStat that is its tensor's counts row too (FrameBatch.finish)."""
        self.seen[id(slot)] = (slot, slot, None)

    def histogram(self, rec: Record) -> bool:
        """Whether `rec`'s batch takes the Magnitude histograms: the first watched batch, then
        every HISTOGRAM_EVERY-th watched batch (decided once per batch number)."""
        b, hist, seen = self._hist_batch
        if b != rec.batch_number:
            hist = seen % HISTOGRAM_EVERY == 0
            self._hist_batch = (rec.batch_number, hist, seen + 1)
        precision = rec.precision
        assert precision is not None  # (a record of a watch with target_dtypes)
        precision.histogram = hist
        return hist

    def reuse(self, r: StatPair, dtype: torch.dtype, name: str, d: FrameDraft) -> bool:
        m = self.seen.get(id(r[0]))
        if m is None or m[0] is not r[0]:
            return False
        d.stats += r
        d.dtypes.append(dtype)
        d.counts.append(m[1])
        d.mags.append(m[2])
        d.items.append(name)
        return True

    def measure(self, rec: Record, t: torch.Tensor, name: str,
                d: FrameDraft) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        precision = rec.precision
        assert precision is not None  # (a record of a watch with target_dtypes: only then is this called)
        hist = precision.histogram
        if hist is None:
            hist = self.histogram(rec)
        r = measure_counts(t, precision.plan, hist)
        if isinstance(r, str):
            d.items.append((name, r))
            return None
        pair: Tuple[torch.Tensor, torch.Tensor] = (r[0], r[1])
        self.seen[id(r[0])] = (r[0], r[2], r[3])
        d.stats += pair
        d.dtypes.append(t.dtype)
        d.counts.append(r[2])
        d.mags.append(r[3])
        d.items.append(name)
        return pair

    def counted_on_device(self, fb: FrameBatch, rec: Record, t: torch.Tensor, is_param: bool, version: int,
                          ptr: int, name: str, d: FrameDraft) -> bool:
        """Gather `t` for the frame's fused launch with its counts (the plain path's gathering,
        FrameBatch.finish fills its places, its counts row and the caches); False when the device
        kernel does not take it here: no device path, no frame being gathered, a histogram
        batch (the histogram rows are torch ops), or a tensor the kernel does not read."""
        device = fb.device
        if device is None or not fb.on:
            return False
        hist = rec.histogram
        if hist is None:
            hist = self.histogram(rec)
        if hist or not device.add(t, counted=True):
            return False
        fb.on_device.append(True)
        fb.pending.append((len(d.stats), t, is_param, version, ptr))
        d.stats += UNREAD
        d.dtypes.append(t.dtype)
        d.counts.append(None)  # the SlotStat, at FrameBatch.finish
        d.mags.append(None)
        d.items.append(name)
        return True

    def param(self, rec: Record, p: torch.Tensor, name: str, d: FrameDraft, params_seen: ParamsSeen,
              fb: FrameBatch) -> None:
        seen = params_seen.get(id(p))
        version = p._version
        ptr = p.data_ptr() if p.__class__ in PLAIN else id(p)
        if seen is not None and seen[0] is p and seen[1] == version and seen[2] == ptr and seen[3] is p.dtype \
                and self.reuse(seen[4], seen[3], name, d):
            return
        if self.counted_on_device(fb, rec, p, True, version, ptr, name, d):
            return
        pair = self.measure(rec, p, name, d)
        if pair is not None:
            params_seen[id(p)] = (p, version, ptr, p.dtype, pair)

    def tensor(self, rec: Record, t: torch.Tensor, name: str, d: FrameDraft, acts_seen: ActsSeen,
               fb: FrameBatch) -> None:
        key = id(t)
        seen = acts_seen.get(key)
        if seen is not None and seen[0]() is t and seen[1] == t._version \
                and self.reuse(seen[2], seen[3], name, d):
            return
        if not t.is_inference() and self.counted_on_device(fb, rec, t, False, t._version, 0, name, d):
            return
        pair = self.measure(rec, t, name, d)
        if pair is None:
            return
        try:
            acts_seen[key] = (weakref.ref(t), t._version, pair, t.dtype)
        except (TypeError, RuntimeError):  # no weakref / no version (inference tensors): no reuse
            pass
