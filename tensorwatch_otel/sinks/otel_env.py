"""Builds OpenTelemetry SDK providers with OTLP exporters from the standard OTEL_* variables.

Used when ``sinks=None`` and an OTLP endpoint is configured; imported only then.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, List, Mapping, Optional, Tuple

from .catalogue import ATTRIBUTES
from ._otlp_check import DEFAULT_PROTOCOL, PROTOCOLS, OtlpConfigError, Target  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

#: Upper bound for flushing and shutting down the providers at interpreter exit.
EXIT_TIMEOUT_S = 5.0

#: A repeated exporter warning (collector down, retrying...) is let through once per this period.
REPEAT_LOG_PERIOD_S = 300.0
# The SDK modules that log one line per failed export attempt.
_EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.metrics._internal.export",
)

_SIGNAL_ENDPOINT = {
    "traces": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "metrics": "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
}


def sdk_disabled(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when OTEL_SDK_DISABLED is "true" (case-insensitive), as the SDK reads it."""
    env = os.environ if env is None else env
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def otlp_configured(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when an OTLP endpoint variable (generic, traces or metrics) is set and non-empty."""
    env = os.environ if env is None else env
    names = ("OTEL_EXPORTER_OTLP_ENDPOINT",) + tuple(_SIGNAL_ENDPOINT.values())
    return any(env.get(n, "").strip() for n in names)


def _signal_wanted(signal: str, env: Mapping[str, str]) -> bool:
    # OTEL_TRACES_EXPORTER=none / OTEL_METRICS_EXPORTER=none switch a signal off.
    chosen = env.get(f"OTEL_{signal.upper()}_EXPORTER", "").strip().lower()
    if chosen == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or env.get(_SIGNAL_ENDPOINT[signal], "").strip())


def application_providers() -> Tuple[Optional[Any], Optional[Any]]:
    """(tracer_provider, meter_provider) the application installed globally, with
    ``trace.set_tracer_provider``/``metrics.set_meter_provider`` or through
    ``opentelemetry-instrument``; None for a signal that only has the API's proxy or no-op."""
    from opentelemetry import metrics, trace
    from opentelemetry.metrics import NoOpMeterProvider

    try:  # the API's placeholder until a provider is set; private, so looked up defensively
        from opentelemetry.metrics._internal import _ProxyMeterProvider as proxy_meter
    except ImportError:  # pragma: no cover - other API versions
        proxy_meter = NoOpMeterProvider
    tp: Any = trace.get_tracer_provider()
    if isinstance(tp, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        tp = None
    mp: Any = metrics.get_meter_provider()
    if isinstance(mp, (proxy_meter, NoOpMeterProvider)):
        mp = None
    return tp, mp


def _span_exporter(protocol: str):
    # The exporters read their endpoint, headers, timeout, compression and TLS files from the
    # environment themselves (generic and per-signal variables, with the spec's precedence).
    # Only the protocol is ours to choose (resolve() in _otlp_check).
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def _metric_exporter(protocol: str):
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    return OTLPMetricExporter()


DEFAULT_SERVICE_NAME = "tensorwatch-otel"  # when neither OTEL_SERVICE_NAME nor the attributes name one


def make_resource(rank: int):
    """The SDK resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, SDK defaults) plus
    ``tensorwatch.rank``. ``service.instance.id`` stays unique per process (the SDK's random
    UUID, or one of ours on SDKs without it) so two jobs on one collector never share one;
    an id the user gives in OTEL_RESOURCE_ATTRIBUTES wins."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    detected = OTELResourceDetector().detect().attributes
    attrs: dict = {ATTRIBUTES["rank"]: int(rank)}
    if "service.name" not in detected:
        # the SDK would say unknown_service; the shipped Jaeger links look for this name
        attrs["service.name"] = DEFAULT_SERVICE_NAME
    resource = Resource.create(attrs)
    if "service.instance.id" not in resource.attributes:
        resource = resource.merge(Resource({"service.instance.id": _process_instance_id()}))
    return resource


_instance_id: Tuple[int, str] = (-1, "")


def _process_instance_id() -> str:
    """A random UUID for this process (a fork gets its own)."""
    global _instance_id
    import uuid

    if _instance_id[0] != os.getpid():
        _instance_id = (os.getpid(), str(uuid.uuid4()))
    return _instance_id[1]


def configure_from_env(rank: int = 0, *, traces: bool = True,
                       metrics: bool = True) -> Optional[Tuple[Any, Any]]:
    """(tracer_provider, meter_provider) exporting over OTLP as the OTEL_* variables say, or None
    when OTEL_SDK_DISABLED=true or no OTLP endpoint variable is set.

    ``traces``/``metrics`` False: that signal gets the API's no-op provider (the application
    exports it through its own provider). A signal switched off (``OTEL_TRACES_EXPORTER=none``,
    or only the other signal's endpoint set) gets the no-op provider too. The protocol is
    OTEL_EXPORTER_OTLP_[SIGNAL_]PROTOCOL, else grpc for an endpoint on port 4317, else
    http/protobuf. Spans go through a BatchSpanProcessor (bounded queue, its own thread;
    OTEL_BSP_* honoured), metrics through a PeriodicExportingMetricReader
    (OTEL_METRIC_EXPORT_INTERVAL honoured). Both shut down at interpreter exit, bounded by
    EXIT_TIMEOUT_S so a dead collector cannot hold the process. Providers are not made global.
    The SDK's per-attempt export errors are let through once per REPEAT_LOG_PERIOD_S; an export
    failing because protocol and port do not match is explained in one warning.
    Raises OtlpConfigError (a ValueError naming the variable) for an unsupported protocol or an
    endpoint that is not a URL, before anything is built.
    """
    env = os.environ
    if sdk_disabled(env) or not otlp_configured(env):
        return None
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.trace import NoOpTracerProvider

    from ._otlp_backoff import ExportBackoff
    from ._otlp_check import MismatchCheck, checked_metric_exporter, checked_span_exporter, resolve

    wanted = [s for s, on in (("traces", traces), ("metrics", metrics)) if on and _signal_wanted(s, env)]
    targets = {signal: resolve(signal, env) for signal in wanted}  # every check before building
    resource = make_resource(rank)
    tracer_provider: Any = NoOpTracerProvider()
    meter_provider: Any = NoOpMeterProvider()
    to_shut: List[Any] = []
    try:
        if "traces" in targets:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            t = targets["traces"]
            exporter = checked_span_exporter(_span_exporter(t.protocol), MismatchCheck(t), ExportBackoff("traces"))
            tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
            to_shut.append(tracer_provider)
            # BatchSpanProcessor reads OTEL_BSP_MAX_QUEUE_SIZE (default 2048) and drops when full.
            tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
            _log_protocol(t)

        if "metrics" in targets:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            t = targets["metrics"]
            exporter = checked_metric_exporter(_metric_exporter(t.protocol), MismatchCheck(t))
            reader = PeriodicExportingMetricReader(exporter)
            meter_provider = MeterProvider(resource=resource, metric_readers=[reader], shutdown_on_exit=False)
            to_shut.append(meter_provider)
            _log_protocol(t)
    except Exception:
        shutdown_bounded(to_shut, EXIT_TIMEOUT_S)  # no half-built pipeline stays behind
        raise

    if to_shut:
        atexit.register(shutdown_bounded, to_shut, EXIT_TIMEOUT_S)
        quiet_repeated_export_errors()
    return tracer_provider, meter_provider


_told_grpc_by_port: set = set()


def _log_protocol(t: Target) -> None:
    if t.protocol_var is None and t.protocol == "grpc" and t.endpoint not in _told_grpc_by_port:
        _told_grpc_by_port.add(t.endpoint)
        log.info("tensorwatch_otel: %s=%s is on the OTLP/gRPC port and OTEL_EXPORTER_OTLP_PROTOCOL is "
                 "unset: exporting over grpc", t.endpoint_var, t.endpoint)
    else:
        log.debug("tensorwatch_otel: OTLP %s over %s to %s", t.signal, t.protocol, t.endpoint)


class RepeatFilter(logging.Filter):
    """Lets a message (same logger, level and format string) through once per period, so a
    collector that is down gives a log line now and then instead of one per export attempt."""

    def __init__(self, period_s: float = REPEAT_LOG_PERIOD_S):
        super().__init__()
        self.period_s = period_s
        self._last: dict = {}
        self.suppressed = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.period_s:
                self.suppressed += 1
                return False
            self._last[key] = now
        return True


_repeat_filter: Optional[RepeatFilter] = None


def quiet_repeated_export_errors() -> RepeatFilter:
    """Installs (once) the RepeatFilter on the SDK's exporter loggers; returns it."""
    global _repeat_filter
    with _shut_lock:
        if _repeat_filter is None:
            _repeat_filter = RepeatFilter()
            for name in _EXPORT_LOGGERS:
                logging.getLogger(name).addFilter(_repeat_filter)
        return _repeat_filter


def run_bounded(fn: Callable[[], Any], timeout_s: float, name: str) -> bool:
    """Runs fn on a daemon thread and waits at most timeout_s; True when it finished in time.

    The SDK's force_flush ignores its timeout and exports on the calling thread, so this is how
    a flush or shutdown stays bounded when the collector is slow or gone.
    """
    done = threading.Event()

    def target() -> None:
        try:
            fn()
        except Exception as exc:  # logged, never raised into training
            log.warning("tensorwatch_otel: %s failed: %s: %s", name, type(exc).__name__, exc)
        finally:
            done.set()

    threading.Thread(target=target, name=f"tensorwatch-{name}", daemon=True).start()
    finished = done.wait(max(0.0, timeout_s))
    if not finished:
        log.warning("tensorwatch_otel: %s did not finish within %.1f s; going on without it", name, timeout_s)
    return finished


_shut_down: "weakref.WeakSet[Any]" = weakref.WeakSet()
_shut_lock = threading.Lock()


def _exporters(provider: Any) -> List[Any]:
    """The exporters behind an SDK provider's readers and span processors (private SDK fields,
    looked up defensively: nothing found means nothing to close early)."""
    out = []
    # a MeterProvider's readers: _metric_readers (SDK 1.45), _sdk_config.metric_readers (older)
    readers = getattr(provider, "_metric_readers", None) or \
        getattr(getattr(provider, "_sdk_config", None), "metric_readers", None) or ()
    for reader in readers:
        out.append(getattr(reader, "_exporter", None))
    multi = getattr(provider, "_active_span_processor", None)
    for proc in getattr(multi, "_span_processors", None) or ():
        inner = getattr(proc, "_batch_processor", None)
        out.append(getattr(inner, "_exporter", None) or getattr(proc, "span_exporter", None))
    return [e for e in out if callable(getattr(e, "shutdown", None))]


def close_exporters_now(providers: List[Any]) -> None:
    """Shuts the providers' exporters down before the providers: an OTLP/gRPC exporter closes its
    channel, which ends a call stuck on a hung collector at once (gRPC's own teardown at
    interpreter exit would otherwise wait for that call's deadline, 10 s); an exporter shut down
    this way drops what it still held, which a hung collector would not have taken anyway."""
    for p in providers:
        for exporter in _exporters(p):
            try:
                exporter.shutdown()
            except Exception as exc:  # logged, never raised into training or exit
                log.debug("tensorwatch_otel: closing %s: %s", type(exporter).__name__, exc)


def shutdown_bounded(providers: List[Any], timeout_s: float) -> None:
    """Flushes and shuts down each provider (once: a sink's close and the exit hook may both
    ask), all of them together bounded by timeout_s; then the protocol mismatch check of each
    of our exporters says what it found (at most _otlp_check.PROBE_TIMEOUT_S more, only while a
    probe of a failing endpoint is still under way)."""
    with _shut_lock:
        todo = [p for p in providers if p not in _shut_down]
        _shut_down.update(todo)
    if not todo:
        return

    def shut() -> None:
        for p in todo:
            try:
                p.shutdown()
            except Exception as exc:
                log.warning("tensorwatch_otel: shutting down %s failed: %s", type(p).__name__, exc)

    run_bounded(shut, timeout_s, "otel-shutdown")
    # An export failing on a protocol/port mismatch is said before the process can end; the
    # exporter's own retries (up to its timeout) would often outlast a short run.
    for p in todo:
        for exporter in _exporters(p):
            check = getattr(exporter, "check", None)
            if check is not None:
                check.settle()
