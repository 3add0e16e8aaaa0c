"""OtelTelemetry: detections and traced batches as OpenTelemetry spans, tensor statistics as
observable gauges, detections as a counter. Needs only the OpenTelemetry API.

Spans are built on the sink's own thread (_otel_spans.SpanWorker); gauges read the window of batches
(_aggregate.Window) at collection time.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any, Iterable, Optional, Tuple

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation

from ..core.events import (Event, NonFiniteEvent, SamplingRateEvent, SkippedNonFiniteStepEvent, SkippedStepEvent,
                           SkipStreakEvent, StoppedByRankEvent, set_trace_id_source)
from ..core.frame_stats import BatchStats
from ..core.rank import current_rank
from .otel_env import close_exporters_now, shutdown_bounded
from .._version import __version__
from ._otel_spans import SpanBuilder, SpanWorker, detection_context, frame_attributes  # noqa: F401 (re-export)
from ._aggregate import DEFAULT_WINDOW_S, ENV_WINDOW, ModuleFilter, Patterns, Window, window_seconds
from ._base import SamplingTally, Sink, StepTally, utf8_text
from ._options import number_option
from .catalogue import ATTRIBUTES, BY_KEY, place_attributes

_RANK, _FIRST_RANK = ATTRIBUTES["rank"], ATTRIBUTES["first_rank"]
_MODULE, _CLASS, _TENSOR = ATTRIBUTES["module"], ATTRIBUTES["module_class"], ATTRIBUTES["tensor"]


def _utf8(attrs: dict) -> dict:
    """String attribute values made valid UTF-8 (a module name may hold lone surrogates)."""
    return {k: utf8_text(v) for k, v in attrs.items()}

__all__ = ["OtelTelemetry", "SCOPE", "DEFAULT_MAX_SERIES"]

log = logging.getLogger(__name__)

SCOPE = "tensorwatch_otel"
#: One under the metrics SDK's default cardinality limit (2000), so no statistic ends up in
#: the SDK's anonymous overflow series; raise it together with a View's cardinality limit.
DEFAULT_MAX_SERIES = 1999


def _current_trace_id() -> Optional[str]:
    """The trace of the caller's current span, when it is valid and sampled (kept by backends)."""
    sc = trace.get_current_span().get_span_context()
    return format(sc.trace_id, "032x") if sc.is_valid and sc.trace_flags.sampled else None


def _export_interval_s(provider: Any) -> float:
    """The longest periodic export interval of an SDK provider's readers (0 with pull readers
    only); for any other provider (a proxy before the SDK is set up) OTEL_METRIC_EXPORT_INTERVAL."""
    readers = getattr(provider, "_metric_readers", None)
    if readers is None:
        readers = getattr(getattr(provider, "_sdk_config", None), "metric_readers", None)
    if readers is not None:
        ms = [getattr(r, "_export_interval_millis", 0) or 0 for r in readers]
    else:
        try:
            ms = [float(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "") or 60000)]
        except ValueError:
            ms = [60000.0]
    return max(ms, default=0) / 1000.0


_told_nowhere = False


def _warn_if_exporting_nowhere(tracer_provider: Any, meter_provider: Any) -> None:
    """One warning per process when neither a provider was given nor an SDK one is installed
    globally: the API's default provider drops everything without a word."""
    global _told_nowhere
    if _told_nowhere or tracer_provider is not None or meter_provider is not None:
        return
    from .otel_env import application_providers

    if application_providers() == (None, None):
        _told_nowhere = True
        log.warning("tensorwatch_otel: OtelTelemetry() found no OpenTelemetry SDK provider, so it exports "
                    "nothing until one is installed globally (trace.set_tracer_provider / "
                    "metrics.set_meter_provider, or opentelemetry-instrument). Pass tracer_provider=/"
                    "meter_provider=, or use watch(sinks=None) with OTEL_EXPORTER_OTLP_ENDPOINT set")


_exit_sinks: "weakref.WeakSet[OtelTelemetry]" = weakref.WeakSet()
_exit_hook_lock = threading.Lock()


def _bound_application_exit(sink: "OtelTelemetry") -> None:
    """The application's SDK providers (opentelemetry-instrument's, or ones set in code) shut
    down at exit with a final export that waits the exporter's whole timeout (10 s, with
    retries) when the collector hangs; our instruments give that export something to send.
    Registered after the SDK's own exit hooks, so run before them: it shuts those providers
    down itself, bounded by what is left of flush_timeout_s, and takes the SDK's hooks off.
    Only after a flush of ours found the collector hanging: a healthy exit is left alone."""
    with _exit_hook_lock:
        first = not _exit_sinks
        _exit_sinks.add(sink)
    if first:
        atexit.register(_shutdown_application_providers)


