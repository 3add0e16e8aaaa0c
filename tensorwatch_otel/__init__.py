"""tensorwatch_otel: find the first inf/nan in PyTorch training and page on it.

Imports torch only; exporters (prometheus_client, opentelemetry) load when a sink needs them.
"""

from __future__ import annotations

from ._dropin import DebugUnderflowOverflow, detect_overflow
from ._events import (
    AbortAfterBatchEvent,
    BatchStats,
    BatchTraceEvent,
    Frame,
    NonFiniteEvent,
    OverflowCheckEvent,
    TensorStat,
)
from ._version import __version__
from ._watcher import AbortAfterBatch, NonFiniteDetected, Watcher, watch

__all__ = [
    "watch",
    "Watcher",
    "NonFiniteDetected",
    "AbortAfterBatch",
    "DebugUnderflowOverflow",
    "detect_overflow",
    "TensorStat",
    "Frame",
    "BatchStats",
    "NonFiniteEvent",
    "BatchTraceEvent",
    "AbortAfterBatchEvent",
    "OverflowCheckEvent",
    "__version__",
]
