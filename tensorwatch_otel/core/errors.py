"""The exceptions the watcher raises into training, on purpose (both are ValueErrors, as the
transformers.debug_utils peer raises)."""

from __future__ import annotations

from .events import NonFiniteEvent


class NonFiniteDetected(ValueError):
    """Raised (with on_detect="raise") once inf/nan was found and every sink has recorded it."""

    def __init__(self, message: str, event: NonFiniteEvent):
        super().__init__(message)
        self.event = event


class AbortAfterBatch(ValueError):
    """Raised after the batch named by abort_after_batch has finished."""
