"""Batch records and the ring: one record per batch (device statistics in call order, read
back in one transfer), and the history of finished records the detection ring reaches into."""

from __future__ import annotations

import bisect
import math
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from .events import Frame, TensorStat
from .naming import module_class_name
from .stats import DTYPE_MAX, dtype_name


class ModuleInfo:
    """What a hook knows of its module: path, class name, the live parameter dict."""

    __slots__ = ("path", "cls", "params", "kw_names", "is_root", "recorded")

    def __init__(self, path: str, module: torch.nn.Module, is_root: bool, recorded: bool,
                 cls: Optional[str] = None, params: Optional[dict] = None):
        self.path = path
        self.cls = cls or module_class_name(module)
        # live dict: a replaced parameter is seen at once
        self.params = module._parameters if params is None else params
        self.kw_names: Dict[str, str] = {}
        self.is_root = is_root
        self.recorded = recorded


class Record:
    """One batch (or one phase of it): device stats in call order, and per frame
    (info, items, first tensor index). `items` holds a tensor name (str) per measured tensor,
    or a (name, note) pair for a value without statistics."""

    __slots__ = ("batch_number", "stats", "dtypes", "frames", "host", "phase", "detected", "header")

    def __init__(self, batch_number: int, phase: str = "forward", header: bool = True):
        self.batch_number = batch_number
        # abs_min, abs_max, abs_min, ...: 0-d device tensors, or floats already on the host (CPU)
        self.stats: List[Union[torch.Tensor, float]] = []
        self.dtypes: List[torch.dtype] = []  # one per measured tensor
        self.frames: List[tuple] = []  # (info, items, first tensor index)
        self.host: List[float] = []
        self.phase = phase
        self.detected = False  # one detection per record (check="module" checks every frame)
        self.header = header and phase == "forward"  # its first frame starts a batch in the report

    def readback(self, extra: Optional[torch.Tensor] = None) -> Optional[float]:
        """Bring the not yet read stats to the host: one transfer. `extra`, a 0-d tensor (the
        loss scale), travels in the same transfer; its value is returned."""
        stats = self.stats
        have = len(self.host)
        pending = stats[have:] if have else stats
        if extra is not None:
            pending = pending + [extra]
        if not pending:
            return None
        # CPU statistics read by the compiled kernel are Python floats already (stats.measure_host)
        tensors = [s for s in pending if s.__class__ is not float]
        if not tensors:
            values = pending
        else:
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
            self.host += values[:-1]
            return values[-1]
        self.host += values
        return None

    def materialize(self, lo: int = 0, hi: Optional[int] = None) -> Tuple[Frame, ...]:
        host, dtypes = self.host, self.dtypes
        out = []
        frames = self.frames
        hi = len(frames) if hi is None else hi
        for idx in range(lo, hi):
            info, items, k = frames[idx]
            stats = []
            for it in items:
                if it.__class__ is str:
                    mn, mx, dt = host[2 * k], host[2 * k + 1], dtypes[k]
                    k += 1
                    top = DTYPE_MAX.get(dt)
                    used = mx / top if top and mx == mx else None
                    stats.append(TensorStat(it, mn, mx, dtype_name(dt), "", used))
                else:
                    stats.append(TensorStat(it[0], None, None, "", it[1]))
            out.append(Frame(info.path, info.cls, tuple(stats), self.batch_number,
                             batch_start=(idx == 0 and self.header), phase=self.phase))
        return tuple(out)

    def first_nonfinite_frame(self, first_frame: int) -> Optional[int]:
        """Index of the first frame at or after `first_frame` holding inf/nan (host stats)."""
        if first_frame < 0 or first_frame >= len(self.frames):
            return None
        start = self.frames[first_frame][2] * 2
        host = self.host
        if math.isfinite(sum(host[start:])):
            return None
        bad = next((i for i in range(start, len(host)) if not math.isfinite(host[i])), None)
        if bad is None:
            return None  # the sum overflowed; every value is finite
        starts = [f[2] for f in self.frames]
        return bisect.bisect_right(starts, bad // 2) - 1


class History:
    """Finished forward records, newest last, kept while the newer ones hold fewer than
    `max_frames` frames: exactly what a ring of `max_frames` frames can reach back into."""

    def __init__(self, max_frames: int):
        self.max_frames = max_frames
        self.records: List[Record] = []

    def keep(self, rec: Record) -> None:
        hist = self.records
        hist.append(rec)
        total = sum(len(r.frames) for r in hist)
        while len(hist) > 1 and total - len(hist[0].frames) >= self.max_frames:
            total -= len(hist.pop(0).frames)

    def ring(self, rec: Record, fi: int, stop: Callable[[Record], bool]) -> Tuple[Frame, ...]:
        """The last max_frames frames ending with frame `fi` of `rec`, oldest first; forward
        rings reach back across batches until `stop(record)` says the buffer started there."""
        n = self.max_frames
        frames = rec.materialize(max(0, fi + 1 - n), fi + 1)
        missing = n - len(frames)
        if rec.phase == "forward":
            for prev in reversed(self.records):
                if missing <= 0 or stop(prev):
                    break
                if prev is not rec:
                    older = prev.materialize(max(0, len(prev.frames) - missing))
                    frames = older + frames
                    missing -= len(older)
        return frames
