"""What a detection does to training (`watch(on_detect=...)`): one object per watch, chosen once
from the option by `choose()` and asked by the collaborators at the points where the option
decides, so no other module compares the option's name.

- `Raise` ("raise", the default): a detection raises NonFiniteDetected once every sink has it;
  under torch.distributed every rank stops at a common point (core/fleet.py).
- `Report`: a detection is recorded and training goes on; an optimizer step runs whatever its
  gradients hold, so the step guard's verdict may wait for the next batch's read-back.
- `Skip`: a detection is recorded, and the optimizer step that would consume inf/nan does not
  happen (core/steps/skip.py): a bad step's gradients, or a training forward's (core/steps/poison.py)."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Type

import torch

from ..events import NonFiniteEvent
from .skip import StepSkipper


class OnDetect:
    """The behaviour of one `on_detect` value (subclasses below)."""

    #: the option's value
    name = ""
    #: multi-rank: a detection on one rank stops every rank at a common point
    stops_ranks = False
    #: an optimizer step waits for its gradients' verdict before it runs
    step_waits_for_verdict = True
    #: the step guard runs even with gradients=True (whose backward frames otherwise locate bad
    #: gradients in recorded batches): the verdict is on the gradients the step consumes
    guards_every_step = False

    def skipper(self) -> Optional[StepSkipper]:
        """What makes steps not happen (Skip's), or None."""
        return None

    def after_recorded(self, event: NonFiniteEvent, raise_it: Callable[[], None],
                       spoil_step: Callable[[], None]) -> None:
        """`event` is recorded in every sink: `raise_it()` raises it (flushed first), and
        `spoil_step()` marks the step that would consume this forward's gradients as one to skip."""


class Raise(OnDetect):
    name = "raise"
    stops_ranks = True

    def after_recorded(self, event: NonFiniteEvent, raise_it: Callable[[], None],
                       spoil_step: Callable[[], None]) -> None:
        raise_it()


class Report(OnDetect):
    name = "report"
    step_waits_for_verdict = False


class Skip(OnDetect):
    name = "skip"
    guards_every_step = True

    def skipper(self) -> Optional[StepSkipper]:
        return StepSkipper()

    def after_recorded(self, event: NonFiniteEvent, raise_it: Callable[[], None],
                       spoil_step: Callable[[], None]) -> None:
        if event.phase == "forward" and torch.is_grad_enabled():
            spoil_step()  # the forward cannot be undone, but the step that would consume it can


_BY_NAME: Dict[str, Type[OnDetect]] = {cls.name: cls for cls in (Raise, Report, Skip)}


def choose(name: str) -> OnDetect:
    """The behaviour of `name` (a WatchConfig's on_detect, validated there)."""
    return _BY_NAME[name]()
