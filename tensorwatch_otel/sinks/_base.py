"""The sink port, as the sinks see it: defined in the core (core/ports.py), which never
imports a sink; what every exporter needs of the names it writes (that they encode), and the
skipped-step bookkeeping both metric sinks keep."""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

from ..core.events import map_strings
from ..core.ports import Sink, SinkFanout

__all__ = ["Sink", "SinkFanout", "utf8_text", "utf8_safe", "StepTally", "SamplingTally"]


def utf8_text(text: str) -> str:
    """`text`, with what UTF-8 cannot encode (a lone surrogate, from a module added as
    ``add_module('\\ud800', ...)`` or a dict key) written as its backslash escape (the six
    characters ``\\ud800``): one unencodable label must not fail a whole scrape or export."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _all_ascii(obj: Any) -> bool:
    """Quick look (names are nearly always ASCII): the strings of an event and of its frames."""
    for v in getattr(obj, "__dict__", {}).values():
        if isinstance(v, str):
            if not v.isascii():
                return False
        elif isinstance(v, tuple) and v and hasattr(v[0], "tensors"):  # frames
            for fr in v:
                if not (fr.module.isascii() and fr.module_class.isascii()
                        and all(t.name.isascii() for t in fr.tensors)):
                    return False
        elif isinstance(v, (tuple, list, dict)) and v:
            return False  # anything else: let the full pass decide
    return True


def utf8_safe(obj: Any) -> Any:
    """`obj` (an event, a frame, a tuple of them) with every string through utf8_text; the same
    object when nothing needed it, so the common case allocates nothing."""
    if _all_ascii(obj) and not isinstance(obj, (str, tuple, list, dict)):
        return obj
    return map_strings(obj, utf8_text)


class StepTally:
    """Skipped optimizer steps as both metric sinks count them: SkippedStepEvents seen and the
    core's count in BatchStats, whichever is larger (either may arrive first); streaks
    (SkipStreakEvents), the latest streak length, and the newest loss scale with its rank; the
    steps on_detect="skip" skipped (SkippedNonFiniteStepEvents), counted apart."""

    __slots__ = ("events", "core", "exported", "streaks", "streak", "scale_time", "scale", "rank", "nonfinite")

    def __init__(self, rank: int):
        self.events = 0
        self.core = 0
        self.exported = 0  # skips a delta counter has already added
        self.streaks = 0
        self.streak: Optional[Tuple[int, int]] = None  # (length, rank) of the latest skip reported
        self.scale_time = -math.inf
        self.scale: Optional[float] = None
        self.rank = rank
        self.nonfinite = 0

    @property
    def skipped(self) -> int:
        return max(self.events, self.core)

    def take_new(self) -> int:
        """Skips not yet added to a delta counter (and marks them added)."""
        n = self.skipped - self.exported
        if n > 0:
            self.exported += n
        return max(n, 0)

    def on_batch(self, stats) -> bool:
        """True when the core's count grew."""
        if stats.grad_scale is not None:
            self.set_scale(stats.time, stats.grad_scale, stats.rank)
        if stats.steps_skipped > self.core:
            self.core = stats.steps_skipped
            return True
        return False

    def on_skip(self, event, streak_event: bool) -> None:
        """A SkippedStepEvent (streak_event False) or a SkipStreakEvent."""
        if streak_event:
            self.streaks += 1
        else:
            self.events += 1
        self.streak = (event.streak, event.rank)
        self.set_scale(event.time, event.scale, event.rank)

    def set_scale(self, t: float, scale: Optional[float], rank: int) -> None:
        if scale is not None and t >= self.scale_time:
            self.scale_time, self.scale, self.rank = t, float(scale), rank


class SamplingTally:
    """The sampling interval and the watcher's measured share of the step (max_overhead); both
    metric sinks export these two gauges. The interval is the newest one told, by batch number:
    a measured batch's BatchStats, or a SamplingRateEvent (the budget changes the interval when a
    measured batch ends, so up to `every_n_batches` batches before the next measured one would
    carry it); the share is the latest measured batch's."""

    __slots__ = ("every_n_batches", "overhead", "_as_of")

    def __init__(self) -> None:
        self.every_n_batches: Optional[int] = None
        self.overhead: Optional[float] = None
        self._as_of = -1  # the batch the interval was told for

    def on_batch(self, stats) -> None:
        if stats.every_n_batches is not None and stats.batch_number >= self._as_of:
            self.every_n_batches, self._as_of = stats.every_n_batches, stats.batch_number
        if stats.overhead is not None:
            self.overhead = stats.overhead

    def on_rate(self, event) -> None:
        """A SamplingRateEvent: the interval from its batch on."""
        if event.batch_number >= self._as_of:
            self.every_n_batches, self._as_of = event.every_n_batches, event.batch_number
