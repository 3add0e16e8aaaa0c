"""The exceptions the watcher raises into training, on purpose (both are ValueErrors, as the
transformers.debug_utils peer raises)."""

from __future__ import annotations

from typing import Union

from .events import NonFiniteEvent, StoppedByRankEvent


class NonFiniteDetected(ValueError):
    """Raised (with on_detect="raise") once inf/nan was found and every sink has recorded it.

    `.event` is the NonFiniteEvent, or on a rank stopped by another rank's detection a
    StoppedByRankEvent naming the first rank's module, tensor and batch."""

    def __init__(self, message: str, event: Union[NonFiniteEvent, StoppedByRankEvent]):
        super().__init__(message)
        self.event = event


class AbortAfterBatch(ValueError):
    """Raised after the batch named by abort_after_batch has finished."""
