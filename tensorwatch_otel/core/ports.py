"""The sink port: what every sink implements, and the dispatcher that keeps sink failures
away from the training step (logged once, counted, never raised unless strict)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Sequence, Set

from .events import Event
from .frame_stats import BatchStats

log = logging.getLogger(__name__)


class Sink:
    """Base class for sinks. Every method is optional; all run on the training thread, so
    anything slow (network, disk beyond a line) belongs on the sink's own thread.

    - ``on_batch(stats)``: once per watched batch, after its statistics came back. Keep a
      reference and return; materialise ``stats.rows()`` lazily (e.g. at scrape time).
    - ``on_event(event)``: detections, traced batches, aborts, overflow checks, skips. By
      default it calls ``handle_<event type>(event)`` (``handle_nonfinite_detected``,
      ``handle_batch_trace``, ...: the JSON lines ``event`` names) when the sink defines it, so
      a sink handles the types it cares about and a new type needs no edit elsewhere. For a
      detection that will raise, the event must be durable when this returns (or after
      ``flush``).
    - ``flush(timeout_s)``: push out what is buffered, bounded in time.
    - ``close()``: release threads, files, ports. Idempotent.
    """

    #: False lets the watcher skip building BatchStats when no sink wants them.
    wants_batches: bool = False

    def on_batch(self, stats: BatchStats) -> None:
        pass

    def on_event(self, event: Event) -> None:
        handle = getattr(self, "handle_" + event.event, None)
        if handle is not None:
            handle(event)

    def flush(self, timeout_s: float = 5.0) -> None:
        pass

    def close(self) -> None:
        pass


class SinkFanout:
    """Calls each sink, catching and logging (once per sink and method) what it raises."""

    def __init__(self, sinks: Sequence[Sink], strict: bool = False):
        self.sinks: List[Sink] = list(sinks)
        self.strict = strict
        self.failures: Dict[str, int] = {}
        self._logged: Set[str] = set()
        self._lock = threading.Lock()
        self.wants_batches = any(getattr(s, "wants_batches", False) for s in self.sinks)

    def _call(self, sink: Sink, method: str, *args: Any) -> None:
        try:
            getattr(sink, method)(*args)
        except Exception as exc:  # a sink must never break training
            if self.strict:
                raise
            key = f"{type(sink).__name__}.{method}"
            with self._lock:
                self.failures[key] = self.failures.get(key, 0) + 1
                first = key not in self._logged
                self._logged.add(key)
            if first:
                log.error("tensorwatch_otel: sink %s failed (%s: %s); training goes on, "
                          "further failures of it are counted, not logged", key, type(exc).__name__, exc)

    def on_batch(self, stats: BatchStats) -> None:
        for s in self.sinks:
            if getattr(s, "wants_batches", False):
                self._call(s, "on_batch", stats)

    def on_event(self, event: Event) -> None:
        for s in self.sinks:
            self._call(s, "on_event", event)

    def flush(self, timeout_s: float = 5.0) -> None:
        for s in self.sinks:
            self._call(s, "flush", timeout_s)

    def close(self) -> None:
        for s in self.sinks:
            self._call(s, "close")
