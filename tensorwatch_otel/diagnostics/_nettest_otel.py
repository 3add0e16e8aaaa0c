"""OpenTelemetry export for `nettest`: one span per rank and the bandwidth as gauges.

Active only when the OTEL_* variables configure OTLP (via tensorwatch_otel._otel_env); failures
are logged and never change the verdict.
"""

from __future__ import annotations

import logging
from typing import Any, Dict

log = logging.getLogger("tensorwatch_otel.nettest")

SPAN_NAME = "tensorwatch.nettest"
FLUSH_TIMEOUT_S = 5.0


def export_rank(state: Dict[str, Any]) -> bool:
    """Exports this rank's result; True when something was exported."""
    try:
        from ..sinks import otel_env as _otel_env
    except ImportError:
        log.debug("tensorwatch_otel._otel_env unavailable: no OTLP export")
        return False
    try:
        providers = _otel_env.configure_from_env(int(state["rank"]))
        if providers is None:
            return False
        tracer_provider, meter_provider = providers
        _span(tracer_provider, state)
        _gauges(meter_provider, state)

        def flush() -> None:
            for p in (tracer_provider, meter_provider):
                if hasattr(p, "force_flush"):
                    p.force_flush()

        _otel_env.run_bounded(flush, FLUSH_TIMEOUT_S, "nettest-flush")
        return True
    except Exception as exc:  # telemetry must not change the test's verdict
        log.warning("nettest: OTLP export failed: %s: %s", type(exc).__name__, exc)
        return False


def _scope_version() -> str:
    from .._version import __version__

    return __version__


def _span(tracer_provider: Any, state: Dict[str, Any]) -> None:
    from opentelemetry.trace import Status, StatusCode

    tracer = tracer_provider.get_tracer("tensorwatch_otel", _scope_version())
    start = int(state["start_unix_ns"])
    attrs = {
        "tensorwatch.rank": int(state["rank"]),
        "tensorwatch.world_size": int(state["world_size"]),
        "tensorwatch.local_rank": int(state["local_rank"]),
        "tensorwatch.nettest.backend": state.get("backend") or "",
        "tensorwatch.nettest.status": "ok" if state["ok"] else "broken",
        "tensorwatch.nettest.stage": state.get("stage") or "",
        "host.name": state.get("host") or "",
    }
    if not state["ok"]:
        attrs["tensorwatch.nettest.reason"] = state.get("reason", "")
    span = tracer.start_span(SPAN_NAME, start_time=start, attributes=attrs)
    if not state["ok"]:
        span.set_status(Status(StatusCode.ERROR, state.get("reason", "")))
    span.end(end_time=start + int(float(state.get("duration_s", 0.0)) * 1e9))


def _gauges(meter_provider: Any, state: Dict[str, Any]) -> None:
    meter = meter_provider.get_meter("tensorwatch_otel", _scope_version())
    algbw = meter.create_gauge("tensorwatch.nettest.algbw", unit="By/s",
                               description="all_reduce algorithm bandwidth: message bytes / time")
    busbw = meter.create_gauge("tensorwatch.nettest.busbw", unit="By/s",
                               description="all_reduce bus bandwidth: algbw * 2(n-1)/n")
    for row in state.get("bandwidth") or []:
        attrs = {"tensorwatch.rank": int(state["rank"]),
                 "tensorwatch.nettest.backend": state.get("backend") or "",
                 "tensorwatch.nettest.message_size": int(row["bytes"])}
        algbw.set(float(row["algbw_gbps"]) * 1e9, attrs)
        busbw.set(float(row["busbw_gbps"]) * 1e9, attrs)
