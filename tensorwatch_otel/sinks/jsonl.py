"""JsonlLog: one JSON object per event, fsynced on detections before any exception is raised."""

from __future__ import annotations

import os
import threading
from typing import Optional

from ..report.codec import to_line
from ..core.events import (AbortAfterBatchEvent, NonFiniteEvent, OverflowCheckEvent, SkipStreakEvent,
                           StoppedByRankEvent)
from ..core.config import folder_problem
from ..core.rank import current_rank
from ._base import Sink, utf8_safe

# fsynced before on_event returns: what may precede an exception that ends the run. A single
# skipped optimizer step is flushed but not fsynced (there can be many).
_DURABLE = (NonFiniteEvent, AbortAfterBatchEvent, OverflowCheckEvent, StoppedByRankEvent, SkipStreakEvent)


def _check_writable(path: str) -> None:
    """ValueError naming `path` unless a file can be appended there: not a directory, and the
    nearest existing folder on the way takes a new file (tried, so root and read-only mounts
    are judged right). Checked once at construction; later failures are sink failures."""
    def bad(why: str) -> ValueError:
        return ValueError(f"JsonlLog path={path!r}: {why}; expected a file path such as 'run/events.jsonl'")

    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise bad("is a directory")
    if os.path.exists(path):
        if os.path.isfile(path) and not os.access(path, os.W_OK):
            raise bad("the file is not writable")
        return
    why = folder_problem(os.path.dirname(os.path.abspath(path)))
    if why is not None:
        raise bad(why)


class JsonlLog(Sink):
    """Appends events to `path` (created with its folder). Detections are flushed and fsynced
    before on_event returns, so a process that dies right after loses nothing.

    A path that is a directory, or whose folder cannot take a new file, raises ValueError here
    rather than failing at the first event.

    With several ranks, `{rank}` in the path gives one file per rank (e.g. `events-{rank}.jsonl`).
    """

    def __init__(self, path: str, rank: Optional[int] = None):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"JsonlLog path: expected a file path, got {path!r}")
        self.path = os.fspath(path)
        _check_writable(self.path.replace("{rank}", str(current_rank() if rank is None else rank)))
        self._rank = rank
        self._file = None
        self._lock = threading.Lock()

    def _open(self, rank: int):
        if self._file is None:
            path = self.path.replace("{rank}", str(rank))
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
        return self._file

    def on_event(self, event) -> None:
        line = to_line(event)
        if "\\ud" in line:  # a surrogate escape: a lone one (unencodable name) is written as text
            line = to_line(utf8_safe(event))
        with self._lock:
            f = self._open(self._rank if self._rank is not None else event.rank)
            f.write(line)
            f.flush()
            if isinstance(event, _DURABLE):
                os.fsync(f.fileno())

    def flush(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                finally:
                    self._file = None
