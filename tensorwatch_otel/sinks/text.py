"""TextReport: the detection report and batch traces in the peer's text format."""

from __future__ import annotations

import sys
from typing import Optional, TextIO

from ..core.events import (BatchTraceEvent, NonFiniteEvent, SkippedNonFiniteStepEvent, SkipStreakEvent,
                           StoppedByRankEvent)
from ..report.text import render_detection, render_trace, skipped_line, stopped_line, summary_line
from ._base import Sink


class TextReport(Sink):
    """Writes reports to `stream` (default: sys.stdout at the time of writing).

    The first detection prints the full report; later ones (on_detect="report") one line each.
    Traced batches print on rank 0 only unless `all_ranks=True`; detections print on the rank
    that found them. A streak of skipped optimizer steps prints one line (single skips do not);
    a step on_detect="skip" skipped prints one line each.
    """

    def __init__(self, stream: Optional[TextIO] = None, all_ranks: bool = False):
        self.stream = stream
        self.all_ranks = all_ranks
        self._reports = 0

    def _write(self, text: str) -> None:
        out = self.stream if self.stream is not None else sys.stdout
        out.write(text)
        out.flush()

    # the event types it prints (Sink.on_event calls handle_<event type>)
    def handle_nonfinite_detected(self, event: NonFiniteEvent) -> None:
        self._reports += 1
        self._write(render_detection(event) if self._reports == 1 else summary_line(event))

    def handle_stopped_by_rank(self, event: StoppedByRankEvent) -> None:
        self._write(stopped_line(event))

    def handle_batch_trace(self, event: BatchTraceEvent) -> None:
        if self.all_ranks or event.rank == 0:
            self._write(render_trace(event))

    def handle_skipped_steps_streak(self, event: SkipStreakEvent) -> None:
        self._write(streak_line(event))

    def handle_skipped_nonfinite_step(self, event: SkippedNonFiniteStepEvent) -> None:
        self._write(skipped_line(event))


def streak_line(event: SkipStreakEvent) -> str:
    scale = "" if event.scale is None else f", loss scale now {event.scale:g}"
    return (f"tensorwatch: {event.streak} optimizer steps in a row skipped (inf/nan gradients) up to "
            f"batch_number={event.batch_number} on rank {event.rank}{scale}\n")
