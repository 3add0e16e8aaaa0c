"""tensorwatch_otel: find the first inf/nan in PyTorch training and page on it.

Imports torch only; exporters (prometheus_client, opentelemetry) load when a sink needs them.
"""

from __future__ import annotations

from .integrations.debug_utils import DebugUnderflowOverflow, detect_overflow
from .core.events import (
    AbortAfterBatchEvent,
    BatchTraceEvent,
    NonFiniteEvent,
    OverflowCheckEvent,
    StoppedByRankEvent,
)
from .core.frame_stats import (
    BatchStats,
    Frame,
    TensorStat,
)
from ._version import __version__
from .core.batch.capture import load_capture
from ._watch import watch
from .core.errors import AbortAfterBatch, NonFiniteDetected
from .core.watcher import Watcher

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
    "StoppedByRankEvent",
    "load_capture",
    "__version__",
]
