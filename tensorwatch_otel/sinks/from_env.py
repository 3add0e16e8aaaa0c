"""The sinks that ``watch(model, sinks=None)`` adds to the text report, as the environment says.

Variables are read when called (a watcher is being built), never at import.
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional

from ..core.ports import Sink
from ..core.rank import current_rank

log = logging.getLogger(__name__)

ENV_PROMETHEUS_PORT = "TENSORWATCH_PROMETHEUS_PORT"
ENV_PROMETHEUS_ADDR = "TENSORWATCH_PROMETHEUS_ADDR"
ENV_JSONL = "TENSORWATCH_JSONL"


def _prometheus_port() -> Optional[int]:
    raw = os.environ.get(ENV_PROMETHEUS_PORT, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{ENV_PROMETHEUS_PORT}={raw!r}: expected a TCP port number 0..65535 "
                         f"(each process serves it plus LOCAL_RANK)")
    return port


def sinks_from_env() -> List[Sink]:
    """PrometheusMetrics when TENSORWATCH_PROMETHEUS_PORT is set (bound to
    TENSORWATCH_PROMETHEUS_ADDR, default 127.0.0.1), JsonlLog when TENSORWATCH_JSONL is set,
    OtelTelemetry exporting over OTLP when an OTEL_EXPORTER_OTLP_*ENDPOINT variable is set and
    OTEL_SDK_DISABLED is not "true". Invalid values raise ValueError naming the variable."""
    sinks: List[Sink] = []
    port = _prometheus_port()
    if port is not None:
        from .prometheus import PrometheusMetrics

        addr = os.environ.get(ENV_PROMETHEUS_ADDR, "").strip() or "127.0.0.1"
        sinks.append(PrometheusMetrics(port=port, addr=addr))

    path = os.environ.get(ENV_JSONL, "").strip()
    if path:
        from .jsonl import JsonlLog

        sinks.append(JsonlLog(path))

    from .otel_env import otlp_configured, sdk_disabled

    if otlp_configured() and not sdk_disabled():
        from .otel_env import configure_from_env

        providers = configure_from_env(current_rank())
        if providers is not None:
            from .otel import OtelTelemetry

            tracer_provider, meter_provider = providers
            sinks.append(OtelTelemetry(tracer_provider, meter_provider, shutdown_on_close=True))
    return sinks
