"""The spans OtelTelemetry makes from events: detection, traced batches (split at the SDK's
event limit), overflow checks, aborts, skipped-step streaks and the steps on_detect="skip"
skipped. Runs on the sink's thread."""

from __future__ import annotations

import secrets
from typing import Any, Dict, List, Sequence

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from ..core.events import (AbortAfterBatchEvent, BatchTraceEvent, Event, Frame, NonFiniteEvent,
                           OverflowCheckEvent, SkippedNonFiniteStepEvent, SkipStreakEvent, StoppedByRankEvent,
                           label_for_module)

#: The detection's span (otel_env's export backoff always lets a batch holding one through).
DETECTION_SPAN = "tensorwatch.nonfinite_detected"
_SDK_DEFAULT_EVENT_LIMIT = 128


def _event_limit(provider: Any) -> int:
    """The span event count limit of the SDK provider (OTEL_SPAN_EVENT_COUNT_LIMIT, default 128)."""
    limits = getattr(provider, "_span_limits", None)  # SDK TracerProvider; the API has no getter
    if limits is None:
        return _SDK_DEFAULT_EVENT_LIMIT
    n = getattr(limits, "max_events", _SDK_DEFAULT_EVENT_LIMIT)
    if n is None:
        return 1 << 30
    return max(1, int(n))


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
        out[f"tensorwatch.underflow.{k}"] = [float((t.underflow or {}).get(k, nan)) for t in tensors]
        out[f"tensorwatch.overflow.{k}"] = [float((t.overflow or {}).get(k, nan)) for t in tensors]
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
        "tensorwatch.frame.index": index,
        "tensorwatch.module.path": label_for_module(fr.module),
        "tensorwatch.module.class": fr.module_class,
        "tensorwatch.batch_number": fr.batch_number,
        "tensorwatch.phase": fr.phase,
        "tensorwatch.tensors": names,
        "tensorwatch.abs_min": lo,
        "tensorwatch.abs_max": hi,
        "tensorwatch.dtypes": dtypes,
        **_precision_attributes([t for t in fr.tensors if t.abs_min is not None and t.abs_max is not None]),
    }
    if notes:
        attrs["tensorwatch.notes"] = notes
    return attrs


def _detection_context(trace_id: str, ctx):
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


def _render_detection(event: NonFiniteEvent) -> str:
    try:
        from ..report.text import render_detection
    except ImportError:  # pragma: no cover - the report module ships with the package
        return f"Detected inf/nan during batch_number={event.batch_number}"
    return render_detection(event)


