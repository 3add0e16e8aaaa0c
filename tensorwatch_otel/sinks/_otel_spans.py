"""The spans OtelTelemetry makes from events: detection (bounded in size, so it fits a
collector's message), traced batches (split at the SDK's event limit), overflow checks, aborts,
skipped-step streaks and the steps on_detect="skip" skipped. Runs on the sink's thread (SpanWorker)."""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from ..core.events import (AbortAfterBatchEvent, BatchTraceEvent, Event, NonFiniteEvent, OverflowCheckEvent,
                           SkippedNonFiniteStepEvent, SkipStreakEvent, StoppedByRankEvent, label_for_module)
from ..core.frame_stats import Frame
from ._base import utf8_safe
from .catalogue import FRAME_EVENT, SPANS, place_attributes, span_attribute as _a

# The sink's own logger: quieting OtelTelemetry quiets its span thread too.
log = logging.getLogger(f"{__package__}.otel")

_QUEUE_SIZE = 1024
_STOP = object()

#: The detection's span (otel_env's export backoff always lets a batch holding one through).
DETECTION_SPAN = SPANS["nonfinite_detected"][0]
_BATCH, _RANK, _FIRST_RANK, _KIND, _PHASE = _a("batch_number"), _a("rank"), _a("first_rank"), _a("kind"), _a("phase")
_STREAK = _a("skip_streak")
_SDK_DEFAULT_EVENT_LIMIT = 128
#: A detection span's `tensorwatch.report` and its frame events each stay within this many bytes,
#: so the span fits a collector's message (gRPC's default limit is 4 MiB) whatever the ring holds;
#: the frames nearest the detection are kept, the JSON lines event log holds them all.
REPORT_MAX_BYTES = 1 << 20
FRAME_EVENTS_MAX_BYTES = 1 << 20


def _event_limit(provider: Any) -> int:
    """The span event count limit of the SDK provider (OTEL_SPAN_EVENT_COUNT_LIMIT, default 128)."""
    limits = getattr(provider, "_span_limits", None)  # SDK TracerProvider; the API has no getter
    if limits is None:
        return _SDK_DEFAULT_EVENT_LIMIT
    n = getattr(limits, "max_events", _SDK_DEFAULT_EVENT_LIMIT)
    if n is None:
        return 1 << 30
    return max(1, int(n))


def _attribute_length_limit(provider: Any) -> Optional[int]:
    """The SDK provider's attribute value length limit (OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT), or
    None: the SDK would cut a longer report at its end, where the detection is."""
    limits = getattr(provider, "_span_limits", None)
    n = getattr(limits, "max_attribute_length", None)
    return None if n is None else max(1, int(n))


def _encoded_size(attrs: Dict[str, Any]) -> int:
    """About what `attrs` take in an OTLP message (a KeyValue each; arrays of AnyValues)."""
    n = 0
    for k, v in attrs.items():
        n += len(k) + 8
        if isinstance(v, str):
            n += len(v) + 4
        elif isinstance(v, (list, tuple)):
            n += sum(len(x) + 4 if isinstance(x, str) else 11 for x in v)
        else:
            n += 11
    return n


def _precision_attributes(tensors) -> Dict[str, Any]:
    """target_dtypes: `tensorwatch.underflow.<dtype>` / `tensorwatch.overflow.<dtype>`, arrays
    parallel to `tensorwatch.tensors` (NaN for a tensor without a share: integer, bool)."""
    targets: Dict[str, None] = {}
    for t in tensors:
        for k in (t.underflow or ()):
            targets[k] = None
    out: Dict[str, Any] = {}
    nan = float("nan")
    for k in targets:
        out[f"{_a('underflow')}.{k}"] = [float((t.underflow or {}).get(k, nan)) for t in tensors]
        out[f"{_a('overflow')}.{k}"] = [float((t.overflow or {}).get(k, nan)) for t in tensors]
    return out


def frame_attributes(fr: Frame, index: int) -> Dict[str, Any]:
    """Attributes of one ``tensorwatch.frame`` span event: parallel arrays of the tensors that
    have statistics; tensors without (None, not a tensor, empty) are listed in notes."""
    names: List[str] = []
    lo: List[float] = []
    hi: List[float] = []
    dtypes: List[str] = []
    notes: List[str] = []
    for t in fr.tensors:
        if t.abs_min is None or t.abs_max is None:
            notes.append(f"{t.name}: {t.note or 'no data'}")
            continue
        names.append(t.name)
        lo.append(float(t.abs_min))
        hi.append(float(t.abs_max))
        dtypes.append(t.dtype)
    attrs: Dict[str, Any] = {
        _a("frame_index"): index,
        _a("module"): label_for_module(fr.module),
        _a("module_class"): fr.module_class,
        _BATCH: fr.batch_number,
        _PHASE: fr.phase,
        _a("tensors"): names,
        _a("abs_min"): lo,
        _a("abs_max"): hi,
        _a("dtypes"): dtypes,
        **_precision_attributes([t for t in fr.tensors if t.abs_min is not None and t.abs_max is not None]),
    }
    if notes:
        attrs[_a("notes")] = notes
    return attrs


