"""Stop every rank together: under torch.distributed a detection is published in the default
process group's store, and every rank raises at the same safe point, after the step's collectives.

Why: a rank that raises in the middle of a step leaves the others blocked in the step's next
collective (a DDP gradient all-reduce, an FSDP all-gather) until the collective timeout, with an
error that says nothing about the inf. So under torch.distributed (world size > 1, on_detect
"raise") the detecting rank records its detection (sinks, durable), publishes it with one
compare-and-set on the store key `tensorwatch_otel/fleet_stop`, and keeps taking part in the
step. Every rank then raises at the first safe point at or after the *target batch*:

- the optimizer step that would consume the values of a batch >= target (the watcher's global
  optimizer-step pre-hook, for any optimizer holding the model's parameters), or
- the start of a batch > target (loops without a `torch.optim` step: evaluation, a GradScaler
  that skipped the step, hand-written updates).

The target is the detection's batch for a forward detection (the step's backward collectives
come after the publish, so every rank has seen it by the step's optimizer call), and the next
batch for a detection made after them (gradients, optimizer state). Every rank derives the same
stop point from the published record, so nobody is left alone in a collective.

Cost when nothing happened: one store `check` per optimizer step, or per batch start when no
optimizer step ran since the last one (a round trip to the store's server); no collective.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Callable, Optional

import torch

from .errors import NonFiniteDetected
from .events import NonFiniteEvent, StoppedByRankEvent
from .rank import current_rank

log = logging.getLogger(__name__)

#: the store key a detection is published under (one per process group: the run is over once set)
STORE_KEY = "tensorwatch_otel/fleet_stop"


def _dist():
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def stopped_message(event: StoppedByRankEvent) -> str:
    where = event.module or "(root)"
    return (f"tensorwatch_otel: rank {event.rank} stopped because rank {event.first_rank} detected "
            f"{event.kind} in {where} ({event.module_class}) {event.tensor} during "
            f"batch_number={event.batch_number}; see rank {event.first_rank}'s report")


class FleetStop:
    """One watcher's part in stopping the ranks together.

    `emit(event)` records an event durably (the watcher's sinks, flushed); `batch_number()` is
    the watcher's batch counter. With `stops=False` (on_detect="report") detections are still
    published, for their first_rank, but nothing is checked per batch and nobody stops.
    """

    def __init__(self, emit: Callable[[object], None], batch_number: Callable[[], int], stops: bool = True):
        self._emit = emit
        self._batch_number = batch_number
        self._pending: Optional[NonFiniteDetected] = None  # own detection, raised at the stop point
        self._first: Optional[dict] = None  # the published record (first rank's), once known
        self._done = False  # this watcher has raised its stop
        self._stops = stops
        self._failed = False  # the store failed once: back to raising at once
        self._stepped = False  # an optimizer step was polled since the last batch start
        self.polls = 0  # store checks made (for tests and measurements)

    # ------------------------------------------------------------------ the detecting rank
    def active(self) -> bool:
        """Detections are published: a multi-rank run with a usable store."""
        return not self._failed and not self._done and _dist() is not None

    def publish(self, event: NonFiniteEvent) -> NonFiniteEvent:
        """Publish this rank's detection; `event` with first_rank set (the first to publish wins).
        Returns `event` unchanged when the store cannot be used (the caller raises at once)."""
        if self._first is not None:  # a later detection of this rank, or one after another rank's
            return _with_first(event, self._first["rank"])
        # where the frames came from: a gradient record's frames say "backward"
        phase = event.frames[-1].phase if event.phase == "forward" and event.frames else event.phase
        mine = {"rank": event.rank, "batch_number": event.batch_number, "phase": phase,
                "module": event.module, "module_class": event.module_class, "tensor": event.tensor,
                "kind": event.kind, "time": event.time}
        payload = json.dumps(mine, separators=(",", ":"))
        try:
            got = _store().compare_set(STORE_KEY, "", payload)
            self._first = mine if got == payload.encode() else json.loads(got)
        except Exception as exc:  # no usable store: this rank stops alone, as without a fleet
            self._store_failed(exc)
            return event
        return _with_first(event, self._first["rank"])

    def defer(self, exc: NonFiniteDetected) -> bool:
        """Hold `exc` until the stop point; False when it must be raised now."""
        if self._first is None or self._failed or not self._stops:
            return False
        if self._pending is None:
            self._pending = exc
        return True

    # ------------------------------------------------------------------ safe points
    def at_optimizer_step(self) -> None:
        """Before an optimizer step: the batch whose values it consumes is batch_number - 1."""
        self._stepped = True
        self._at_safe_point(max(self._batch_number() - 1, 0), 0)

    def at_batch_start(self) -> None:
        """Before the root's outermost forward; polls only when no optimizer step polled since
        the last batch start (a step poll would have seen every stop this one could)."""
        stepped, self._stepped = self._stepped, False
        if stepped and self._first is None:
            return
        self._at_safe_point(self._batch_number(), 1)

    def at_exit(self) -> None:
        """The watcher's with-block ended: a detection still held is raised now, and so is a
        stop another rank published (the loop ended before its stop point)."""
        if self._done or not self._stops:
            return
        if self._pending is not None:
            self._raise(self._pending)
        if self._first is not None or (not self._failed and _dist() is not None and self._poll() is not None):
            self._stop(self._first, self._batch_number())

    def _at_safe_point(self, batch: int, after: int) -> None:
        if self._done or self._failed or not self._stops:
            return
        first = self._first
        if first is None:
            if _dist() is None:
                return
            first = self._poll()
            if first is None:
                return
        target = first["batch_number"] + (0 if first.get("phase", "forward") == "forward" else 1)
        if batch < target + after:
            return
        if self._pending is not None:
            self._raise(self._pending)
        self._stop(first, batch)

    def _stop(self, first: dict, batch: int) -> None:
        """Raise the stop another rank published, after recording it."""
        event = StoppedByRankEvent(
            batch_number=first["batch_number"], rank=current_rank(), first_rank=first["rank"],
            module=first["module"], module_class=first["module_class"], tensor=first["tensor"],
            kind=first["kind"], time=time.time(), stopped_at_batch=batch)
        self._emit(event)
        self._raise(NonFiniteDetected(stopped_message(event), event))

    def _poll(self) -> Optional[dict]:
        self.polls += 1
        try:
            store = _store()
            if not store.check([STORE_KEY]):
                return None
            self._first = json.loads(store.get(STORE_KEY))
        except Exception as exc:
            self._store_failed(exc)
            return None
        return self._first

    def _raise(self, exc: NonFiniteDetected) -> None:
        self._done = True
        self._pending = None
        raise exc

    def _store_failed(self, exc: Exception) -> None:
        self._failed = True
        log.error("tensorwatch_otel: the process group's store failed (%s: %s); ranks are no longer "
                  "stopped together, a detection raises on its own rank at once", type(exc).__name__, exc)


def _store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _with_first(event: NonFiniteEvent, first_rank: int) -> NonFiniteEvent:
    return dataclasses.replace(event, first_rank=first_rank)
