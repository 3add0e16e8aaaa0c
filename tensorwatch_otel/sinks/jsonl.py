"""JsonlLog: one JSON object per event, fsynced on detections before any exception is raised."""

from __future__ import annotations

import os
import threading
from typing import Optional

from ..report.codec import to_line
from ..core.events import AbortAfterBatchEvent, NonFiniteEvent, OverflowCheckEvent, SkipStreakEvent
from ._base import Sink

# fsynced before on_event returns: what may precede an exception that ends the run. A single
# skipped optimizer step is flushed but not fsynced (there can be many).
_DURABLE = (NonFiniteEvent, AbortAfterBatchEvent, OverflowCheckEvent, SkipStreakEvent)


class JsonlLog(Sink):
    """Appends events to `path` (created with its folder). Detections are flushed and fsynced
    before on_event returns, so a process that dies right after loses nothing.

    With several ranks, `{rank}` in the path gives one file per rank (e.g. `events-{rank}.jsonl`).
    """

    def __init__(self, path: str, rank: Optional[int] = None):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"JsonlLog path: expected a file path, got {path!r}")
        self.path = str(path)
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
