"""OtelTelemetry: detections and traced batches as OpenTelemetry spans, tensor statistics as
observable gauges, detections as a counter. Needs only the OpenTelemetry API.

Spans are built on the sink's own thread; gauges read the latest batch at collection time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Status, StatusCode

from ..core.events import (AbortAfterBatchEvent, BatchStats, BatchTraceEvent, Event, Frame, NonFiniteEvent,
                       OverflowCheckEvent, label_for_module)
from .otel_env import shutdown_bounded
from .._version import __version__
from ._aggregate import ModuleFilter, Patterns, aggregate
from ._base import Sink

__all__ = ["OtelTelemetry", "SCOPE", "DEFAULT_MAX_SERIES"]

log = logging.getLogger(__name__)

SCOPE = "tensorwatch_otel"
#: One under the metrics SDK's default cardinality limit (2000), so no statistic ends up in
#: the SDK's anonymous overflow series; raise it together with a View's cardinality limit.
DEFAULT_MAX_SERIES = 1999
_SDK_DEFAULT_EVENT_LIMIT = 128
_QUEUE_SIZE = 1024
_STOP = object()


def _event_limit(provider: Any) -> int:
    """The span event count limit of the SDK provider (OTEL_SPAN_EVENT_COUNT_LIMIT, default 128)."""
    limits = getattr(provider, "_span_limits", None)  # SDK TracerProvider; the API has no getter
    if limits is None:
        return _SDK_DEFAULT_EVENT_LIMIT
    n = getattr(limits, "max_events", _SDK_DEFAULT_EVENT_LIMIT)
    if n is None:
        return 1 << 30
    return max(1, int(n))


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
    }
    if notes:
        attrs["tensorwatch.notes"] = notes
    return attrs


def _render_detection(event: NonFiniteEvent) -> str:
    try:
        from ..report.text import render_detection
    except ImportError:  # pragma: no cover - the report module ships with the package
        return f"Detected inf/nan during batch_number={event.batch_number}"
    return render_detection(event)


class OtelTelemetry(Sink):
    """Exports to OpenTelemetry through the given providers, or the global ones when None.

    - Span ``tensorwatch.nonfinite_detected`` (status ERROR) per detection, the ring buffer as
      ordered ``tensorwatch.frame`` events; ``tensorwatch.batch_trace`` spans for traced batches,
      split into parts when a batch has more frames than the SDK's span event limit.
    - Gauges ``tensorwatch.tensor.abs_max``/``abs_min``/``range_used`` read the latest batch
      when the SDK collects; non-finite values are skipped (the SDK drops them anyway) and
      travel as the ``tensorwatch.nonfinite.events`` counter and the span instead.
    - ``max_series``: most (module, tensor) pairs per gauge (default 1999); ``include``/``exclude``:
      module path globs. ``shutdown_on_close``: shut the providers down in ``close()`` (for
      providers made for this sink, as ``sinks=None`` does).
    """

    wants_batches = True

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None, *,
                 include: Patterns = None, exclude: Patterns = None,
                 max_series: int = DEFAULT_MAX_SERIES, shutdown_on_close: bool = False):
        if not isinstance(max_series, int) or max_series < 1:
            raise ValueError(f"max_series={max_series!r}: expected an integer >= 1")
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._tracer = trace.get_tracer(SCOPE, __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
        self.max_series = max_series
        self._wanted = ModuleFilter(include, exclude)
        self._shutdown_on_close = shutdown_on_close

        self._state: Tuple[Optional[BatchStats], int] = (None, 0)
        self._cache: Optional[Tuple[BatchStats, list]] = None
        self._cache_lock = threading.Lock()
        self._cap_logged = False

        self._nonfinite = meter.create_counter(
            "tensorwatch.nonfinite.events", unit="{event}",
            description="inf/nan detections, attributed to the first module and tensor where one appeared")
        meter.create_observable_gauge("tensorwatch.tensor.abs_max", [self._observe_abs_max], unit="",
                                      description="Largest absolute value of the tensor in the last watched batch")
        meter.create_observable_gauge("tensorwatch.tensor.abs_min", [self._observe_abs_min], unit="",
                                      description="Smallest absolute value of the tensor in the last watched batch")
        meter.create_observable_gauge("tensorwatch.tensor.range_used", [self._observe_range_used], unit="1",
                                      description="abs max divided by the largest finite value of the tensor's dtype")
        meter.create_observable_counter("tensorwatch.batches", [self._observe_batches], unit="{batch}",
                                        description="Watched batches")
        meter.create_observable_gauge("tensorwatch.batch_number", [self._observe_batch_number], unit="",
                                      description="Number of the last watched batch (0-based)")

        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=_QUEUE_SIZE)
        self._worker: Optional[threading.Thread] = None
        self._worker_lock = threading.Lock()
        self._dropped = 0
        self._closed = False
        self._flush_late_logged = False

    # -- sink port (training thread: cheap) -----------------------------------------------
    def on_batch(self, stats: BatchStats) -> None:
        self._state = (stats, self._state[1] + 1)

    def on_event(self, event: Event) -> None:
        if self._closed:
            return
        if isinstance(event, NonFiniteEvent):
            self._nonfinite.add(1, {
                "tensorwatch.module.path": label_for_module(event.module),
                "tensorwatch.module.class": event.module_class,
                "tensorwatch.tensor": event.tensor,
                "tensorwatch.rank": event.rank,
            })
        # The caller's context makes the span a child of the training step's span, if any.
        self._enqueue((event, otel_context.get_current()))

    def flush(self, timeout_s: float = 5.0) -> None:
        """Spans of events seen so far are handed to the span processor, then both providers
        are flushed; the whole call returns within about timeout_s, whatever the collector does."""
        deadline = time.monotonic() + timeout_s
        if self._worker is not None and self._worker.is_alive():
            marker = threading.Event()
            try:
                self._queue.put((marker, None), timeout=max(0.0, deadline - time.monotonic()))
                marker.wait(max(0.0, deadline - time.monotonic()))
            except queue.Full:
                pass
        calls = []
        for provider in (self._tracer_provider or trace.get_tracer_provider(),
                         self._meter_provider or metrics.get_meter_provider()):
            fn = getattr(provider, "force_flush", None)
            if callable(fn):
                calls.append(fn)
        if not calls:
            return
        # Side by side, so a stalled trace export does not starve the metrics flush; the SDK's
        # force_flush ignores its timeout, hence the daemon threads and the bounded join.
        threads = [threading.Thread(target=self._flush_one, args=(fn,), name="tensorwatch-otel-flush",
                                    daemon=True) for fn in calls]
        for th in threads:
            th.start()
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        if any(th.is_alive() for th in threads) and not self._flush_late_logged:
            self._flush_late_logged = True
            log.warning("tensorwatch_otel: OpenTelemetry flush did not finish within %.1f s (collector "
                        "slow or unreachable?); training goes on, the export continues in the background",
                        timeout_s)

    @staticmethod
    def _flush_one(fn) -> None:
        try:
            fn()
        except Exception as exc:
            log.warning("tensorwatch_otel: OpenTelemetry flush failed: %s: %s", type(exc).__name__, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            try:
                self._queue.put((_STOP, None), timeout=1.0)
            except queue.Full:
                pass
            # spans still queued reach the processor before the providers shut down
            self._worker.join(2.0)
        if self._shutdown_on_close:
            providers = [p for p in (self._tracer_provider, self._meter_provider)
                         if callable(getattr(p, "shutdown", None))]
            shutdown_bounded(providers, 5.0)

    # -- span worker ---------------------------------------------------------------------
    def _enqueue(self, item) -> None:
        if self._worker is None:
            with self._worker_lock:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._run, name="tensorwatch-otel-spans",
                                                    daemon=True)
                    self._worker.start()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("tensorwatch_otel: OpenTelemetry span queue full (%d events); dropping "
                            "events until it drains", _QUEUE_SIZE)

    def _run(self) -> None:
        while True:
            item, ctx = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._emit(item, ctx)
            except Exception as exc:  # never let one bad event stop the worker
                log.warning("tensorwatch_otel: building the span for %s failed: %s: %s",
                            getattr(item, "event", type(item).__name__), type(exc).__name__, exc)

    def _emit(self, event: Event, ctx) -> None:
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

    def _add_frames(self, span, frames: Sequence[Frame], t0: int, first_index: int) -> None:
        # 1 ns apart: backends that sort span events by time keep the ring buffer's order.
        for i, fr in enumerate(frames):
            span.add_event("tensorwatch.frame", frame_attributes(fr, first_index + i), timestamp=t0 + i)

    def _detection_span(self, event: NonFiniteEvent, ctx) -> None:
        t0 = int(event.time * 1e9)
        limit = _event_limit(self._tracer_provider or trace.get_tracer_provider())
        frames = event.frames
        omitted = max(0, len(frames) - limit)
        attrs = {
            "tensorwatch.module.path": label_for_module(event.module),
            "tensorwatch.module.class": event.module_class,
            "tensorwatch.tensor": event.tensor,
            "tensorwatch.batch_number": event.batch_number,
            "tensorwatch.rank": event.rank,
            "tensorwatch.nonfinite.kind": event.kind,
            "tensorwatch.report": _render_detection(event),
        }
        if omitted:  # the most recent frames matter most; the report attribute has them all
            attrs["tensorwatch.frames.omitted"] = omitted
        span = self._tracer.start_span("tensorwatch.nonfinite_detected", context=ctx, start_time=t0,
                                       attributes=attrs)
        self._add_frames(span, frames[omitted:], t0, omitted)
        where = label_for_module(event.module)
        span.set_status(Status(StatusCode.ERROR, f"{event.kind} in {where} ({event.module_class}) "
                                                 f"{event.tensor} during batch {event.batch_number}"))
        span.end(end_time=t0 + len(frames))

    def _trace_spans(self, event: BatchTraceEvent, ctx) -> None:
        t0 = int(event.time * 1e9)
        limit = _event_limit(self._tracer_provider or trace.get_tracer_provider())
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

    # -- metric callbacks (the SDK's collection thread) --------------------------------------
    def _entries(self) -> list:
        stats, _ = self._state
        if stats is None:
            return []
        with self._cache_lock:
            cached = self._cache
            if cached is not None and cached[0] is stats:
                return cached[1]
            entries, dropped = aggregate(stats, self._wanted, self.max_series)
            if dropped and not self._cap_logged:
                self._cap_logged = True
                log.warning("tensorwatch_otel: OpenTelemetry series cap reached: %d (module, tensor) pairs "
                            "of batch %d not exported (max_series=%d). Narrow with include=/exclude= or "
                            "raise max_series (and the SDK's cardinality limit).",
                            dropped, stats.batch_number, self.max_series)
            rank = stats.rank
            out = []
            for (module, tensor), (cls, dtype, lo, hi, ru) in entries.items():
                attrs = {"tensorwatch.module.path": module, "tensorwatch.module.class": cls,
                         "tensorwatch.tensor": tensor, "tensorwatch.rank": rank}
                out.append((attrs, dtype, lo, hi, ru))
            self._cache = (stats, out)
            return out

    @staticmethod
    def _finite(v: Optional[float]) -> bool:
        return v is not None and v - v == 0  # False for inf and nan

    def _observe_abs_max(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(hi, attrs) for attrs, _, _, hi, _ in self._entries() if self._finite(hi)]

    def _observe_abs_min(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(lo, attrs) for attrs, _, lo, _, _ in self._entries() if self._finite(lo)]

    def _observe_range_used(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(ru, dict(attrs, **{"tensorwatch.dtype": dtype}))
                for attrs, dtype, _, _, ru in self._entries() if self._finite(ru)]

    def _observe_batches(self, options: CallbackOptions) -> Iterable[Observation]:
        stats, n = self._state
        if stats is None:
            return []
        return [Observation(n, {"tensorwatch.rank": stats.rank})]

    def _observe_batch_number(self, options: CallbackOptions) -> Iterable[Observation]:
        stats, _ = self._state
        if stats is None:
            return []
        return [Observation(stats.batch_number, {"tensorwatch.rank": stats.rank})]
