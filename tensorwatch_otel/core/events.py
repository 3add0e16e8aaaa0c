"""Plain event objects the watcher produces and every sink consumes (the statistics they carry,
frames and tensor statistics, are core/frame_stats.py's).

Nothing here imports an exporter: sinks translate these into text, JSON, metrics or spans.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple, Union

from .frame_stats import Frame, TensorStat

ROOT_LABEL = "(root)"  # the root module's path is "" in the report and "(root)" in labels


def label_for_module(path: str) -> str:
    """Module path as used in metric labels and span attributes."""
    return path if path else ROOT_LABEL



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
