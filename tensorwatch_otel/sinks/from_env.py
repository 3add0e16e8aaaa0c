"""The sinks that ``watch(model, sinks=None)`` adds to the text report, as the environment says.

Variables are read when called (a watcher is being built), never at import; their names are
the constants of core/env.py.
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional

from ..core.env import ENV_JSONL, ENV_PROMETHEUS_ADDR, ENV_PROMETHEUS_PORT, ConfigError, text
from ..core.ports import Sink
from ..core.rank import current_rank

__all__ = ["sinks_from_env", "ENV_PROMETHEUS_PORT", "ENV_PROMETHEUS_ADDR", "ENV_JSONL"]

log = logging.getLogger(__name__)


def prometheus_port() -> Optional[int]:
    raw = text(os.environ, ENV_PROMETHEUS_PORT)
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"{ENV_PROMETHEUS_PORT}={raw!r}: expected a TCP port number 0..65535 "
                          f"(each process serves it plus LOCAL_RANK)")
    return port


def sinks_from_env() -> List[Sink]:
    """PrometheusMetrics when TENSORWATCH_PROMETHEUS_PORT is set (bound to
    TENSORWATCH_PROMETHEUS_ADDR, default 127.0.0.1), JsonlLog when TENSORWATCH_JSONL is set,
    and OtelTelemetry (see otel_sink_from_env). An invalid TENSORWATCH_* value raises
    ConfigError (a ValueError) naming the variable."""
    sinks: List[Sink] = []
    port = prometheus_port()
    if port is not None:
        from .prometheus import PrometheusMetrics

        addr = text(os.environ, ENV_PROMETHEUS_ADDR) or "127.0.0.1"
        try:
            sinks.append(PrometheusMetrics(port=port, addr=addr))
        except ValueError as exc:
            if not str(exc).startswith("addr="):
                raise
            raise ConfigError(f"{ENV_PROMETHEUS_ADDR}={addr!r}: not an address this host can listen on; "
                              f"expected e.g. 127.0.0.1, 0.0.0.0 or a local interface's address") from None

    path = text(os.environ, ENV_JSONL)
    if path:
        from .jsonl import JsonlLog

        sinks.append(JsonlLog(path))

    otel = otel_sink_from_env()
    if otel is not None:
        sinks.append(otel)
    return sinks


def otel_sink_from_env() -> Optional[Sink]:
    """OtelTelemetry unless OTEL_SDK_DISABLED=true, exporting each signal through the provider
    the application installed globally (an SDK set up in code or by opentelemetry-instrument),
    else through one built from the OTEL_EXPORTER_OTLP_* variables, else not at all; None when
    neither exists. The application's providers are never shut down here, and nothing is
    exported twice. A bad OTEL_* value gives one error line naming the variable and no OTLP
    pipeline of ours (never an exception into training)."""
    from .otel_env import OtlpConfigError, application_providers, configure_from_env, otlp_configured, sdk_disabled

    if sdk_disabled():
        return None
    app_tp, app_mp = application_providers()
    own: Any = None
    if (app_tp is None or app_mp is None) and otlp_configured():
        try:
            own = configure_from_env(current_rank(), traces=app_tp is None, metrics=app_mp is None)
        except OtlpConfigError as exc:  # the message names the variable
            log.error("tensorwatch_otel: %s; OTLP export from tensorwatch_otel is off for this run", exc)
        except Exception as exc:  # an exporter that cannot be built must not stop the run
            log.error("tensorwatch_otel: setting up OTLP export failed (%s: %s); OTLP export from "
                      "tensorwatch_otel is off for this run", type(exc).__name__, exc)
    if app_tp is None and app_mp is None and own is None:
        return None
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.trace import NoOpTracerProvider

    from .otel import OtelTelemetry

    # None makes OtelTelemetry use the global (application's) provider and leave its shutdown
    # to the application; the providers made here are shut down when the watcher detaches.
    tracer_provider = None if app_tp is not None else (own[0] if own else NoOpTracerProvider())
    meter_provider = None if app_mp is not None else (own[1] if own else NoOpMeterProvider())
    if (app_tp is not None or app_mp is not None) and otlp_configured():
        from ._otlp_check import warn_well_known_port_mismatch

        warn_well_known_port_mismatch(os.environ)  # the application's exporters: a port that cannot work
    if app_tp is not None or app_mp is not None:
        log.debug("tensorwatch_otel: exporting through the application's OpenTelemetry providers "
                  "(traces: %s, metrics: %s)", type(app_tp).__name__, type(app_mp).__name__)
    return OtelTelemetry(tracer_provider, meter_provider, shutdown_on_close=True)