class SpanBuilder:
    """Turns events into spans with `tracer`; `provider` tells the span event limit."""

    def __init__(self, tracer: Any, provider: Any):
        self._tracer = tracer
        self._provider = provider

    def emit(self, event: Event, ctx) -> None:
        if isinstance(event, NonFiniteEvent):
            self._detection_span(event, ctx)
        elif isinstance(event, BatchTraceEvent):
            self._trace_spans(event, ctx)
        elif isinstance(event, OverflowCheckEvent):
            t = int(event.time * 1e9)
            span = self._tracer.start_span("tensorwatch.overflow_check", context=ctx, start_time=t, attributes={
                "tensorwatch.ctx": event.ctx, "tensorwatch.nonfinite.kind": event.kind,
                "tensorwatch.batch_number": event.batch_number, "tensorwatch.rank": event.rank})
            if event.kind:
                span.set_status(Status(StatusCode.ERROR, f"{event.ctx} has {event.kind}"))
            span.end(end_time=t)
        elif isinstance(event, AbortAfterBatchEvent):
            t = int(event.time * 1e9)
            span = self._tracer.start_span("tensorwatch.abort_after_batch", context=ctx, start_time=t, attributes={
                "tensorwatch.batch_number": event.batch_number, "tensorwatch.rank": event.rank})
            span.end(end_time=t)
        elif isinstance(event, StoppedByRankEvent):
            t = int(event.time * 1e9)
            attrs = {"tensorwatch.batch_number": event.batch_number, "tensorwatch.rank": event.rank,
                     "tensorwatch.first_rank": event.first_rank,
                     "tensorwatch.module.path": label_for_module(event.module),
                     "tensorwatch.module.class": event.module_class, "tensorwatch.tensor": event.tensor,
                     "tensorwatch.nonfinite.kind": event.kind}
            if event.stopped_at_batch is not None:
                attrs["tensorwatch.stopped_at_batch"] = event.stopped_at_batch
            span = self._tracer.start_span("tensorwatch.stopped_by_rank", context=ctx, start_time=t,
                                           attributes=attrs)
            span.set_status(Status(StatusCode.ERROR, f"stopped: rank {event.first_rank} detected {event.kind} "
                                                     f"during batch {event.batch_number}"))
            span.end(end_time=t)
        elif isinstance(event, SkippedNonFiniteStepEvent):
            self._skipped_span(event, ctx)
        elif isinstance(event, SkipStreakEvent):
            t = int(event.time * 1e9)
            attrs = {"tensorwatch.batch_number": event.batch_number, "tensorwatch.rank": event.rank,
                     "tensorwatch.optimizer.skip_streak": event.streak}
            if event.scale is not None:
                attrs["tensorwatch.grad_scale"] = float(event.scale)
            span = self._tracer.start_span("tensorwatch.skipped_steps_streak", context=ctx, start_time=t,
                                           attributes=attrs)
            span.set_status(Status(StatusCode.ERROR, f"{event.streak} optimizer steps in a row skipped "
                                                     f"(inf/nan gradients) up to batch {event.batch_number}"))
            span.end(end_time=t)

    def _skipped_span(self, event: SkippedNonFiniteStepEvent, ctx) -> None:
        t = int(event.time * 1e9)
        attrs = {"tensorwatch.batch_number": event.batch_number, "tensorwatch.rank": event.rank,
                 "tensorwatch.module.path": label_for_module(event.module) if event.module or event.tensor else "",
                 "tensorwatch.module.class": event.module_class, "tensorwatch.tensor": event.tensor,
                 "tensorwatch.nonfinite.kind": event.kind, "tensorwatch.phase": event.phase,
                 "tensorwatch.optimizer.skip_streak": event.streak}
        span = self._tracer.start_span("tensorwatch.skipped_nonfinite_step", context=ctx, start_time=t,
                                       attributes=attrs)
        # not an error: the step was skipped on purpose and training goes on (the alert is a warning)
        span.end(end_time=t)

    def _add_frames(self, span, frames: Sequence[Frame], t0: int, first_index: int) -> None:
        # 1 ns apart: backends that sort span events by time keep the ring buffer's order.
        for i, fr in enumerate(frames):
            span.add_event("tensorwatch.frame", frame_attributes(fr, first_index + i), timestamp=t0 + i)

    def _detection_span(self, event: NonFiniteEvent, ctx) -> None:
        links = None
        if isinstance(ctx, tuple):  # (context in the event's trace, the caller's span context)
            ctx, caller = ctx
            if caller.is_valid:
                links = [Link(caller, {"tensorwatch.link": "training step"})]
        t0 = int(event.time * 1e9)
        limit = _event_limit(self._provider or trace.get_tracer_provider())
        frames = event.frames
        omitted = max(0, len(frames) - limit)
        attrs = {
            "tensorwatch.module.path": label_for_module(event.module),
            "tensorwatch.module.class": event.module_class,
            "tensorwatch.tensor": event.tensor,
            "tensorwatch.batch_number": event.batch_number,
            "tensorwatch.rank": event.rank,
            "tensorwatch.first_rank": event.rank if event.first_rank is None else event.first_rank,
            "tensorwatch.nonfinite.kind": event.kind,
            "tensorwatch.report": _render_detection(event),
            "tensorwatch.phase": event.phase,
        }
        if event.capture:
            attrs["tensorwatch.capture"] = event.capture
        if event.reproduced is not None:
            attrs["tensorwatch.reproduced"] = event.reproduced
            attrs["host.name"] = event.host or ""
        if event.verdict is not None:
            attrs["tensorwatch.verdict"] = event.verdict
        if omitted:  # the most recent frames matter most; the report attribute has them all
            attrs["tensorwatch.frames.omitted"] = omitted
        span = self._tracer.start_span(DETECTION_SPAN, context=ctx, start_time=t0,
                                       attributes=attrs, links=links)
        self._add_frames(span, frames[omitted:], t0, omitted)
        where = label_for_module(event.module)
        span.set_status(Status(StatusCode.ERROR, f"{event.kind} in {where} ({event.module_class}) "
                                                 f"{event.tensor} during batch {event.batch_number}"))
        span.end(end_time=t0 + len(frames))

    def _trace_spans(self, event: BatchTraceEvent, ctx) -> None:
        t0 = int(event.time * 1e9)
        limit = _event_limit(self._provider or trace.get_tracer_provider())
        frames = event.frames
        parts = max(1, -(-len(frames) // limit))
        first = None
        for p in range(parts):
            chunk = frames[p * limit:(p + 1) * limit]
            parent = ctx if first is None else trace.set_span_in_context(first, ctx)
            span = self._tracer.start_span("tensorwatch.batch_trace", context=parent, start_time=t0, attributes={
                "tensorwatch.batch_number": event.batch_number,
                "tensorwatch.rank": event.rank,
                "tensorwatch.trace.part": p + 1,
                "tensorwatch.trace.parts": parts,
                "tensorwatch.frame.count": len(frames),
            })
            self._add_frames(span, chunk, t0, p * limit)
            if first is None:
                first = span
            else:
                span.end(end_time=t0 + len(frames))
        first.end(end_time=t0 + len(frames))
