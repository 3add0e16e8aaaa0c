"""Sinks turn watcher events into a text report, a JSON lines log, Prometheus metrics or
OpenTelemetry spans and metrics. Each loads its exporter library only when used."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._base import Sink

__all__ = ["Sink", "TextReport", "JsonlLog", "PrometheusMetrics", "OtelTelemetry"]

_LAZY = {
    "TextReport": ".text",
    "JsonlLog": ".jsonl",
    "PrometheusMetrics": ".prometheus",
    "OtelTelemetry": ".otel",
}

if TYPE_CHECKING:  # pragma: no cover
    from .jsonl import JsonlLog
    from .otel import OtelTelemetry
    from .prometheus import PrometheusMetrics
    from .text import TextReport


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'tensorwatch_otel.sinks' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
