"""Plain event objects the watcher produces and every sink consumes.

Nothing here imports an exporter: sinks translate these into text, JSON, metrics or spans.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple, Union, cast

# Notes for values that have no statistics. The report prints them right-aligned in 17 columns.
NOTE_NONE = "None"
NOTE_NOT_TENSOR = "not a tensor"
NOTE_EMPTY = "empty"
NOTE_NO_DATA = "no data"  # meta/fake tensors, wrapper subclasses without storage
# a tensor written in place after its module returned, before its deferred measurement read it
# (core/measure/slot_buffer.py): its value at the return is lost
NOTE_CHANGED = "changed in place"

ROOT_LABEL = "(root)"  # the root module's path is "" in the report and "(root)" in labels


def label_for_module(path: str) -> str:
    """Module path as used in metric labels and span attributes."""
    return path if path else ROOT_LABEL


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


# A tracing sink may say which trace the detecting thread is in (the core imports no tracing
# library): then the detection joins the application's trace instead of starting its own.
class _TraceIds:
    """`source()` returns the 32-hex trace id of the caller's current (sampled) span, or None."""

    source: Optional[Callable[[], Optional[str]]] = None


TRACE_IDS = _TraceIds()


def set_trace_id_source(source: Optional[Callable[[], Optional[str]]]) -> None:
    """`source()` returns the 32-hex trace id of the caller's current (sampled) span, or None."""
    TRACE_IDS.source = source


def new_trace_id() -> str:
    """The current span's trace id when a source knows one, else a random 128-bit id."""
    source = TRACE_IDS.source
    if source is not None:
        try:
            tid = source()
        except Exception:  # a tracing library's trouble must not stop a detection
            tid = None
        if tid:
            return tid
    return format(secrets.randbits(128) or 1, "032x")


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
class Place:
    """Where an event's inf/nan is: the module path ("" for the root or when unknown), its class,
    the tensor's name in the frame and what it held ("inf", "nan", "inf,nan"; "" when unknown).
    Every event about an inf/nan has one (`event.place`); the sinks label it the same way."""

    module: str
    module_class: str
    tensor: str
    kind: str


class Placed:
    """An event with the fields `module`, `module_class`, `tensor` and `kind`: `place` holds them."""

    module: str
    module_class: str
    tensor: str
    kind: str

    @property
    def place(self) -> Place:
        return Place(self.module, self.module_class, self.tensor, self.kind)


@dataclass(frozen=True)
class NonFiniteEvent(Placed):
    """The first inf/nan: where it appeared and the frames that led to it (oldest first)."""

    batch_number: int
    rank: int
    module: str
    module_class: str
    tensor: str
    kind: str  # "inf", "nan" or "inf,nan"
    frames: Tuple[Frame, ...]
    time: float  # seconds since the epoch
    event: str = field(default="nonfinite_detected", init=False)
    #: the rank that detected first (this event's own rank outside multi-rank runs)
    first_rank: Optional[int] = None
    #: "forward", "backward" or "optimizer": where the frames come from
    phase: str = "forward"
    #: path of the captured inputs of the batch (capture_dir), when one was written
    capture: Optional[str] = None
    #: rerun_on_detect: True when a replay of the batch found the same inf/nan (numeric), False
    #: when it did not (transient: suspect the device on `host`), None when not re-run
    reproduced: Optional[bool] = None
    host: Optional[str] = None
    #: rerun_on_detect on a compiled model: "model" (the eager replay reproduces the inf/nan),
    #: "compiler" (only the compiled replay does) or "transient" (neither); None for an eager
    #: model or when not re-run
    verdict: Optional[str] = None
    #: W3C trace id (32 hex digits) every sink shares: the detection span's trace, the metric
    #: exemplar, the JSON lines field. Made here when not given; "" when unknown (old logs).
    trace_id: Optional[str] = None
    #: why the place may not be where the inf/nan was born, or `reproduced`/`verdict` may not say
    #: who is to blame: a replay could not run the batch as it ran (a batch every_n_batches did
    #: not record, "not replayed: ..."; random numbers the replay cannot draw as the batch did: a
    #: compiled model's dropout); None when they do
    uncertain: Optional[str] = None

    def __post_init__(self) -> None:
        if self.first_rank is None:
            object.__setattr__(self, "first_rank", self.rank)
        if self.trace_id is None:
            object.__setattr__(self, "trace_id", new_trace_id())


@dataclass(frozen=True)
class BatchTraceEvent:
    """Every frame of a batch listed in trace_batches."""

    batch_number: int
    rank: int
    frames: Tuple[Frame, ...]
    time: float
    event: str = field(default="batch_trace", init=False)


@dataclass(frozen=True)
class AbortAfterBatchEvent:
    """abort_after_batch was reached: training stops after this batch."""

    batch_number: int  # the last batch that ran
    rank: int
    time: float
    event: str = field(default="abort_after_batch", init=False)