def _shutdown_application_providers() -> None:
    sinks = list(_exit_sinks)
    if not sinks:
        return
    budget = min(s._exit_budget() for s in sinks)
    providers = []
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        handler = getattr(provider, "_atexit_handler", None)  # set by the SDK: it would shut down at exit
        if handler is not None and callable(getattr(provider, "shutdown", None)):
            atexit.unregister(handler)
            providers.append(provider)
    if providers:
        if budget <= 0:  # the collector hangs: end the stuck calls rather than wait for them
            close_exporters_now(providers)
        shutdown_bounded(providers, budget)


def _attach_magnitudes(provider: Any, sink: "OtelTelemetry") -> list:
    """The magnitude histogram's collect hooks on an SDK provider's readers ([] without the SDK)."""
    try:
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from ._otel_magnitude import attach
    except ImportError:  # the API alone: no reader to reach
        return []
    return attach(provider, sink, InstrumentationScope(SCOPE, __version__))


class _Counters:
    """The sink's synchronous counters, made on `meter` from the catalogue; the step counters'
    series exist from zero for `rank`."""

    def __init__(self, meter: Any, rank: int):
        def counter(key: str):
            s = BY_KEY[key]
            return meter.create_counter(s.otel, unit=s.unit, description=s.help)

        self.nonfinite = counter("nonfinite")
        self.stopped = counter("stopped_by_rank")
        self.skipped = counter("steps_skipped")
        self.skipped.add(0, {_RANK: rank})  # the series exists from zero
        self.streaks = counter("skip_streaks")
        self.streaks.add(0, {_RANK: rank})
        self.nonfinite_skips = counter("skipped_nonfinite")
        self.nonfinite_skips.add(0, {_RANK: rank})