def detection_context(trace_id: str, ctx):
    """A context whose (remote) parent is in the event's trace, so the span and the metric
    exemplars share the trace id every sink got from the core; None when it is not valid hex."""
    try:
        tid = int(trace_id, 16)
    except (TypeError, ValueError):
        return None
    if not 0 < tid < 1 << 128:
        return None
    parent = SpanContext(tid, secrets.randbits(64) or 1, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(parent), ctx)


def _render_detection(event: NonFiniteEvent, max_bytes: int) -> Tuple[str, int]:
    """The report, within `max_bytes`, and the frames left out of it."""
    try:
        from ..report.text import render_detection_within
    except ImportError:  # pragma: no cover - the report module ships with the package
        return f"Detected inf/nan during batch_number={event.batch_number}", 0
    return render_detection_within(event, max_bytes)


class SpanBuilder:
    """Turns events into spans with `tracer`; `provider` tells the span event limit."""

    def __init__(self, tracer: Any, provider: Any):
        self._tracer = tracer
        self._provider = provider

    def emit(self, event: Event, ctx) -> None:
        """The span(s) of `event`: `_span_<event type>`, none for a type without one."""
        build = getattr(self, "_span_" + event.event, None)
        if build is not None:
            build(event, ctx)

    def _instant(self, event: Event, ctx, attrs: Dict[str, Any], error: str = "") -> None:
        """A span of no duration at the event's time, named as SPANS says (status ERROR: `error`)."""
        t = int(event.time * 1e9)
        span = self._tracer.start_span(SPANS[event.event][0], context=ctx, start_time=t, attributes=attrs)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=t)

    def _span_overflow_check(self, event: OverflowCheckEvent, ctx) -> None:
        self._instant(event, ctx, {_a("ctx"): event.ctx, _KIND: event.kind, _BATCH: event.batch_number,
                                   _RANK: event.rank},
                      f"{event.ctx} has {event.kind}" if event.kind else "")

    def _span_abort_after_batch(self, event: AbortAfterBatchEvent, ctx) -> None:
        self._instant(event, ctx, {_BATCH: event.batch_number, _RANK: event.rank})

    def _span_stopped_by_rank(self, event: StoppedByRankEvent, ctx) -> None:
        attrs = {_BATCH: event.batch_number, _RANK: event.rank, _FIRST_RANK: event.first_rank,
                 **place_attributes(event.place), _KIND: event.kind}
        if event.stopped_at_batch is not None:
            attrs[_a("stopped_at_batch")] = event.stopped_at_batch
        self._instant(event, ctx, attrs, f"stopped: rank {event.first_rank} detected {event.kind} "
                                         f"during batch {event.batch_number}")

    def _span_skipped_steps_streak(self, event: SkipStreakEvent, ctx) -> None:
        attrs: Dict[str, Any] = {_BATCH: event.batch_number, _RANK: event.rank, _STREAK: event.streak}
        if event.scale is not None:
            attrs[_a("grad_scale")] = float(event.scale)
        self._instant(event, ctx, attrs, f"{event.streak} optimizer steps in a row skipped "
                                         f"(inf/nan gradients) up to batch {event.batch_number}")

    def _span_skipped_nonfinite_step(self, event: SkippedNonFiniteStepEvent, ctx) -> None:
        place = place_attributes(event.place)
        if not (event.module or event.tensor):  # another rank's finding: no place of this rank's
            place[_a("module")] = ""
        # not an error: the step was skipped on purpose and training goes on (the alert is a warning)
        self._instant(event, ctx, {_BATCH: event.batch_number, _RANK: event.rank, **place, _KIND: event.kind,
                                   _PHASE: event.phase, _STREAK: event.streak})

    def _add_frames(self, span, frames: Sequence[Frame], t0: int, first_index: int) -> None:
        self._add_events(span, [frame_attributes(fr, first_index + i) for i, fr in enumerate(frames)], t0)

    @staticmethod
    def _add_events(span, events: Sequence[Dict[str, Any]], t0: int) -> None:
        # 1 ns apart: backends that sort span events by time keep the ring buffer's order.
        for i, attrs in enumerate(events):
            span.add_event(FRAME_EVENT, attrs, timestamp=t0 + i)

    @staticmethod
    def _last_frames(frames: Sequence[Frame], limit: int) -> List[Dict[str, Any]]:
        """The frame events of the last of `frames` that fit the event limit and
        FRAME_EVENTS_MAX_BYTES (the detection's own always), in order."""
        out: List[Dict[str, Any]] = []
        used = 0
        for i in range(len(frames) - 1, -1, -1):
            if len(out) >= limit:
                break
            attrs = frame_attributes(frames[i], i)
            used += _encoded_size(attrs)
            if used > FRAME_EVENTS_MAX_BYTES and out:
                break
            out.append(attrs)
        out.reverse()
        return out

    def _span_nonfinite_detected(self, event: NonFiniteEvent, ctx) -> None:
        links = None
        if isinstance(ctx, tuple):  # (context in the event's trace, the caller's span context)
            ctx, caller = ctx
            if caller.is_valid:
                links = [Link(caller, {_a("link"): "training step"})]
        t0 = int(event.time * 1e9)
        provider = self._provider or trace.get_tracer_provider()
        frames = event.frames
        events = self._last_frames(frames, _event_limit(provider))
        omitted = len(frames) - len(events)
        length = _attribute_length_limit(provider)  # (characters: a report within N bytes has at most N)
        report, cut = _render_detection(event, REPORT_MAX_BYTES if length is None else min(REPORT_MAX_BYTES, length))
        attrs: Dict[str, Any] = {
            **place_attributes(event.place),
            _BATCH: event.batch_number,
            _RANK: event.rank,
            _FIRST_RANK: event.rank if event.first_rank is None else event.first_rank,
            _KIND: event.kind,
            _a("report"): report,
            _PHASE: event.phase,
        }
        if cut:  # the frames nearest the detection are kept; the JSON lines log has them all
            attrs[_a("report_frames_omitted")] = cut
        if event.capture:
            attrs[_a("capture")] = event.capture
        if event.reproduced is not None:
            attrs[_a("reproduced")] = event.reproduced
            attrs[_a("host")] = event.host or ""
        if event.verdict is not None:
            attrs[_a("verdict")] = event.verdict
        if event.uncertain is not None:
            attrs[_a("uncertain")] = event.uncertain
        if omitted:  # the most recent frames matter most; the report attribute has more
            attrs[_a("frames_omitted")] = omitted
        span = self._tracer.start_span(DETECTION_SPAN, context=ctx, start_time=t0,
                                       attributes=attrs, links=links)
        self._add_events(span, events, t0)
        where = label_for_module(event.module)
        span.set_status(Status(StatusCode.ERROR, f"{event.kind} in {where} ({event.module_class}) "
                                                 f"{event.tensor} during batch {event.batch_number}"))
        span.end(end_time=t0 + len(frames))

    def _span_batch_trace(self, event: BatchTraceEvent, ctx) -> None:
        t0 = int(event.time * 1e9)
        limit = _event_limit(self._provider or trace.get_tracer_provider())
        frames = event.frames
        parts = max(1, -(-len(frames) // limit))
        first = None
        for p in range(parts):
            chunk = frames[p * limit:(p + 1) * limit]
            parent = ctx if first is None else trace.set_span_in_context(first, ctx)
            span = self._tracer.start_span(SPANS["batch_trace"][0], context=parent, start_time=t0, attributes={
                _BATCH: event.batch_number,
                _RANK: event.rank,
                _a("trace_part"): p + 1,
                _a("trace_parts"): parts,
                _a("frame_count"): len(frames),
            })
            self._add_frames(span, chunk, t0, p * limit)
            if first is None:
                first = span
            else:
                span.end(end_time=t0 + len(frames))
        first.end(end_time=t0 + len(frames))


class SpanWorker:
    """The sink's span thread: the training thread queues events (``put``), this thread builds
    their spans in order. A full queue drops events (said once); ``drain`` waits until the spans
    queued before it are built, and ``draining`` says whether the last such wait outlived its
    deadline (the span processor is stuck on a hanging collector)."""

    def __init__(self, spans: SpanBuilder):
        self._spans = spans
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=_QUEUE_SIZE)
        self._thread: Optional[threading.Thread] = None
        self._thread_lock = threading.Lock()
        self._dropped = 0
        self._marker: Optional[threading.Event] = None  # the last drain's marker in the queue

    def put(self, item) -> None:
        """Queues (event, context), starting the thread on first use; never blocks."""
        if self._thread is None:
            with self._thread_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="tensorwatch-otel-spans",
                                                    daemon=True)
                    self._thread.start()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("tensorwatch_otel: OpenTelemetry span queue full (%d events); dropping "
                            "events until it drains", _QUEUE_SIZE)

    def drain(self, deadline: float) -> None:
        """Waits, until the monotonic `deadline` at most, for the spans queued so far to be built."""
        if self._thread is not None and self._thread.is_alive():
            marker = threading.Event()
            try:
                self._queue.put((marker, None), timeout=max(0.0, deadline - time.monotonic()))
                self._marker = marker
                marker.wait(max(0.0, deadline - time.monotonic()))
            except queue.Full:
                pass

    def draining(self) -> bool:
        """True while the last drain's marker waits in the queue."""
        return self._marker is not None and not self._marker.is_set()

    def stop(self, timeout_s: float) -> None:
        """Spans still queued are built, then the thread ends; waits at most timeout_s."""
        if self._thread is not None:
            try:
                self._queue.put_nowait((_STOP, None))
            except queue.Full:
                pass
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item, ctx = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._spans.emit(utf8_safe(item), ctx)  # protobuf takes only encodable strings
            except Exception as exc:  # never let one bad event stop the worker
                log.warning("tensorwatch_otel: building the span for %s failed: %s: %s",
                            getattr(item, "event", type(item).__name__), type(exc).__name__, exc)
