"""The exceptions the watcher raises into training, on purpose (both are ValueErrors, as the
transformers.debug_utils peer raises)."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

from .events import NonFiniteEvent, StoppedByRankEvent


class NonFiniteDetected(ValueError):
    """Raised (with on_detect="raise") once inf/nan was found and every sink has recorded it.

    `.event` is the NonFiniteEvent, or on a rank stopped by another rank's detection a
    StoppedByRankEvent naming the first rank's module, tensor and batch.

    It pickles with its event (a process pool's worker hands it to the caller whole). Built
    from a message alone, `.event` is None: torch's DataLoader re-raises a worker's exception
    in the main process as `type(message)`, with the worker's traceback and the detection's
    line in the message but without the event (the worker's sinks recorded it)."""

    def __init__(self, message: str, event: Optional[Union[NonFiniteEvent, StoppedByRankEvent]] = None):
        super().__init__(message)
        self.event = event

    def __reduce__(self) -> Tuple[Any, ...]:
        return type(self), (str(self.args[0]) if self.args else "", self.event), self.__dict__


class AbortAfterBatch(ValueError):
    """Raised after the batch named by abort_after_batch has finished."""
