"""Per (module, tensor) extremes for the metric sinks over a time window of batches: module
filters, a module called several times, the series cap, and no aliasing between scrapes.

A gauge that showed only the last batch would miss a one-batch spike between two scrapes
(15 s apart, hundreds of batches). `Window` folds every watched batch into the current of two
rotating buckets (_window_buckets.Buckets: min of abs_min, max of abs_max, of range_used and of the underflow/overflow
shares of each target dtype); an exporter reads both buckets, so each value covers between half
the window and the whole of it. Reading never resets anything: every scraper sees the same
values. The fold runs on the training thread with three vector operations per batch, plus two
for all target dtypes (the batch's values are read as one array). The magnitude histograms are
summed on the exporter's thread over one batch per collection (see _magnitude.MagnitudeTotals).
"""

from __future__ import annotations

import array
import fnmatch
import logging
import math
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..core import env as _env
from ..core.events import label_for_module
from ..core.frame_stats import BatchStats, RecordColumns
from ..core.measure.stats import DTYPE_MAX, dtype_name
from ._magnitude import MagnitudeTotals
from ._options import number_option
from ._window_buckets import UNSEEN, Buckets

log = logging.getLogger(__name__)

Patterns = Optional[Union[str, Sequence[str]]]
Key = Tuple[str, str]  # (module label, tensor)

#: Seconds of batches the tensor gauges cover by default (set it to at least twice the
#: scrape or export interval; 0 means the last watched batch only).
DEFAULT_WINDOW_S = 60.0
ENV_WINDOW = _env.ENV_METRICS_WINDOW_SECONDS

_LAYOUTS = 8  # distinct batch layouts remembered (train/eval forwards, generate() steps...)
_TRASH = 0  # bucket column for filtered or capped tensors, never exported


def patterns(p: Patterns) -> Tuple[str, ...]:
    if p is None:
        return ()
    return (p,) if isinstance(p, str) else tuple(p)


def window_seconds(value: Optional[float], arg: str = "window_s") -> float:
    """Argument, then TENSORWATCH_METRICS_WINDOW_SECONDS, then the default; >= 0 (0: last batch only)."""
    return number_option(arg, value, ENV_WINDOW, DEFAULT_WINDOW_S, minimum=0.0)


class ModuleFilter:
    """include/exclude globs matched against the module path and its label ("(root)")."""

    def __init__(self, include: Patterns = None, exclude: Patterns = None):
        self.include = patterns(include)
        self.exclude = patterns(exclude)
        self._cache: Dict[str, bool] = {}

    def __call__(self, module: str) -> bool:
        ok = self._cache.get(module)
        if ok is None:
            names = (module, label_for_module(module))
            ok = (not self.include or any(fnmatch.fnmatchcase(n, p) for n in names for p in self.include)) \
                and not any(fnmatch.fnmatchcase(n, p) for n in names for p in self.exclude)
            self._cache[module] = ok
        return ok


class _Layout:
    """Where each value of a batch goes: a bucket column per measured tensor, and 1/dtype max."""

    __slots__ = ("frames", "dtypes", "index", "inv_top", "dropped")

    def __init__(self, frames, dtypes, index: List[int], inv_top: List[float], dropped: int):
        self.frames = frames
        self.dtypes = dtypes
        self.index = torch.tensor(index, dtype=torch.int64)
        self.inv_top = torch.tensor(inv_top, dtype=torch.float64)
        self.dropped = dropped


class Snapshot:
    """What an exporter reads: rows (module label, module_class, tensor, dtype, abs_min, abs_max,
    range_used or None, shares) of the window, and the last batch's number, rank and counts.
    ``shares``: ((target dtype, underflow or None, overflow or None), ...) for the target dtypes
    the pair has a share for in the window (empty without target_dtypes)."""

    __slots__ = ("rows", "batch_number", "rank", "batches", "dropped", "version")

    def __init__(self, rows, batch_number, rank, batches, dropped, version):
        self.rows = rows
        self.batch_number = batch_number
        self.rank = rank
        self.batches = batches
        self.dropped = dropped
        self.version = version