@dataclass(frozen=True)
class SkippedStepEvent(Placed):
    """An optimizer step that did not happen while the gradients held inf/nan (a GradScaler
    skip, or any loop that reset the gradients without calling optimizer.step()). Not a
    detection: the bad values were never consumed."""

    batch_number: int  # the batch whose backward produced the gradients
    rank: int
    streak: int  # consecutive skipped steps, this one included
    scale: Optional[float]  # the GradScaler's scale after the skip, when one is known
    module: str  # where the first non-finite gradient was ("" when unknown)
    module_class: str
    tensor: str
    kind: str
    time: float
    event: str = field(default="optimizer_step_skipped", init=False)


@dataclass(frozen=True)
class SkipStreakEvent:
    """`max_skipped_steps` optimizer steps in a row were skipped: the loss scale is collapsing
    or the gradients are non-finite on every step. Raised as an alert of its own."""

    batch_number: int
    rank: int
    streak: int
    scale: Optional[float]
    time: float
    event: str = field(default="skipped_steps_streak", init=False)


@dataclass(frozen=True)
class SkippedNonFiniteStepEvent(Placed):
    """on_detect="skip": an optimizer step the watcher did not let run, because the gradients it
    would have consumed held inf/nan, or because that batch's forward went non-finite (its
    gradients are poisoned). The weights and the optimizer's state are as they were before it.
    The place is the detection's: the batch's forward detection, else the first bad gradient
    ("" on a sharded rank whose own shard was finite while another rank's was not)."""

    batch_number: int  # the batch whose gradients the step would have consumed
    rank: int
    module: str
    module_class: str
    tensor: str
    kind: str  # "inf", "nan", "inf,nan" ("" when another rank found it)
    time: float
    streak: int = 1  # steps skipped so in a row, this one included
    phase: str = "backward"  # "forward": the batch's forward went non-finite; "backward": its gradients
    event: str = field(default="skipped_nonfinite_step", init=False)


@dataclass(frozen=True)
class SamplingRateEvent:
    """max_overhead: the watcher now measures one batch in `every_n_batches`, from `batch_number`
    on, to keep its share of the step within `max_overhead`. Detection runs on every batch."""

    batch_number: int  # the first batch under the new interval
    rank: int
    every_n_batches: int
    overhead: float  # the watcher's share of the step at the interval before (measured)
    expected_overhead: float  # its share at the new interval, from the same measurements
    max_overhead: float
    time: float
    event: str = field(default="sampling_rate", init=False)


@dataclass(frozen=True)
class StoppedByRankEvent(Placed):
    """This rank stopped because another rank detected inf/nan first (multi-rank runs): the
    fields name the first rank's detection; this rank saw no non-finite value of its own."""

    batch_number: int  # the first rank's batch of the detection
    rank: int  # this rank
    first_rank: int
    module: str  # where the first rank found it
    module_class: str
    tensor: str
    kind: str
    time: float
    #: this rank's batch when it stopped (the optimizer step's or the next batch's)
    stopped_at_batch: Optional[int] = None
    event: str = field(default="stopped_by_rank", init=False)

    @property
    def frames(self) -> Tuple[Frame, ...]:
        """No frames: they are in the first rank's report."""
        return ()


@dataclass(frozen=True)
class OverflowCheckEvent:
    """A detect_overflow(var, ctx) call that found inf/nan in an intermediate tensor."""

    batch_number: int
    rank: int
    ctx: str
    kind: str
    stat: TensorStat
    time: float
    event: str = field(default="overflow_check", init=False)


Event = Union[NonFiniteEvent, BatchTraceEvent, AbortAfterBatchEvent, OverflowCheckEvent, SkippedStepEvent,
              SkipStreakEvent, SkippedNonFiniteStepEvent, StoppedByRankEvent, SamplingRateEvent]


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
    histogram: Optional[bool]
    underflow: List[float]
    overflow: List[float]

    def layout_key(self) -> Any: ...

    def measured(self) -> Iterator[Tuple[Any, str, int, Any]]: ...

    def host_extremes(self) -> Tuple[Any, Any]: ...

    def magnitude(self, k: int) -> Optional[Magnitude]: ...


def map_strings(obj: Any, fn: Callable[[str], str]) -> Any:
    """`obj` (an event, a frame, a tensor statistic, containers of them) with every string in it,
    dictionary keys included, replaced by `fn(string)`; the same object wherever nothing changed.
    Tuples (not named ones), lists, dicts and dataclasses are looked into; the rest is kept."""
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        items = [map_strings(x, fn) for x in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else tuple(items)
    if isinstance(obj, list):
        items = [map_strings(x, fn) for x in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else items
    if isinstance(obj, dict):
        pairs = [(map_strings(k, fn), map_strings(v, fn)) for k, v in obj.items()]
        return obj if all(a is k and b is v for (a, b), (k, v) in zip(pairs, obj.items())) else dict(pairs)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for f in dataclasses.fields(obj):
            if f.init:
                v = getattr(obj, f.name)
                nv = map_strings(v, fn)
                if nv is not v:
                    changed[f.name] = nv
        return dataclasses.replace(obj, **changed) if changed else obj
    return obj
