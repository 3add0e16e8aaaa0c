"""The statistics the watcher measured, as plain values: a tensor's (TensorStat: abs min/max, its
Magnitude histogram, a note for a value without statistics, its inf/nan kind), a module call's
Frame of them, and a batch's BatchStats handed to the sinks (its StatRow rows, its RecordColumns view).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple, cast

# Notes for values that have no statistics. The report prints them right-aligned in 17 columns.
NOTE_NONE = "None"
NOTE_NOT_TENSOR = "not a tensor"
NOTE_EMPTY = "empty"
NOTE_NO_DATA = "no data"  # meta/fake tensors, wrapper subclasses without storage
# a tensor written in place after its module returned, before its deferred measurement read it
# (core/measure/slot_buffer.py): its value at the return is lost
NOTE_CHANGED = "changed in place"


def nonfinite_kind(*values: Optional[float]) -> str:
    """'' when all values are finite (or missing), else 'inf', 'nan' or 'inf,nan'."""
    has_inf = has_nan = False
    for v in values:
        if v is None:
            continue
        if v != v:
            has_nan = True
        elif v in (math.inf, -math.inf):
            has_inf = True
    if has_inf and has_nan:
        return "inf,nan"
    return "inf" if has_inf else ("nan" if has_nan else "")


def merge_kinds(*kinds: str) -> str:
    """Union of kinds: merge_kinds('inf', 'nan') == 'inf,nan'."""
    parts = {p for k in kinds for p in k.split(",") if p}
    return ",".join(k for k in ("inf", "nan") if k in parts)


@dataclass(frozen=True)
class Magnitude:
    """Power-of-two histogram of a tensor's |x| (target_dtypes): `counts[i]` finite non-zero
    elements with |x| in (2**(offset+i), 2**(offset+i+1)] (upper-inclusive: the OpenTelemetry
    exponential histogram's scale-0 bucket offset+i), `zeros` exact zeros; inf/nan left out.
    `counts` spans the first to the last non-empty bucket (empty, offset 0, when there is none)."""

    zeros: int
    offset: int
    counts: Tuple[int, ...]


@dataclass(frozen=True)
class TensorStat:
    """abs min / abs max of one tensor of a frame (None when it has no values)."""

    name: str  # "weight", "input[0]", "input.attention_mask", "output.logits", "output[0][1]"
    abs_min: Optional[float]
    abs_max: Optional[float]
    dtype: str = ""  # "float16", "int64"... ("" for non-tensors)
    note: str = ""  # one of the NOTE_* values when there are no statistics
    range_used: Optional[float] = None  # abs_max / largest finite value of dtype (floats only)
    #: target_dtypes: dtype name -> share in [0, 1] of the non-zero finite elements a cast to it
    #: flushes to zero / puts beyond its largest finite value (core/measure/magnitude.py: the rule); None
    #: without target dtypes or for a tensor without float values (integer, bool)
    underflow: Optional[Dict[str, float]] = None
    overflow: Optional[Dict[str, float]] = None
    magnitude: Optional[Magnitude] = None  # the histogram behind the shares (target_dtypes)

    @property
    def kind(self) -> str:
        """'' if finite, else 'inf', 'nan' (a tensor holding NaN reports 'nan')."""
        return nonfinite_kind(self.abs_min, self.abs_max)


@dataclass(frozen=True)
class Frame:
    """One module call: its own parameters, its inputs and outputs, in report order."""

    module: str  # qualified path, "" for the root module
    module_class: str
    tensors: Tuple[TensorStat, ...]
    batch_number: int
    batch_start: bool = False  # first frame of its batch (the report prints a batch header)
    phase: str = "forward"  # "forward", or "backward" for gradient frames

    @property
    def kind(self) -> str:
        return merge_kinds(*(t.kind for t in self.tensors))

    def first_nonfinite(self) -> Optional[TensorStat]:
        for t in self.tensors:
            if t.kind:
                return t
        return None


@dataclass(frozen=True)
class StatRow:
    """One (module call, tensor) statistic of a batch, as metric sinks consume it."""

    module: str
    module_class: str
    tensor: str
    dtype: str
    abs_min: float
    abs_max: float
    range_used: Optional[float]


class BatchStats:
    """All statistics of one watched batch, handed to sinks once per batch.

    Built cheaply on the training thread (references only); rows are materialised lazily by
    the sink, typically on its own thread (a scrape, a metric collection). Immutable once built.
    """

    __slots__ = ("batch_number", "rank", "time", "_frames", "grad_scale", "steps_skipped", "phase",
                 "every_n_batches", "overhead")

    def __init__(self, batch_number: int, rank: int, time: float, frames: Tuple[Frame, ...] | "_LazyFrames",
                 grad_scale: Optional[float] = None, steps_skipped: int = 0, phase: str = "forward",
                 every_n_batches: Optional[int] = None, overhead: Optional[float] = None):
        self.batch_number = batch_number
        self.rank = rank
        self.time = time
        self._frames = frames
        #: the GradScaler's scale at the end of this batch, when a scaler is known
        self.grad_scale = grad_scale
        #: optimizer steps skipped so far in this run (see SkippedStepEvent)
        self.steps_skipped = steps_skipped
        #: "forward" (a batch), or "backward" / "optimizer": the gradients or optimizer state of
        #: that batch, exported as series of their own (`output.grad`, `weight.exp_avg_sq`) but
        #: not counted as batches
        self.phase = phase
        #: the watcher measures one batch in this many (every_n_batches, or max_overhead's choice)
        self.every_n_batches = every_n_batches
        #: max_overhead: the watcher's measured share of the step (None without a budget)
        self.overhead = overhead

    @property
    def frames(self) -> Tuple[Frame, ...]:
        f = self._frames
        if not isinstance(f, tuple):
            f = f.materialize()
            self._frames = f
        return f

    def columns(self) -> Optional["RecordColumns"]:
        """The batch's statistics as columns, one entry per measured tensor, when they come
        straight from the watcher's record and no frames were built from it (what the metric
        sinks aggregate, with no Python object per value); None otherwise (read `frames`)."""
        f = self._frames
        if isinstance(f, tuple) or not hasattr(f, "layout_key"):
            return None
        return cast("RecordColumns", f)  # a Record (the only _LazyFrames with a layout)

    def rows(self) -> Iterator[StatRow]:
        """Every measured tensor of every frame (a module called twice yields its rows twice)."""
        for fr in self.frames:
            for t in fr.tensors:
                if t.abs_max is None or t.abs_min is None:
                    continue
                yield StatRow(fr.module, fr.module_class, t.name, t.dtype, t.abs_min, t.abs_max, t.range_used)


class _LazyFrames(Protocol):
    """A deferred frame list (the watcher's batch record, core/record.py's Record)."""

    def materialize(self) -> Tuple[Frame, ...]: ...


class RecordColumns(Protocol):
    """The columnar view of the watcher's batch record (core/record.py's Record), read by the
    metric sinks through BatchStats.columns(): `measured()` gives (module info, tensor name,
    index, dtype) per measured tensor in order; `host_extremes()` their abs mins and abs maxs
    (two float64 tensors); with target_dtypes, `underflow`/`overflow` hold the shares
    (`k * len(targets) + j`) and `magnitude(k)` the histogram on the batches that took one
    (`histogram`); `layout_key()` is equal (==) for two records of the same layout."""

    batch_number: int
    targets: Tuple[str, ...]

    @property
    def histogram(self) -> Optional[bool]: ...

    @property
    def underflow(self) -> List[float]: ...

    @property
    def overflow(self) -> List[float]: ...

    def layout_key(self) -> Any: ...

    def measured(self) -> Iterator[Tuple[Any, str, int, Any]]: ...

    def host_extremes(self) -> Tuple[Any, Any]: ...

    def magnitude(self, k: int) -> Optional[Magnitude]: ...
