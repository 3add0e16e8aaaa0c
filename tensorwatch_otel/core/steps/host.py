"""What the step monitor (core/steps/monitor.py) needs of the rest of its watch (`StepHost`): a
detection raised, events and phase records to the sinks, the batch a step belongs to, and the
weights measured again after a step. The watch's session (core/session.py) is the host.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from ..events import NonFiniteEvent
from ..record import Record


class StepHost(Protocol):
    """What the monitor asks of the rest of its watch, when a step or a backward runs."""

    def detect(self, rec: Record, fi: int, replicated: bool = False, force: Optional[str] = None) -> None:
        """A detection in frame `fi` of `rec` (read back)."""

    def escalate(self, event: NonFiniteEvent, note: str, recorded: bool = True) -> None:
        """Raise a detection on_detect="skip" made."""

    def emit(self, event: Any) -> None:
        """An event to the sinks."""

    def phase_stats(self, rec: Record) -> None:
        """A gradient / optimizer-state record to the metric sinks."""

    def check(self, rec: Record, first_frame: int) -> None:
        """Detect in a record already read back."""

    def last_batch(self) -> int:
        """The batch begun last (the one a step belongs to)."""

    def watches(self, batch: int) -> bool:
        """Batch `batch` is recorded (every_n_batches, trace_batches)."""

    def steps_live(self) -> bool:
        """The watcher is attached, and not replaying a captured batch."""

    def weights_changed(self) -> None:
        """A step wrote the weights: they are measured again."""

    def generation(self) -> int:
        """Bumped when the model's parameters were replaced."""

    def localize(self, rec: Record) -> Optional[NonFiniteEvent]:
        """The forward detection a replay of bad gradients' unsampled batch found and recorded, or
        None (on_detect="skip": the skip then names where the inf/nan was born)."""
