"""Why a step is skipped (on_detect="skip"): the place where the values went bad, and what a
raise instead of the skip would carry (`BadStep`), as the step monitor's verdict
(core/steps/monitor.py) finds it.
"""

from __future__ import annotations

from typing import Optional

from ..events import NonFiniteEvent
from ..record import Record


class BadStep:
    """What makes a step one to skip (on_detect="skip"): the place, and what a raise would carry
    (the record and frame of a gradient check, or the forward's detection event)."""

    __slots__ = ("batch", "module", "module_class", "tensor", "kind", "phase", "rec", "frame", "event")

    def __init__(self, batch: int, module: str = "", module_class: str = "", tensor: str = "", kind: str = "",
                 phase: str = "backward", rec: Optional[Record] = None, frame: int = 0,
                 event: Optional[NonFiniteEvent] = None) -> None:
        self.batch, self.module, self.module_class, self.tensor, self.kind = batch, module, module_class, tensor, kind
        self.phase, self.rec, self.frame, self.event = phase, rec, frame, event

    @classmethod
    def of_record(cls, rec: Record, fi: int) -> "BadStep":
        frame = rec.materialize(fi, fi + 1)[0]
        first = frame.first_nonfinite()
        return cls(rec.batch_number, frame.module, frame.module_class, first.name if first else "",
                   first.kind if first else frame.kind, rec.phase, rec, fi)

    @classmethod
    def of_event(cls, event: NonFiniteEvent) -> "BadStep":
        return cls(event.batch_number, event.module, event.module_class, event.tensor, event.kind, "forward",
                   event=event)
