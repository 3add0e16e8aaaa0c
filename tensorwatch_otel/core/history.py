"""The ring's reach into finished batches: the forward records kept while a ring of `max_frames`
frames can still reach back into them (History), and the ring of frames ending at a detection."""

from __future__ import annotations

from typing import Callable, List, Tuple

from .frame_stats import Frame
from .record import Record


class History:
    """Finished forward records, newest last, kept while the newer ones hold fewer than
    `max_frames` frames: exactly what a ring of `max_frames` frames can reach back into."""

    def __init__(self, max_frames: int):
        self.max_frames = max_frames
        self.records: List[Record] = []

    def keep(self, rec: Record) -> None:
        hist = self.records
        hist.append(rec)
        total = sum(r.frame_count for r in hist)
        while len(hist) > 1 and total - hist[0].frame_count >= self.max_frames:
            total -= hist.pop(0).frame_count

    def ring(self, rec: Record, fi: int, stop: Callable[[Record], bool]) -> Tuple[Frame, ...]:
        """The last max_frames frames ending with frame `fi` of `rec`, oldest first; forward
        rings reach back across batches until `stop(record)` says the buffer started there."""
        n = self.max_frames
        frames = rec.materialize(max(0, fi + 1 - n), fi + 1)
        missing = n - len(frames)
        if rec.phase == "forward":
            for prev in reversed(self.records):
                if missing <= 0 or stop(prev):
                    break
                if prev is not rec:
                    older = prev.materialize(max(0, prev.frame_count - missing))
                    frames = older + frames
                    missing -= len(older)
        return frames
