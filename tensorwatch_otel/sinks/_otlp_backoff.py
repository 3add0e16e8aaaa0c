"""After a failed OTLP span export the next ones wait (5 s, doubling to 60 s): batches meanwhile are
dropped before they are encoded or sent, so a collector that is down or hangs costs no CPU.

Spans only: the span processor hands the exporter a full batch as soon as the last attempt
ended, and each batch is encoded (by the gRPC exporter again at every retry) for a collector
that takes none. The metric reader is held by a failing export for the exporter's timeout,
which already spaces its collections out."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

#: The wait after the first failed export; it doubles with each failure in a row, up to BACKOFF_MAX_S.
BACKOFF_FIRST_S = 5.0
BACKOFF_MAX_S = 60.0


class ExportBackoff:
    """Whether an export may go out now. Each failure in a row doubles the wait; a success ends it."""

    def __init__(self, signal: str, first_s: Optional[float] = None, max_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.signal = signal
        self._first_s = BACKOFF_FIRST_S if first_s is None else first_s
        self._max_s = BACKOFF_MAX_S if max_s is None else max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._until = -math.inf
        self.dropped = 0  # batches not exported while waiting

    def waiting(self) -> bool:
        """True while a wait after a failed export is under way."""
        return self._clock() < self._until

    def drop(self) -> None:
        """A batch was dropped while waiting."""
        with self._lock:
            self.dropped += 1

    def record(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self._failures, self._until = 0, -math.inf
                return
            self._failures += 1
            wait = min(self._first_s * 2 ** (self._failures - 1), self._max_s)
            self._until = self._clock() + wait
            dropped = self.dropped
        # the SDK has logged the failure itself (at most once per kind every 5 minutes)
        log.debug("tensorwatch_otel: OTLP %s export failed; the next exports wait %.0f s (%d batches "
                  "dropped so far)", self.signal, wait, dropped)