class Window:
    """Extremes of every (module, tensor) over the batches of the last `window_s` seconds.

    ``add(stats)`` on the training thread; ``snapshot()`` on exporter threads (cached until the
    next batch). Buckets rotate only when a batch arrives, so a paused run keeps showing its
    last window instead of going blank. NaN wins every comparison: a NaN anywhere in the
    window is not hidden by comparison order.
    """

    def __init__(self, wanted: ModuleFilter, cap: int, window_s: float, name: str,
                 clock: Callable[[], float] = time.monotonic, magnitudes: bool = False):
        self.wanted = wanted
        self.cap = cap
        self._name = name  # the sink, for the series cap note
        self._clock = clock
        # columns: [(module label, tensor, module_class, dtype)], column 0 is the trash
        self._keys: List[Optional[List[str]]] = [None]
        self._index: Dict[Key, int] = {}
        # target dtype -> j: bucket rows 3 + 2j (underflow share) and 4 + 2j (overflow share)
        self._targets: Dict[str, int] = {}
        #: run-long magnitude histograms per column (None: not kept, the Prometheus sink)
        self.magnitudes: Optional[MagnitudeTotals] = MagnitudeTotals() if magnitudes else None
        self._layouts: List[_Layout] = []
        self._tuples: list = []  # (frames tuple, its values): BatchStats built from Frames
        self._buckets = Buckets(window_s)
        self._lock = threading.Lock()
        self._last: Optional[BatchStats] = None
        self._batches = 0
        self._dropped = 0
        self._version = 0
        self._snapshot: Optional[Snapshot] = None
        self._cap_logged = False

    @property
    def window_s(self) -> float:
        """Seconds of batches covered (0: the last batch only)."""
        return self._buckets.window_s

    # -- training thread ------------------------------------------------------------------
    def add(self, stats: BatchStats) -> None:
        source = stats.columns()
        if source is not None:
            layout = self._record_layout(source)  # the watcher's batch record: no frames built
            mins, maxs = source.host_extremes()
            index, inv_top = layout.index, layout.inv_top
            if len(index) != len(mins):  # a record that was not read back whole
                n = min(len(index), len(mins))
                mins, maxs, index, inv_top = mins[:n], maxs[:n], index[:n], inv_top[:n]
            ratio = maxs * inv_top
            shares = self._record_shares(source, len(layout.index), len(index))
            # (the watcher counts the histogram on a cadence of batches: `histogram` False says
            # this one has none, so the latest batch that has one stays the one sampled)
            if self.magnitudes is not None and shares[0] and callable(getattr(source, "magnitude", None)) \
                    and getattr(source, "histogram", None) is not False:
                self.magnitudes.add_record(source, layout.index, len(index), self._clock_ns())
        else:
            mins, maxs, ratio, index, layout, shares, mags = self._rows(stats)
            if self.magnitudes is not None and mags and any(m is not None for m in mags):
                self.magnitudes.add_values(mags, index, self._clock_ns())
        ratio = torch.where(ratio >= 0, ratio, UNSEEN)  # NaN (and no dtype max) take no part
        with self._lock:
            now = self._clock()
            targets, share_rows = shares
            for target in targets:
                if target not in self._targets:
                    self._targets[target] = len(self._targets)
            cur = self._buckets.current(now, len(self._keys), 3 + 2 * len(self._targets))
            if len(index):
                cur[0].scatter_reduce_(0, index, mins, "amin")
                cur[1].scatter_reduce_(0, index, maxs, "amax")
                cur[2].scatter_reduce_(0, index, ratio, "amax")
                if targets:
                    self._fold_shares(cur, index, targets, share_rows)
            if stats.phase == "forward":  # gradients and optimizer state are no batch of their own
                self._last = stats
                self._batches += 1
            elif self._last is None:
                self._last = stats
            self._dropped = layout.dropped
            self._version += 1

    def _clock_ns(self) -> int:
        return time.time_ns()

    def _fold_shares(self, cur: torch.Tensor, index: torch.Tensor, targets: Tuple[str, ...],
                     rows: torch.Tensor) -> None:
        """rows: (2T, n), underflow and overflow of each target in turn, not applicable < 0."""
        first = 3 + 2 * self._targets[targets[0]]
        if all(self._targets[t] == self._targets[targets[0]] + j for j, t in enumerate(targets)):
            # the usual case (targets registered in this order): one operation for all of them
            cur[first:first + len(rows)].scatter_reduce_(1, index.expand(len(rows), -1), rows, "amax")
            return
        for j, t in enumerate(targets):
            row = 3 + 2 * self._targets[t]
            cur[row:row + 2].scatter_reduce_(1, index.expand(2, -1), rows[2 * j:2 * j + 2], "amax")

    @staticmethod
    def _record_shares(rec, measured: int, n: int) -> Tuple[Tuple[str, ...], Optional[torch.Tensor]]:
        """(targets, (2T, n) rows) of a record's flat share lists (k * T + j): underflow and
        overflow of each target in turn, NaN (not applicable) as UNSEEN."""
        targets = tuple(getattr(rec, "targets", None) or ())
        if not targets:
            return (), None
        t = len(targets)
        under, over = rec.underflow, rec.overflow
        size = measured * t
        if len(under) == size and len(over) == size:
            # array.array(list) converts at C speed (extend() does not)
            both = torch.stack([torch.frombuffer(array.array("d", vals), dtype=torch.float64)
                                for vals in (under, over)]).view(2, measured, t)
        else:  # a record not read back whole: what is missing does not apply
            both = torch.full((2, measured, t), math.nan, dtype=torch.float64)
            for i, vals in enumerate((under, over)):
                m = min(len(vals), size)
                if m:
                    both[i].view(-1)[:m] = torch.tensor(list(vals[:m]), dtype=torch.float64)
        rows = both[:, :n].permute(2, 0, 1).reshape(2 * t, n)  # [under_0, over_0, under_1, ...]
        return targets, torch.where(rows >= 0, rows, UNSEEN)

    def _column(self, label: str, tensor: str, cls: str, dtype: str, dropped: set) -> int:
        key = (label, tensor)
        col = self._index.get(key)
        if col is None:
            if len(self._index) >= self.cap:
                dropped.add(key)
                return _TRASH
            col = self._index[key] = len(self._keys)
            self._keys.append([label, tensor, cls, dtype])
        else:
            self._keys[col][3] = dtype  # a module cast to another dtype: label the new one
        return col

    def _record_layout(self, rec: RecordColumns) -> _Layout:
        frames, dtypes = rec.layout_key()
        for i, lay in enumerate(self._layouts):
            if lay.frames == frames and lay.dtypes == dtypes:  # C-level compares, no Python loop
                if i:
                    self._layouts.insert(0, self._layouts.pop(i))
                return lay
        index: List[int] = [_TRASH] * len(dtypes)
        inv_top: List[float] = [math.nan] * len(dtypes)
        dropped: set = set()
        with self._lock:  # columns are appended here, read by snapshot()
            last = None
            for info, name, k, dt in rec.measured():
                if info is not last:
                    last, ok, label = info, self.wanted(info.path), label_for_module(info.path)
                top = DTYPE_MAX.get(dt)
                inv_top[k] = 1.0 / top if top else math.nan
                if ok:
                    index[k] = self._column(label, name, info.cls, dtype_name(dt), dropped)
        lay = _Layout([list(part) for part in frames], list(dtypes), index, inv_top, len(dropped))
        self._layouts.insert(0, lay)
        del self._layouts[_LAYOUTS:]
        self._note_cap(len(dropped), getattr(rec, "batch_number", -1))
        return lay

    def _rows(self, stats: BatchStats):
        """Any other BatchStats (frames already built): one pass over its rows, remembered for
        the same frames object."""
        frames = stats.frames
        for f, vals in self._tuples:
            if f is frames:
                return vals
        vals = self._convert(stats)
        self._tuples.insert(0, (frames, vals))
        del self._tuples[_LAYOUTS:]
        return vals

    def _convert(self, stats: BatchStats):
        index, mins, maxs, ratio = [], [], [], []
        shares: Dict[str, Tuple[list, list]] = {}
        mags: list = []
        dropped: set = set()
        with self._lock:
            for fr in stats.frames:  # as BatchStats.rows(), with the precision fields
                if not self.wanted(fr.module):
                    continue
                for t in fr.tensors:
                    if t.abs_max is None or t.abs_min is None:
                        continue
                    n = len(index)
                    index.append(self._column(label_for_module(fr.module), t.name, fr.module_class, t.dtype,
                                              dropped))
                    mins.append(t.abs_min)
                    maxs.append(t.abs_max)
                    ratio.append(UNSEEN if t.range_used is None else t.range_used)
                    for j, field in enumerate(("underflow", "overflow")):
                        for target, share in (getattr(t, field, None) or {}).items():
                            cols = shares.setdefault(target, ([], []))[j]
                            cols.extend([math.nan] * (n - len(cols)))
                            cols.append(share)
                    mags.append(getattr(t, "magnitude", None))
        self._note_cap(len(dropped), stats.batch_number)
        f64 = torch.float64
        lay = _Layout(None, None, [], [], len(dropped))
        n = len(index)
        targets = tuple(shares)
        rows = None
        if targets:
            rows = torch.tensor([col + [math.nan] * (n - len(col)) for t in targets for col in shares[t]], dtype=f64)
            rows = torch.where(rows >= 0, rows, UNSEEN)
        return (torch.tensor(mins, dtype=f64), torch.tensor(maxs, dtype=f64), torch.tensor(ratio, dtype=f64),
                torch.tensor(index, dtype=torch.int64), lay, (targets, rows), mags if any(mags) else [])

    def _note_cap(self, dropped: int, batch_number: int) -> None:
        if dropped and not self._cap_logged:
            self._cap_logged = True
            log.warning("tensorwatch_otel: %s series cap reached: %d (module, tensor) pairs of batch %d not "
                        "exported (max_series=%d). Narrow with include=/exclude= or raise max_series.",
                        self._name, dropped, batch_number, self.cap)

    # -- exporter threads -----------------------------------------------------------------
    def snapshot(self) -> Optional[Snapshot]:
        """The window now, or None before the first batch."""
        snap = self._snapshot
        if snap is not None and snap.version == self._version:
            return snap
        with self._lock:
            last = self._last
            if last is None:
                return None
            both = self._buckets.both()
            keys = [tuple(k) for k in self._keys[1:]]
            targets = sorted(self._targets.items(), key=lambda kv: kv[1])
            meta = (last.batch_number, last.rank, self._batches, self._dropped, self._version)
        values = both[:, 1:len(keys) + 1].tolist()
        lo, hi, ru = values[:3]
        per_target = [(t, values[3 + 2 * j], values[4 + 2 * j]) for t, j in targets]
        rows = []
        for c, ((label, tensor, cls, dtype), a, b, r) in enumerate(zip(keys, lo, hi, ru)):
            if b >= 0 or b != b:  # seen in the window (NaN counts)
                shares = tuple((t, u[c] if u[c] >= 0 else None, o[c] if o[c] >= 0 else None)
                               for t, u, o in per_target if u[c] >= 0 or o[c] >= 0)
                rows.append((label, cls, tensor, dtype, a, b, r if r >= 0 else None, shares))
        snap = Snapshot(rows, *meta)
        self._snapshot = snap
        return snap

    def magnitude_rows(self) -> list:
        """(module label, module_class, tensor, zeros, offset, counts, start ns) of every pair with
        magnitudes so far (run-long sums; empty when the window keeps none)."""
        if self.magnitudes is None:
            return []
        with self._lock:
            keys = list(self._keys)
        return self.magnitudes.rows(keys)