class _Flushes:
    """The sink's flushes of its providers, bounded in time: the timeout the last one was given
    (the watcher's flush_timeout_s), when it ended and what it took, the provider flushes that
    outlived it (the collector hangs)."""

    def __init__(self):
        self._timeout_s = 5.0  # the watcher's flush_timeout_s, as the last flush() was given
        self._last = (-1e9, 0.0)  # (monotonic end, seconds taken) of the last flush
        self._threads: list = []  # flush threads that outlived their flush's timeout
        self._late_logged = False

    def begin(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s

    def skipped(self) -> None:
        """A flush that did not run (an earlier one is still stuck) ended now, taking nothing."""
        self._last = (time.monotonic(), 0.0)

    def run(self, calls: list, start: float, deadline: float) -> None:
        """The providers' force_flush `calls` side by side, so a stalled trace export does not
        starve the metrics flush; the SDK's force_flush ignores its timeout, hence the daemon
        threads and the join bounded by the monotonic `deadline`."""
        threads = [threading.Thread(target=self._flush_one, args=(fn,), name="tensorwatch-otel-flush",
                                    daemon=True) for fn in calls]
        for th in threads:
            th.start()
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        self._threads = [th for th in threads if th.is_alive()]
        self._last = (time.monotonic(), time.monotonic() - start)

    def running(self) -> bool:
        """A provider flush outlived its flush's timeout and is still under way."""
        return any(th.is_alive() for th in self._threads)

    def budget(self) -> float:
        """flush_timeout_s, less what the flush that came just before took (detach() flushes, then closes)."""
        ended, took = self._last
        if time.monotonic() - ended < 1.0:
            return max(0.0, self._timeout_s - took)
        return self._timeout_s

    def first_late(self) -> bool:
        """True the first time a flush is late (it is said once)."""
        if self._late_logged:
            return False
        self._late_logged = True
        return True

    @staticmethod
    def _flush_one(fn) -> None:
        try:
            fn()
        except Exception as exc:
            log.warning("tensorwatch_otel: OpenTelemetry flush failed: %s: %s", type(exc).__name__, exc)


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
    - ``window_s``: seconds of batches the tensor gauges cover (their extremes), env
      TENSORWATCH_METRICS_WINDOW_SECONDS; by default 60 s or twice the longest periodic export
      interval of the meter provider's readers, whichever is longer.
    - The detection span lives in the event's ``trace_id`` (its parent is a remote context of
      that trace; the training step's span, if any, is a link), and the nonfinite counter is
      recorded in that context so exemplars carry the same trace id.
    - Skipped optimizer steps: counter ``tensorwatch.optimizer.steps_skipped`` ({step}) and
      gauge ``tensorwatch.grad_scale``; steps on_detect="skip" skipped: counter
      ``tensorwatch.skipped_nonfinite_steps`` ({step}) and a span ``tensorwatch.skipped_nonfinite_step`` each.
    - With ``watch(target_dtypes=...)``: gauges ``tensorwatch.tensor.underflow_ratio`` /
      ``overflow_ratio`` (attribute ``tensorwatch.target_dtype``, the largest share in the window)
      and the exponential histogram ``tensorwatch.tensor.magnitude`` (scale 0, cumulative, one
      sampled batch per collection), added to what the SDK meter provider's readers collect
      (see _otel_magnitude.py and _magnitude.py).
    - Gauges ``tensorwatch.measure_every_n_batches`` ({batch}: one batch in this many is measured)
      and, with ``watch(max_overhead=...)``, ``tensorwatch.overhead`` (1: the watcher's measured
      share of the step time).
    Names, units and descriptions come from the metric catalogue (catalogue.py).
    """

    wants_batches = True

    def __init__(self, tracer_provider: Any = None, meter_provider: Any = None, *,
                 include: Patterns = None, exclude: Patterns = None,
                 max_series: int = DEFAULT_MAX_SERIES, shutdown_on_close: bool = False,
                 window_s: Optional[float] = None):
        max_series = number_option("max_series", max_series, None, DEFAULT_MAX_SERIES, minimum=1, integer=True)
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        _warn_if_exporting_nowhere(tracer_provider, meter_provider)
        self._tracer = trace.get_tracer(SCOPE, __version__, tracer_provider=tracer_provider)
        self._worker = SpanWorker(SpanBuilder(self._tracer, tracer_provider))  # the span thread
        # Detections made while the application has a span open join its trace (the event's
        # trace_id is that span's), so every sink names the trace the detection span is in.
        set_trace_id_source(_current_trace_id)
        meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
        self.max_series = max_series
        self._wanted = ModuleFilter(include, exclude)
        self._shutdown_on_close = shutdown_on_close

        if window_s is None and not os.environ.get(ENV_WINDOW, "").strip():
            window_s = max(DEFAULT_WINDOW_S,
                           2 * _export_interval_s(meter_provider or metrics.get_meter_provider()))
        self._window = Window(self._wanted, max_series, window_seconds(window_s), "OpenTelemetry",
                              magnitudes=True)
        self._rows_cache: Tuple[int, list] = (-1, [])
        self._cache_lock = threading.Lock()
        self._rank = current_rank()  # a bad RANK fails here, naming it
        self._steps = StepTally(self._rank)  # skipped optimizer steps, streaks, loss scale
        self._sampling = SamplingTally()  # the interval between measured batches, the measured overhead
        self._shares_capped = False

        def observed(key: str, callback) -> None:
            s = BY_KEY[key]
            create = meter.create_observable_counter if s.kind == "counter" else meter.create_observable_gauge
            create(s.otel, [callback], unit=s.unit, description=s.help)

        self._counters = _Counters(meter, self._rank)
        observed("abs_max", self._observe_abs_max)
        observed("abs_min", self._observe_abs_min)
        observed("range_used", self._observe_range_used)
        observed("underflow", self._observe_underflow)
        observed("overflow", self._observe_overflow)
        observed("grad_scale", self._observe_grad_scale)
        observed("skip_streak", self._observe_streak)
        observed("batches", self._observe_batches)
        observed("batch_number", self._observe_batch_number)
        observed("measure_every", self._observe_measure_every)
        observed("overhead", self._observe_overhead)
        self._magnitude_hooks = _attach_magnitudes(meter_provider or metrics.get_meter_provider(), self)
        self._closed = False
        self._flushes = _Flushes()

    # -- sink port (training thread: cheap) -----------------------------------------------
    @property
    def window_s(self) -> float:
        """Seconds of batches the tensor gauges cover (0: the last watched batch)."""
        return self._window.window_s

    def on_batch(self, stats: BatchStats) -> None:
        self._window.add(stats)
        self._sampling.on_batch(stats)
        if self._steps.on_batch(stats):
            self._count_skips(stats.rank)

    def _count_skips(self, rank: int) -> None:
        n = self._steps.take_new()
        if n:
            self._counters.skipped.add(n, {_RANK: rank})

    def on_event(self, event: Event) -> None:
        if self._closed:
            return
        ctx = otel_context.get_current()
        count = getattr(self, "_count_" + event.event, None)  # the metrics an event type moves
        if count is not None:
            ctx = count(event, ctx)
            if ctx is None:  # no span for it
                return
        # The caller's context makes the span a child of the training step's span, if any.
        self._worker.put((event, ctx))

    def _count_optimizer_step_skipped(self, event: SkippedStepEvent, ctx: Any) -> Any:
        self._steps.on_skip(event, False)
        self._count_skips(event.rank)
        return None  # one per skip: the counter says it; a streak gets a span

    def _count_sampling_rate(self, event: SamplingRateEvent, ctx: Any) -> Any:
        self._sampling.on_rate(event)  # the gauge follows the watcher now, not at its next measured batch
        return None  # no span: the gauge says it

    def _count_skipped_steps_streak(self, event: SkipStreakEvent, ctx: Any) -> Any:
        self._steps.on_skip(event, True)
        self._counters.streaks.add(1, {_RANK: event.rank})
        return ctx

    def _count_skipped_nonfinite_step(self, event: SkippedNonFiniteStepEvent, ctx: Any) -> Any:
        self._counters.nonfinite_skips.add(1, {_RANK: event.rank})  # and a span
        return ctx

    def _count_stopped_by_rank(self, event: StoppedByRankEvent, ctx: Any) -> Any:
        self._counters.stopped.add(1, {**_utf8(place_attributes(event.place)), _RANK: event.rank,
                                       _FIRST_RANK: event.first_rank})
        return ctx

    def _count_nonfinite_detected(self, event: NonFiniteEvent, ctx: Any) -> Any:
        first = event.rank if event.first_rank is None else event.first_rank
        # In the detection's trace, so the exemplar names the span's trace id: a child of the
        # current span when the event took its trace id, else a trace of its own.
        current = trace.get_current_span(ctx).get_span_context()
        joined = current.is_valid and format(current.trace_id, "032x") == event.trace_id
        dctx = detection_context(event.trace_id, ctx) if event.trace_id and not joined else None
        self._counters.nonfinite.add(1, {**_utf8(place_attributes(event.place)), _RANK: event.rank,
                                         _FIRST_RANK: first}, context=dctx or ctx)
        if dctx is not None:
            return (dctx, trace.get_current_span(ctx).get_span_context())
        return ctx

    def flush(self, timeout_s: float = 5.0) -> None:
        """Spans of events seen so far are handed to the span processor, then both providers
        are flushed; the whole call returns within about timeout_s, whatever the collector does.
        While an earlier flush is still stuck (the collector hangs) it returns at once: a second
        wait would only add timeout_s to the detection or the exit, and export nothing more."""
        self._flushes.begin(timeout_s)
        start = time.monotonic()
        if self._stalled():
            log.debug("tensorwatch_otel: OpenTelemetry flush skipped: the previous one has not finished")
            self._flushes.skipped()
            return
        deadline = start + timeout_s
        self._worker.drain(deadline)
        calls = []
        for provider in self._providers():
            fn = getattr(provider, "force_flush", None)
            if callable(fn):
                calls.append(fn)
        self._flushes.run(calls, start, deadline)
        if self._stalled() and None in (self._tracer_provider, self._meter_provider):
            _bound_application_exit(self)  # the collector hangs: the application's exit would wait on it too
        if self._stalled() and self._flushes.first_late():
            log.warning("tensorwatch_otel: OpenTelemetry flush did not finish within %.1f s (collector "
                        "slow or unreachable?); training goes on, the export continues in the background",
                        timeout_s)

    def _providers(self) -> list:
        return [self._tracer_provider or trace.get_tracer_provider(),
                self._meter_provider or metrics.get_meter_provider()]

    def _stalled(self) -> bool:
        """True while a flush that outlived its timeout is still under way."""
        return self._worker.draining() or self._flushes.running()

    def _exit_budget(self) -> float:
        """Seconds close() or the exit may still wait: flush_timeout_s in all, counting the flush
        that came just before (detach() flushes, then closes); nothing while the collector hangs."""
        if self._stalled():
            return 0.0
        return self._flushes.budget()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        budget = self._exit_budget()
        start = time.monotonic()
        # spans still queued reach the processor before the providers shut down
        self._worker.stop(min(2.0, budget))
        if self._shutdown_on_close:
            providers = [p for p in (self._tracer_provider, self._meter_provider)
                         if callable(getattr(p, "shutdown", None))]
            left = max(0.0, budget - (time.monotonic() - start))
            if left <= 0:  # the collector hangs: end the stuck calls rather than wait for them
                close_exporters_now(providers)
            shutdown_bounded(providers, left)  # its final export still carries the histogram
        else:  # the application's providers go on: this sink's histogram leaves them now
            for hook in self._magnitude_hooks:
                hook.sources.discard(self)

    # -- metric callbacks (the SDK's collection thread) --------------------------------------
    def _entries(self) -> list:
        snap = self._window.snapshot()
        if snap is None:
            return []
        with self._cache_lock:
            version, out = self._rows_cache
            if version == snap.version:
                return out
            rank = snap.rank
            out = []
            for module, cls, tensor, dtype, lo, hi, ru, shares in snap.rows:
                attrs = {_MODULE: utf8_text(module), _CLASS: utf8_text(cls), _TENSOR: utf8_text(tensor), _RANK: rank}
                out.append((attrs, dtype, lo, hi, ru, shares))
            self._rows_cache = (snap.version, out)
            return out

    @staticmethod
    def _finite(v: Optional[float]) -> bool:
        return v is not None and v - v == 0  # False for inf and nan

    def _observe_abs_max(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(e[3], e[0]) for e in self._entries() if self._finite(e[3])]

    def _observe_abs_min(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(e[2], e[0]) for e in self._entries() if self._finite(e[2])]

    def _observe_range_used(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(e[4], dict(e[0], **{ATTRIBUTES["dtype"]: e[1]}))
                for e in self._entries() if self._finite(e[4])]

    def _observe_shares(self, which: int) -> Iterable[Observation]:
        out = [Observation(share[which], dict(attrs, **{ATTRIBUTES["target_dtype"]: utf8_text(share[0])}))
               for attrs, _, _, _, _, shares in self._entries() for share in shares if share[which] is not None]
        if len(out) > self.max_series:
            # One point per pair and target dtype: kept under the SDK's cardinality limit like
            # the other gauges (the pairs seen first stay), said once.
            if not self._shares_capped:
                self._shares_capped = True
                log.warning("tensorwatch_otel: %d underflow/overflow points (pairs x target dtypes) exceed "
                            "max_series=%d; the pairs seen first are exported. Narrow with include=/exclude= "
                            "or raise max_series with a View's cardinality limit.", len(out), self.max_series)
            del out[self.max_series:]
        return out

    def _observe_underflow(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe_shares(1)

    def _observe_overflow(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._observe_shares(2)

    def magnitude_points(self) -> list:
        """The magnitude histogram's data points (the SDK's collection thread, through the hook)."""
        snap = self._window.snapshot()
        rank = self._rank if snap is None else snap.rank
        from ._otel_magnitude import data_points

        return data_points(self._window.magnitude_rows(), rank, utf8_text)

    def _observe_batches(self, options: CallbackOptions) -> Iterable[Observation]:
        snap = self._window.snapshot()
        if snap is None:
            return []
        return [Observation(snap.batches, {_RANK: snap.rank})]

    def _observe_batch_number(self, options: CallbackOptions) -> Iterable[Observation]:
        snap = self._window.snapshot()
        if snap is None:
            return []
        return [Observation(snap.batch_number, {_RANK: snap.rank})]

    def _observe_measure_every(self, options: CallbackOptions) -> Iterable[Observation]:
        every = self._sampling.every_n_batches
        return [] if every is None else [Observation(every, {_RANK: self._rank})]

    def _observe_overhead(self, options: CallbackOptions) -> Iterable[Observation]:
        overhead = self._sampling.overhead
        return [] if overhead is None else [Observation(overhead, {_RANK: self._rank})]

    def _observe_grad_scale(self, options: CallbackOptions) -> Iterable[Observation]:
        scale, rank = self._steps.scale, self._steps.rank
        if scale is None or not self._finite(scale):
            return []
        return [Observation(scale, {_RANK: rank})]

    def _observe_streak(self, options: CallbackOptions) -> Iterable[Observation]:
        streak = self._steps.streak
        if streak is None:
            return []
        return [Observation(streak[0], {_RANK: streak[1]})]
