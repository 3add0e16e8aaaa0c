"""The step monitor: what happens between a backward and the next forward, for one watcher.

It owns the optimizer-step state of a watcher: non-finite gradients no step has consumed yet
(`gradients=True`), the loss scale read with each batch (a GradScaler's skips), the skip count
and streak, the step guard (the gradients a step is about to consume, in one read) and the
optimizer-state reader. The watcher calls it at an outermost call, at a batch end, at the end of
a gradient backward, before and after every optimizer step that concerns its model, and at
detach; it calls the watcher back (`StepHost`) to raise a detection, hand events and phase
records to the sinks, and drop the weight cache when a step changed the weights.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .backward import producer_frame
from .fleet import FleetStop
from .rank import current_rank
from .record import Record
from .steps import PendingGradients, ScaleReader, SkipCounter, StepGuard

log = logging.getLogger(__name__)


class StepHost:
    """What the monitor needs of its watcher, as plain callables (no back reference)."""

    __slots__ = ("detect", "emit", "phase_stats", "check", "last_batch", "watches", "live", "weights_changed")

    def __init__(self, *, detect: Callable[..., None], emit: Callable[[Any], None],
                 phase_stats: Callable[[Record], None], check: Callable[[Record, int], None],
                 last_batch: Callable[[], int], watches: Callable[[int], bool], live: Callable[[], bool],
                 weights_changed: Callable[[], None]):
        self.detect = detect  # (record, frame index, replicated=False): a detection
        self.emit = emit  # an event to the sinks
        self.phase_stats = phase_stats  # a gradient / optimizer-state record to the metric sinks
        self.check = check  # (record, first frame): detect in a record already read back
        self.last_batch = last_batch  # the batch begun last (the one a step belongs to)
        self.watches = watches  # batch number -> recorded (every_n_batches, trace_batches)
        self.live = live  # attached, and not replaying a captured batch
        self.weights_changed = weights_changed  # a step wrote the weights: measure them again


class StepMonitor:
    def __init__(self, host: StepHost, fleet: FleetStop, grad_scaler: Any = None, max_skipped_steps: int = 20,
                 gradients: bool = False) -> None:
        self._host = host
        self._fleet = fleet
        self._gradients = gradients
        self._scale = ScaleReader(grad_scaler) if grad_scaler is not None else None
        self._pending: Optional[PendingGradients] = None  # non-finite gradients no step consumed yet
        self._skipping_step = False  # a fused optimizer's step that skips itself (GradScaler's found_inf)
        self._skips = SkipCounter(max_skipped_steps)
        self._guard: Optional[StepGuard] = None
        self._optim_state: Any = None  # OptimizerStateReader with optimizer_state=True

    def use(self, guard: Optional[StepGuard], optim_state: Any) -> None:
        """The step guard and the optimizer-state reader (made where the hooks are placed)."""
        self._guard = guard
        self._optim_state = optim_state

    @property
    def steps_skipped(self) -> int:
        return self._skips.total

    # ---------------------------------------------------------------- forward side
    def at_outermost_call(self) -> None:
        """Bad gradients reset (or the scaler backed off) without a step since the backward: a
        skip (one host read, only while bad gradients are pending)."""
        pending = self._pending
        if pending is not None and (pending.was_reset() or (
                self._scale is not None and self._scale.dropped_since_read())):
            self.skipped()

    def scale_tensor(self) -> Optional[torch.Tensor]:
        """The loss scale as a 0-d tensor, to travel in the batch's read-back (None: no scaler, or
        no scale tensor yet)."""
        return self._scale.tensor() if self._scale is not None else None

    def batch_scale(self, batch: int, value: Optional[float]) -> Optional[float]:
        """The scale read with batch `batch`: a drop is the skip of the step after batch - 1 (the
        batch whose gradients it would have consumed, as gradients=True numbers it). Returns the
        scale to report (the scaler's init_scale before its first scale())."""
        if self._scale is None:
            return value
        if value is not None and self._scale.update(value) and not self._gradients:
            self.skipped(max(batch - 1, 0))
        return value if value is not None else self._scale.last

    # ---------------------------------------------------------------- backward
    def backward_done(self, rec: Record, owners: List[Optional[torch.Tensor]], gids: List[int]) -> None:
        """A gradient backward ended (`gradients=True`): its record to the sinks; bad gradients
        are held until a step consumes them (a detection) or they go without one (a skip)."""
        rec.readback()
        self._host.phase_stats(rec)
        fi = rec.first_nonfinite_frame(0)
        if fi is not None:
            j = producer_frame(rec, fi, gids)
            if j != fi:  # one gradient, two names: keep the producer's frame only
                rec.drop_frame(fi)
                del owners[fi]
                fi = j - 1
        if self._pending is not None and (fi is None or self._pending.was_reset(by_version=False)):
            self.skipped()  # the bad gradients were reset (set to None, or finite now): no step took them
        if fi is None:
            return
        self._pending = PendingGradients(rec, fi, [p for p in owners[fi:] if p is not None][:1])

    # ---------------------------------------------------------------- optimizer steps
    def before_step(self, optimizer: torch.optim.Optimizer, closure: Optional[Callable[..., Any]] = None,
                    args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None
                    ) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        """Before an optimizer step of the model. With a closure (Lightning's automatic
        optimization) the closure is wrapped so its gradients are checked when it returns; the
        step's (args, kwargs) come back."""
        if closure is not None:
            def checked(*a: Any, **k: Any) -> Any:
                loss = closure(*a, **k)
                if self._host.live():
                    self.before_step(optimizer)
                return loss

            if len(args) > 1:  # (the optimizer, closure, ...)
                return (args[0], checked) + tuple(args[2:]), dict(kwargs or {})
            return tuple(args), dict(kwargs or {}, closure=checked)
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf.__class__ is torch.Tensor and not torch.compiler.is_compiling() and (
                self._guard is not None or self._pending is not None or self._scale is not None):
            # A GradScaler hands its verdict to a fused optimizer (AdamW(fused=True)): step()
            # runs on the still-scaled gradients and writes nothing when found_inf is set. The
            # scaler checked every gradient of this optimizer: one read of its verdict instead of
            # the guard's; a skip stays a skip (counted here with gradients=True, else by the
            # scale's drop at the next read).
            self._skipping_step = bool(found_inf)
            if self._skipping_step:
                if self._pending is not None:
                    self.skipped()
                return None
            if self._pending is None:
                self._fleet.at_optimizer_step()
                return None
        pending, self._pending = self._pending, None
        if pending is not None:
            self._skips.step_taken()
            self._host.detect(pending.record, pending.frame)
        self._fleet.at_optimizer_step()  # multi-rank: the ranks' common stop point
        if pending is None and self._guard is not None and self._host.live() \
                and not torch.compiler.is_compiling():  # (a compiled optimizer step: no read inside its graph)
            # after the stop point: a stop already under way (another rank's, or this rank's
            # forward detection) is raised there, not named again at the gradients it spoilt
            batch = self._host.last_batch()  # the batch whose gradients the step consumes
            if self._host.watches(batch):
                self._guard_step(optimizer, batch)
        return None

    def _guard_step(self, optimizer: torch.optim.Optimizer, batch: int) -> None:
        """The step guard: one read; a detection named at the first bad gradient."""
        guard = self._guard
        assert guard is not None
        try:
            rec = guard.check(optimizer, batch)
            fi = rec.first_nonfinite_frame(0) if rec is not None else None
        except Exception as exc:  # the guard must not stop training: it goes off, said once
            self._guard = None
            log.error("tensorwatch_otel: the optimizer-step gradient check failed (%s: %s); training goes on "
                      "without it", type(exc).__name__, exc)
            return
        if fi is not None:
            self._host.detect(rec, fi, replicated=self._fleet.gradients_replicated())

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._skipping_step:  # the fused step skipped itself: no weight changed
            self._skipping_step = False
            return
        self._host.weights_changed()  # any optimizer, fused ones included
        self._skips.step_taken()
        batch = self._host.last_batch()
        if self._optim_state is not None and self._host.live() and self._host.watches(batch):
            rec = self._optim_state.record(optimizer, batch)
            if rec.frames:
                rec.readback()  # one transfer per step
                self._host.phase_stats(rec)
                self._host.check(rec, 0)

    # ---------------------------------------------------------------- skips
    def skipped(self, batch: Optional[int] = None) -> None:
        """Count a skipped step; `batch`: the batch whose gradients it would have consumed
        (default: the last batch begun; bad gradients pending name their own batch)."""
        pending, self._pending = self._pending, None
        scale = self._scale.last if self._scale is not None else None
        if batch is None:
            batch = self._host.last_batch()
        for event in self._skips.skipped(pending, batch, current_rank(), scale):
            self._host.emit(event)

    def at_detach(self) -> None:
        """Bad gradients no step consumed: the run skipped that step. Else, a drop of the scale
        since the last batch is the last step's skip (no batch came after it to read the scale)."""
        if self._pending is not None:
            self.skipped()
            return
        if self._scale is None or self._gradients:
            return
        try:
            t = self._scale.tensor()
            dropped = t is not None and self._scale.update(float(t))
        except Exception as exc:  # detach must not raise for a scaler we cannot read
            log.warning("tensorwatch_otel: could not read the loss scale at detach: %s", exc)
            return
        if dropped:
            self.skipped()
