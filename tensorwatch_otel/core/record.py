"""The batch record: one record per batch (device statistics in call order, read back in one
transfer to the host), the frames it holds and the frames built from it."""

from __future__ import annotations

import array
import bisect
import math
from typing import Any, Iterator, List, Optional, Tuple, cast

import torch

from .frame_stats import NOTE_CHANGED, Frame, Magnitude, TensorStat
from .frame_draft import FrameDraft, Item, ModuleInfo, Stat
from .measure.slot_buffer import SlotBuffer, SlotStat
from .measure.stats import DTYPE_MAX, dtype_name
from .precision_rows import PrecisionRows
from .readback import code_values, lose_changed, slot_values


class _Frames:
    """A record's frames as three parallel lists (per frame: its module, its items, the index
    of its first measured tensor): a frame adds no object of its own for the garbage collector
    to track and promote (a recorded batch holds one per module call until its end)."""

    __slots__ = ("infos", "items", "firsts")

    def __init__(self) -> None:
        self.infos: List[ModuleInfo] = []
        self.items: List[List[Item]] = []
        self.firsts: List[int] = []

    def add(self, info: ModuleInfo, items: List[Item], first: int) -> None:
        self.infos.append(info)
        self.items.append(items)
        self.firsts.append(first)

    def drop(self, fi: int) -> None:
        del self.infos[fi], self.items[fi], self.firsts[fi]

    def triples(self) -> Iterator[Tuple[ModuleInfo, List[Item], int]]:
        return zip(self.infos, self.items, self.firsts)


