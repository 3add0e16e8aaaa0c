"""The step guard as the step monitor runs it (`StepCheck`): its one read of the gradients a step
is about to consume, now, or launched on the device and its verdict read with the next batch's
read-back (`settle`), its flag lent to a fused optimizer as `found_inf` for that step and taken
back after it. A bad gradient is a detection, raised through the monitor's host.
"""

from __future__ import annotations

import logging
import weakref
from typing import Optional, Tuple

import torch

from ..fleet import FleetStop
from ..record import Record
from .guard import LaunchedCheck, StepGuard
from .host import StepHost
from .on_detect import OnDetect

log = logging.getLogger(__name__)


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """A torch optimizer whose fused step reads `found_inf` and writes nothing when it is 1.0."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and \
        all(g.get("fused") for g in optimizer.param_groups)


class StepCheck:
    """See the module docstring. `use(guard)` gives it the step guard (None: no guard); a guard
    that fails goes off, said once."""

    def __init__(self, host: StepHost, fleet: FleetStop, *, on_detect: OnDetect, captures: bool) -> None:
        self._host = host
        self._fleet = fleet
        self._on_detect = on_detect
        self._captures = captures  # capture_dir: a detection writes its batch's inputs, held until the next batch
        self._guard: Optional[StepGuard] = None
        # the step guard's check launched without a read, and replicated: read with the next batch
        self._deferred: Optional[Tuple[LaunchedCheck, bool]] = None
        # its flag, set as an optimizer's found_inf for its step (and that optimizer)
        self._handed: Optional[Tuple["weakref.ref[torch.optim.Optimizer]", torch.Tensor]] = None

    def use(self, guard: Optional[StepGuard]) -> None:
        self._guard = guard

    @property
    def on(self) -> bool:
        """A step guard is in use (and has not failed)."""
        return self._guard is not None

    def defer(self, optimizer: torch.optim.Optimizer, batch: int) -> bool:
        """The step guard without a host read, where its verdict can wait for the next batch's
        read-back (`settle`): on the device path (StepGuard.launch), when the step may run
        before the verdict is known, because on_detect="report" lets it run whatever its
        gradients hold, or because the optimizer is fused and takes the guard's device flag as
        its `found_inf` (as from a GradScaler): it then writes nothing when a gradient holds
        inf/nan, and on_detect="raise" raises with the next read-back, the weights untouched.
        False where the guard reads now: another optimizer, a sharded model (the ranks agree at
        the step), gradients the device path does not take, and where a detection needs the
        batch's inputs, which the next batch lets go: an unrecorded batch (its detection is
        localized by a replay of them) or `capture_dir` (they are written to a file)."""
        hand = self._on_detect.step_waits_for_verdict  # (report lets the step run whatever its gradients hold)
        if hand and not _takes_found_inf(optimizer):
            return False
        if self._captures or not self._host.watches(batch):
            return False
        if self._fleet.gradients_sharded(self._host.generation()):
            return False
        self.settle()  # a check still pending (a second optimizer in the batch): its read now
        guard = self._guard
        if guard is None:  # (settle's failure turned it off)
            return False
        try:
            launched = guard.launch(optimizer, batch)
        except Exception as exc:  # the guard must not stop training: the read below instead
            log.warning("tensorwatch_otel: the optimizer-step check on the device failed (%s: %s); it reads "
                        "the gradients instead", type(exc).__name__, exc)
            return False
        if launched is None:
            return False
        if hand:
            optimizer.found_inf = launched.flag  # type: ignore[attr-defined]  # read by the fused step, as a GradScaler sets it
            self._handed = (weakref.ref(optimizer), launched.flag)
        self._deferred = (launched, self._fleet.gradients_replicated())
        return True

    def take_back(self) -> None:
        """The guard's flag off the optimizer it was handed to (after its step; before the next
        step when that one raised; at detach), unless it holds another's now."""
        handed, self._handed = self._handed, None
        if handed is None:
            return
        optimizer = handed[0]()
        if optimizer is not None and getattr(optimizer, "found_inf", None) is handed[1]:
            delattr(optimizer, "found_inf")

    def settle(self) -> None:
        """The deferred step check's verdict (see defer), read with the batch just read
        back (its gradients' slots came to the host in that one copy; else this is the read):
        a detection at the first bad gradient, in that step's batch. Called at every batch end
        and at detach."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        check, replicated = deferred
        try:
            found = check.verdict()
        except Exception as exc:  # the guard must not stop training: it goes off, said once
            self._guard = None
            log.error("tensorwatch_otel: the optimizer-step gradient check failed (%s: %s); training goes on "
                      "without it", type(exc).__name__, exc)
            return
        if found is not None:
            self._host.detect(found[0], found[1], replicated=replicated)

    def check_now(self, optimizer: torch.optim.Optimizer, batch: int) -> None:
        """The step guard: one read; a detection named at the first bad gradient."""
        found = self.read(optimizer, batch)
        if found is not None:
            self._host.detect(found[0], found[1], replicated=self._fleet.gradients_replicated())

    def read(self, optimizer: torch.optim.Optimizer, batch: int) -> Optional[Tuple[Record, int]]:
        """The step guard's one read: the record and frame of the first bad gradient, or None."""
        guard = self._guard
        assert guard is not None
        try:
            rec = guard.check(optimizer, batch)
            fi = rec.first_nonfinite_frame(0) if rec is not None else None
        except Exception as exc:  # the guard must not stop training: it goes off, said once
            self._guard = None
            log.error("tensorwatch_otel: the optimizer-step gradient check failed (%s: %s); training goes on "
                      "without it", type(exc).__name__, exc)
            return None
        return (rec, fi) if rec is not None and fi is not None else None
