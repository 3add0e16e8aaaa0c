"""How a watcher words and scopes what it sees: a small strategy object. The default is
tensorwatch_otel's own; integrations/debug_utils.py passes the transformers.debug_utils one."""

from __future__ import annotations

from typing import AbstractSet, Any, Dict, Tuple

from ..events import NonFiniteEvent
from ..frame_draft import ModuleInfo
from ..record import Record
from ..frames.recorder import FrameRecorder


class Behaviour:
    """tensorwatch_otel's behaviour: every input and output value is walked, traced batches
    are checked too, each outermost watched call is a batch, exceptions name the place."""

    #: traced batches are checked for inf/nan like any other
    detect_in_traced_batches = True
    #: a module called outside the root's forward ends a batch when the outermost call ends
    outermost_call_ends_batch = True

    def record(self, recorder: FrameRecorder, rec: Record, info: ModuleInfo, args: Tuple[Any, ...],
               kwargs: Dict[str, Any], output: Any) -> None:
        recorder.frame(rec, info, args, kwargs, output)

    def ring_stops_at(self, rec: Record, trace_batches: AbstractSet[int]) -> bool:
        """True when a detection ring must not reach into the finished record `rec`."""
        return False

    def detection_message(self, event: NonFiniteEvent) -> str:
        where = event.module or "(root)"
        return (f"tensorwatch_otel: {event.kind} in {where} ({event.module_class}) {event.tensor} during "
                f"batch_number={event.batch_number}; the report above shows the frames that led to it"
                + (f" (seen there; where it was born is uncertain: {event.uncertain})" if event.uncertain else ""))

    def abort_message(self, batches_done: int, abort_after_batch: int) -> str:
        return (f"tensorwatch_otel: aborting after {batches_done} batches due to "
                f"abort_after_batch={abort_after_batch}")