class Record:
    """One batch (or one phase of it): device stats in call order, and per frame its module,
    its items (a tensor name (str) per measured tensor, or a (name, note) pair for a value
    without statistics) and its first tensor index.

    The layout (frames as `_Frames`' columns, two stats per measured tensor: abs min, abs max)
    is this class's and private: frames come in whole, built in a FrameDraft and handed over
    with `add_frame`; they are read with `frame_count`, `frame_info`, `frame_items`,
    `measured`, `abs_min_entry`, `host_extremes`, `materialize` and `first_nonfinite_frame`.
    A frame's items list may be one that other frames (of this record or others) hold too: it
    is read, never written."""

    __slots__ = ("batch_number", "_stats", "_dtypes", "_frames", "_host", "phase", "detected", "header",
                 "targets", "precision", "_lost", "_code_buf", "_n_others")

    def __init__(self, batch_number: int, phase: str = "forward", header: bool = True,
                 targets: Tuple[str, ...] = ()):
        self.batch_number = batch_number
        # abs_min, abs_max, abs_min, ...: 0-d device tensors, floats already on the host (CPU), or
        # device buffer slots (the same SlotStat at a tensor's two places)
        self._stats: List[Stat] = []
        self._dtypes: List[torch.dtype] = []  # one per measured tensor
        self._frames = _Frames()
        self._host: List[float] = []  # the stats read back so far, in order
        self.phase = phase
        self.detected = False  # one detection per record (check="module" checks every frame)
        self.header = header and phase == "forward"  # its first frame starts a batch in the report
        # target_dtypes (core/measure/magnitude.py): the counts and histogram rows, the shares
        self.targets = targets
        self.precision = PrecisionRows(targets) if targets else None
        # measured tensors whose values were lost (a deferred measurement read the tensor after an
        # in-place write, core/measure/slot_buffer.py): their host values are 0.0 placeholders, never
        # shown, exported or checked
        self._lost: Optional[set[int]] = None
        self._code_buf: Optional[SlotBuffer] = None  # the buffer its slot codes (ints) are of
        # statistics that are not slot codes added since readback last read them with the codes
        # (while none is, every pending one is a code: readback takes them in a few tensor ops,
        # _readback_codes)
        self._n_others = 0

    # ------------------------------------------------------------------ the layout
    def add_frame(self, info: ModuleInfo, draft: FrameDraft) -> None:
        """A frame: its module and what its draft holds (the draft's items list is kept)."""
        first = len(self._dtypes)
        self._stats += draft.stats
        self._n_others += len(draft.stats)
        self._dtypes += draft.dtypes
        counts = draft.counts
        if counts:  # (target_dtypes)
            cast(PrecisionRows, self.precision).add(counts, draft.mags)
        self._frames.add(info, draft.items, first)

    def uses_codes(self, buf: SlotBuffer) -> None:
        """Some statistic of a frame added (or about to be) is a slot code of `buf`."""
        self._code_buf = buf

    def add_lists(self, info: ModuleInfo, items: List[Item], stats: List[Stat], dtypes: List[torch.dtype],
                  codes: Optional[SlotBuffer] = None, others: int = 0) -> None:
        """A frame given as a draft's three lists (items kept; no counts rows: no target_dtypes);
        `codes`: the buffer of the slot codes among `stats` (one buffer a record); `others`: how
        many of `stats` are not codes."""
        if codes is not None:
            self._code_buf = codes
        self._n_others += others
        first = len(self._dtypes)
        self._stats += stats
        self._dtypes += dtypes
        self._frames.add(info, items, first)

    @property
    def frame_count(self) -> int:
        return len(self._frames.infos)

    @property
    def stat_count(self) -> int:
        """Statistics held (two per measured tensor), read back or not."""
        return len(self._stats)

    def frame_info(self, fi: int) -> ModuleInfo:
        return self._frames.infos[fi]

    def frame_items(self, fi: int) -> List[Item]:
        return self._frames.items[fi]

    def drop_frame(self, fi: int) -> None:
        """Frame `fi` leaves the record (its stats stay: nothing else moves)."""
        self._frames.drop(fi)

    def measured(self) -> Iterator[Tuple[ModuleInfo, str, int, torch.dtype]]:
        """(module, tensor name, tensor index, dtype) of every measured tensor whose values are
        known, in order."""
        dtypes = self._dtypes
        lost = self._lost or ()
        for info, items, k in self._frames.triples():
            for it in items:
                if it.__class__ is str:
                    if k < len(dtypes) and k not in lost:
                        yield info, it, k, dtypes[k]
                    k += 1

    def layout_key(self) -> Tuple[List[List[Any]], List[torch.dtype]]:
        """What two records with the same layout hold equal (compare with ==, in C): the
        record's own lists (modules, items, first indexes; dtypes), to compare or copy, never
        to write."""
        f = self._frames
        return [f.infos, f.items, f.firsts], self._dtypes

    def host_extremes(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The values read back so far: abs mins and abs maxs, one float64 tensor each (views of
        one buffer), in tensor index order."""
        host = self._host
        values = torch.frombuffer(array.array("d", host), dtype=torch.float64) if host else \
            torch.empty(0, dtype=torch.float64)
        return values[0::2], values[1::2]

    def abs_min_entry(self, fi: int, name: str) -> Optional[Stat]:
        """The abs-min entry of tensor `name` of frame `fi` as recorded (a 0-d tensor, a float
        the CPU kernel wrote, or a device buffer's SlotStat), or None."""
        f = self._frames
        if not 0 <= fi < len(f.infos):
            return None
        items, k = f.items[fi], f.firsts[fi]
        for it in items:
            if it.__class__ is str:
                if it == name:
                    return self._stats[2 * k] if 2 * k < len(self._stats) else None
                k += 1
        return None

    def readback(self, extra: Optional[torch.Tensor] = None) -> Optional[float]:
        """Bring the not yet read stats to the host: one transfer. `extra`, a 0-d tensor (the
        loss scale), travels in the same transfer; its value is returned."""
        if self.precision is not None:
            read, scale = self.precision.read(self._stats, len(self._host), extra)
            self._host += read
            return scale
        stats = self._stats
        have = len(self._host)
        pending = stats[have:] if have else stats
        if extra is not None:
            pending = pending + [extra]
        if not pending:
            return None
        if self._code_buf is not None:
            if self._n_others == 0:  # every pending statistic is a slot code
                return self._readback_codes(pending, have, extra)
            self._n_others = 0
            lost = self._lost if self._lost is not None else set()
            pending = code_values(self._code_buf, pending, have, lost)
            if lost:
                self._lost = lost
        # CPU statistics read by the compiled kernel are Python floats already (stats.measure_host)
        others: List[Stat] = [s for s in pending if s.__class__ is not float]
        if others and any(s.__class__ is SlotStat for s in others):
            # the device path's slots: each device buffer copied to the host once (SlotBuffer.read)
            pending = slot_values(pending, have)
            if any(isinstance(s, SlotStat) and s.changed for s in others):
                lost = self._lost if self._lost is not None else set()
                lose_changed(self._stats, pending, have, lost)
                self._lost = lost
            others = [s for s in pending if s.__class__ is not float]
        values: List[float]
        if not others:
            values = cast(List[float], pending)  # floats only
        else:
            tensors = cast(List[torch.Tensor], others)  # 0-d tensors only (slots resolved above)
            try:
                stacked = torch.stack(tensors)
            except RuntimeError:  # stats on several devices (a model split over GPUs)
                stacked = torch.stack([s.to("cpu").to(torch.float64) for s in tensors])
            read = stacked.to("cpu", copy=True).tolist()
            if len(tensors) == len(pending):
                values = read
            else:
                it = iter(read)
                values = [s if s.__class__ is float else next(it) for s in pending]
        if extra is not None:
            self._host += values[:-1]
            return values[-1]
        self._host += values
        return None

    def _readback_codes(self, pending: List[Stat], first: int, extra: Optional[torch.Tensor]) -> Optional[float]:
        """readback() when every pending statistic is a slot code (the device path's usual batch):
        their values gathered in a few tensor ops, `extra` in the buffer's one copy."""
        buf = self._code_buf
        assert buf is not None
        codes_list = pending[:-1] if extra is not None else pending
        result: Optional[float] = None
        if buf.waits():
            rest = buf.read(extra.reshape(1).to(torch.float64) if extra is not None else None)
            result = rest[0] if extra is not None else None
        elif extra is not None:
            result = float(extra)
        if not codes_list:
            return result
        codes = torch.tensor(codes_list, dtype=torch.int64)
        epochs = codes >> 32
        slots = codes & 0xFFFFFFFF
        places = 2 * slots + ((torch.arange(len(codes_list)) + first) & 1)
        values = torch.zeros(len(codes_list), dtype=torch.float64)
        lost_at: List[int] = []
        for epoch in epochs.unique().tolist():
            got = buf.decoded(epoch)
            mask = epochs == epoch
            if got is None:  # (too old a read: never expected)
                lost_at += torch.nonzero(mask).view(-1).tolist()
                continue
            decoded, lost = got
            values[mask] = decoded[places[mask]]
            if lost:
                gone = mask & torch.isin(slots, torch.tensor(sorted(lost), dtype=torch.int64))
                values[gone] = 0.0
                lost_at += torch.nonzero(gone).view(-1).tolist()
        if lost_at:
            lost_set = self._lost if self._lost is not None else set()
            lost_set.update((first + i) // 2 for i in lost_at)
            self._lost = lost_set
        self._host += values.tolist()
        return result

    # target_dtypes' part, as the metric sinks read it (frame_stats.RecordColumns)
    @property
    def histogram(self) -> Optional[bool]:
        return self.precision.histogram if self.precision is not None else None

    @property
    def underflow(self) -> List[float]:
        return self.precision.underflow if self.precision is not None else []

    @property
    def overflow(self) -> List[float]:
        return self.precision.overflow if self.precision is not None else []

    def magnitude(self, k: int) -> Optional[Magnitude]:
        """The histogram of measured tensor k (after readback()), or None."""
        return self.precision.magnitude(k) if self.precision is not None else None

    def materialize(self, lo: int = 0, hi: Optional[int] = None) -> Tuple[Frame, ...]:
        host, dtypes = self._host, self._dtypes
        out = []
        infos, items_of, firsts = self._frames.infos, self._frames.items, self._frames.firsts
        hi = len(infos) if hi is None else hi
        for idx in range(lo, hi):
            info, items, k = infos[idx], items_of[idx], firsts[idx]
            stats = []
            for it in items:
                if it.__class__ is str:
                    mn, mx, dt = host[2 * k], host[2 * k + 1], dtypes[k]
                    k += 1
                    if self._lost and k - 1 in self._lost:
                        stats.append(TensorStat(it, None, None, dtype_name(dt), NOTE_CHANGED))
                        continue
                    top = DTYPE_MAX.get(dt)
                    used = mx / top if top and mx == mx else None
                    if self.precision is not None:
                        stats.append(TensorStat(it, mn, mx, dtype_name(dt), "", used, *self.precision.of(k - 1)))
                    else:
                        stats.append(TensorStat(it, mn, mx, dtype_name(dt), "", used))
                else:
                    stats.append(TensorStat(it[0], None, None, "", it[1]))
            out.append(Frame(info.path, info.cls, tuple(stats), self.batch_number,
                             batch_start=(idx == 0 and self.header), phase=self.phase))
        return tuple(out)

    def first_nonfinite_frame(self, first_frame: int) -> Optional[int]:
        """Index of the first frame at or after `first_frame` holding inf/nan (host stats)."""
        firsts = self._frames.firsts
        if first_frame < 0 or first_frame >= len(firsts):
            return None
        start = firsts[first_frame] * 2
        host = self._host
        if math.isfinite(sum(host[start:])):
            return None
        bad = next((i for i in range(start, len(host)) if not math.isfinite(host[i])), None)
        if bad is None:
            return None  # the sum overflowed; every value is finite
        return bisect.bisect_right(firsts, bad // 2) - 1
