"""Skipped steps: a step that does not happen while the gradients hold inf/nan (a GradScaler
skip, or gradients reset without a step) is counted, reported, and an alert of its own when
`max_skipped_steps` come in a row. The GradScaler's scale is read with the batch's statistics;
its `step` is watched so a skip is told at once."""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, List, Optional, Union

import torch

from ..events import SkippedNonFiniteStepEvent, SkippedStepEvent, SkipStreakEvent
from ..frame_stats import merge_kinds
from .guard import PendingGradients

SkipEvent = Union[SkippedStepEvent, SkipStreakEvent]

log = logging.getLogger(__name__)


class ScaleReader:
    """The GradScaler's scale, read with the batch's statistics (no sync of its own). A drop
    of the scale between two batches is a skipped step when gradients are not watched."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        # the scaler makes its scale tensor at the first scale(): until then it is init_scale
        init = getattr(scaler, "_init_scale", None)
        self.last: Optional[float] = float(init) if getattr(scaler, "_scale", None) is None and init else None

    def tensor(self) -> Optional[torch.Tensor]:
        s = getattr(self.scaler, "_scale", None)
        if isinstance(s, torch.Tensor) and s.numel() == 1:
            return s.reshape(())
        return None

    def dropped_since_read(self) -> bool:
        """The scale is lower now than at the last batch read (one host read: call only when
        bad gradients are pending)."""
        t = self.tensor()
        if t is None or self.last is None:
            return False
        now = float(t)
        if now < self.last:
            self.last = now
            return True
        return False

    def update(self, value: Optional[float]) -> int:
        """Record the latest scale; the number of skips its drop says (0 or 1)."""
        prev, self.last = self.last, value
        if prev is not None and value is not None and value < prev:
            return 1
        return 0


class ScalerSkips:
    """A GradScaler's `step`, watched: a call that returns without the optimizer's step having
    run (the scaler found inf/nan in the scaled gradients and skipped it) is told to
    `on_skip(optimizer)` at once, while the batch's inputs are still held (the scale's drop is
    only seen at the next batch's read, after they have gone). The scaler's `step` is an
    instance attribute while watched (put back by `remove()`, as core/steps/skip.py's gate)."""

    def __init__(self, scaler: Any, steps_begun: Callable[[], int], on_skip: Callable[[Any], None]) -> None:
        self._ref = weakref.ref(scaler)
        self._previous = scaler.__dict__.get("step")  # None: the class's
        inner = self._previous if self._previous is not None else type(scaler).step.__get__(scaler)

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = steps_begun()
            out = inner(optimizer, *args, **kwargs)
            if steps_begun() == before:  # the optimizer's step did not run: the scaler's skip
                on_skip(optimizer)
            return out

        self._step: Optional[Callable[..., Any]] = step
        try:
            vars(scaler)["step"] = step
        except Exception as exc:  # a scaler that takes no attribute: its skips are seen at the next read
            self._step = None
            log.debug("tensorwatch_otel: cannot watch %s.step: %s", type(scaler).__name__, exc)

    def remove(self) -> None:
        """The scaler's own `step` back (unless someone wrapped ours since: then it passes through)."""
        scaler = self._ref()
        if scaler is None or self._step is None or scaler.__dict__.get("step") is not self._step:
            return
        if self._previous is None:
            del scaler.step
        else:
            vars(scaler)["step"] = self._previous
        self._step = None


class SkipCounter:
    """Skipped steps: the total, the streak, and the events they make; apart from them the steps
    the watcher itself skipped (on_detect="skip"), with their own total and streak."""

    def __init__(self, max_streak: int) -> None:
        self.max_streak = max_streak
        self.total = 0
        self.streak = 0
        self.nonfinite_total = 0
        self.nonfinite_streak = 0

    def step_taken(self) -> None:
        self.streak = 0
        self.nonfinite_streak = 0

    def skipped_nonfinite(self, batch: int, rank: int, module: str, module_class: str, tensor: str, kind: str,
                          phase: str) -> SkippedNonFiniteStepEvent:
        """A step the watcher did not let run (on_detect="skip")."""
        self.nonfinite_total += 1
        self.nonfinite_streak += 1
        return SkippedNonFiniteStepEvent(batch, rank, module, module_class, tensor, kind, time.time(),
                                         self.nonfinite_streak, phase)

    def skipped(self, pending: Optional[PendingGradients], batch: int, rank: int,
                scale: Optional[float]) -> List[SkipEvent]:
        self.total += 1
        self.streak += 1
        module = module_class = tensor = kind = ""
        if pending is not None:
            frame = pending.record.materialize(pending.frame, pending.frame + 1)[0]
            first = frame.first_nonfinite()
            module, module_class, kind = frame.module, frame.module_class, merge_kinds(frame.kind)
            tensor = first.name if first else ""
            batch = pending.record.batch_number
        now = time.time()
        events: List[SkipEvent] = [
            SkippedStepEvent(batch, rank, self.streak, scale, module, module_class, tensor, kind, now)]
        if self.streak == self.max_streak:
            log.warning("tensorwatch_otel: %d optimizer steps in a row were skipped (non-finite gradients%s): "
                        "the loss scale is collapsing or every step overflows", self.streak,
                        f", loss scale {scale:g}" if scale is not None else "")
            events.append(SkipStreakEvent(batch, rank, self.streak, scale, now))
        return events
