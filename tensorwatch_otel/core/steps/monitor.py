"""The step monitor: what happens between a backward and the next forward, for one watcher.

It owns the optimizer-step state of a watcher: non-finite gradients no step has consumed yet
(`gradients=True`), the loss scale read with each batch (a GradScaler's skips), the skip count
and streak, the step guard (the gradients a step is about to consume, in one read:
core/steps/step_check.py) and the optimizer-state reader. The watcher calls it at an outermost
call, at a batch end, at the end of a gradient backward, before and after every optimizer step
that concerns its model, and at detach; it calls the watcher back (`StepHost`,
core/steps/host.py) to raise a detection, hand events and phase records to the sinks, and drop
the weight cache when a step changed the weights.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..frames.backward import producer_frame
from ..errors import NonFiniteDetected
from ..events import NonFiniteEvent
from ..fleet import FleetStop
from .bad_step import BadStep
from .on_detect import OnDetect
from .poison import ForwardPoison
from ..rank import current_rank
from ..record import Record
from .skip import SkipStep, StepArgs, stand_in, with_stand_in
from .guard import PendingGradients, StepGuard
from .host import StepHost
from .scaler import ScalerSkips, ScaleReader, SkipCounter
from .step_check import StepCheck
from .tracker import outside_graphs

log = logging.getLogger(__name__)


class StepMonitor:
    def __init__(self, host: StepHost, fleet: FleetStop, grad_scaler: Any = None, max_skipped_steps: int = 20,
                 gradients: bool = False, *, on_detect: OnDetect, captures: bool = False) -> None:
        self._host = host
        self._fleet = fleet
        self._gradients = gradients
        self._scale = ScaleReader(grad_scaler) if grad_scaler is not None else None
        self._steps_begun = 0  # optimizer steps whose pre-hook ran (a GradScaler's skip runs none)
        self._scaler_skips = ScalerSkips(grad_scaler, lambda: self._steps_begun, self._scaler_skipped) \
            if grad_scaler is not None else None
        self._pending: Optional[PendingGradients] = None  # non-finite gradients no step consumed yet
        self._skipping_step = False  # a fused optimizer's step that skips itself (GradScaler's found_inf)
        self._skips = SkipCounter(max_skipped_steps)
        self._check = StepCheck(host, fleet, on_detect=on_detect, captures=captures)  # the step guard, run
        self._optim_state: Any = None  # OptimizerStateReader with optimizer_state=True
        self._skipper = on_detect.skipper()  # on_detect="skip": steps made not to happen
        self._poison: Optional[ForwardPoison] = None  # a training forward's detection and the gradients it spoilt

    def use(self, guard: Optional[StepGuard], optim_state: Any) -> None:
        """The step guard and the optimizer-state reader (made where the hooks are placed)."""
        self._check.use(guard)
        self._optim_state = optim_state

    @property
    def steps_skipped(self) -> int:
        return self._skips.total

    @property
    def nonfinite_steps_skipped(self) -> int:
        return self._skips.nonfinite_total

    def forward_poisoned(self, event: NonFiniteEvent, params: List[torch.Tensor]) -> None:
        """on_detect="skip": a training forward went non-finite; the step that consumes the
        gradients its backward writes (they are spoilt, even when they look finite) is skipped
        (core/steps/poison.py). `params`: the model's parameters that take gradients. A verdict that
        already holds for the gradients stays (it names where the values went bad first)."""
        held = self._poison
        if held is not None and held.held and not held.gone:
            return
        self._drop_poison()
        self._poison = ForwardPoison(event, params)

    def call_returned(self, output: Any) -> None:
        """An outermost watched call returned `output`: a verdict made in it follows its graph."""
        poison = self._poison
        if poison is not None and not poison.bound:
            poison.bind(output)

    def _drop_poison(self) -> None:
        poison, self._poison = self._poison, None
        if poison is not None:
            poison.remove()

    # ---------------------------------------------------------------- forward side
    def at_outermost_call(self, begins: bool) -> None:
        """Bad gradients reset (or the scaler backed off) without a step since the backward: a
        skip (one host read, only while bad gradients are pending). A batch `begins`: a forward
        verdict no backward took goes (the loop dropped that batch)."""
        poison = self._poison
        if begins and poison is not None:
            poison.batch_begins()
            if poison.gone:
                self._poison = None
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
        step's (args, kwargs) come back. on_detect="skip": see _skippable_step."""
        self._steps_begun += 1
        self._check.take_back()  # a step that raised before its post-hook: our flag is not its verdict
        if self._skipper is not None and self._host.steps_live():
            return self._skippable_step(optimizer, closure, args, kwargs)
        if closure is not None:
            def checked(*a: Any, **k: Any) -> Any:
                loss = closure(*a, **k)
                if self._host.steps_live():
                    self.before_step(optimizer)
                return loss

            run = outside_graphs(checked, closure)  # (a compiled step would trace the check away)
            if len(args) > 1:  # (the optimizer, closure, ...)
                return (args[0], run) + tuple(args[2:]), dict(kwargs or {})
            return tuple(args), dict(kwargs or {}, closure=run)
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf.__class__ is torch.Tensor and (
                self._check.on or self._pending is not None or self._scale is not None):
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
        batch = self._host.last_batch()
        if pending is None and self._check.on and self._host.steps_live() \
                and not (self._gradients and self._host.watches(batch)):  # (gradients=True read that batch's)
            # after the stop point: a stop already under way (another rank's, or this rank's
            # forward detection) is raised there, not named again at the gradients it spoilt
            # every batch's step, sampled or not: every_n_batches thins the statistics, never
            # the detection (an unchecked step would spread an inf into every weight)
            if not self._check.defer(optimizer, batch):
                self._check.check_now(optimizer, batch)
        return None

    def settle(self) -> None:
        """The deferred step check's verdict, read with the batch just read back (StepCheck.settle):
        called at every batch end and at detach."""
        self._check.settle()

    def _guard_verdict(self, optimizer: torch.optim.Optimizer, batch: int) -> Optional[BadStep]:
        """on_detect="skip": why the step guard says this step must not run, or None."""
        found = self._check.read(optimizer, batch)
        return BadStep.of_record(*found) if found is not None else None

    # ---------------------------------------------------------------- on_detect="skip"
    def _skippable_step(self, optimizer: torch.optim.Optimizer, closure: Optional[Callable[..., Any]],
                        args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]]) -> Optional[StepArgs]:
        """on_detect="skip": a step that would consume inf/nan does not happen. Inside the gate
        (core/steps/skip.py) SkipStep makes the gate return before the optimizer ran; a call not
        through it gets a stand-in for the optimizer with no parameter groups. With a closure the
        verdict comes when it has run (its first run: later ones, LBFGS's, follow writes)."""
        skipper = self._skipper
        assert skipper is not None
        skipper.gate(optimizer)  # from the optimizer's next step on, a skip runs nothing
        gated = skipper.inside(optimizer)
        self._skipping_step = False
        if closure is not None:
            inst = None if gated else stand_in(optimizer, dropped=False)
            first = [True]

            def checked(*a: Any, **k: Any) -> Any:
                loss = closure(*a, **k)
                if first[0] and self._host.steps_live():
                    first[0] = False
                    bad = self._verdict(optimizer)
                    if bad is not None:
                        self._skip(bad, None if gated or (inst is not None and inst.drop()) else
                                   "its optimizer read its parameter groups before running its closure")
                        if gated:
                            raise SkipStep(optimizer, loss)
                        self._skipping_step = True  # the stand-in ran the step: torch's post-hooks follow
                return loss

            return with_stand_in(args, kwargs, inst, outside_graphs(checked, closure))
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf.__class__ is torch.Tensor and bool(found_inf):
            # a fused optimizer skips this step itself on the GradScaler's word: the scaler's skip
            self._skipping_step = True
            if self._pending is not None:
                self.skipped()
            return None
        bad = self._verdict(optimizer, scaler_checked=found_inf.__class__ is torch.Tensor)
        if bad is None:
            return None
        inst = None if gated else stand_in(optimizer, dropped=True)
        self._skip(bad, None if gated or inst is not None else f"{type(optimizer).__name__} cannot be stood in for")
        if gated:
            raise SkipStep(optimizer)
        self._skipping_step = True
        return with_stand_in(args, kwargs, inst)

    def _verdict(self, optimizer: torch.optim.Optimizer, scaler_checked: bool = False) -> Optional[BadStep]:
        """Why this step must not run, or None. The batch's forward detection, else bad
        gradients (gradients=True's pending ones, else one read by the step guard, unless a
        GradScaler checked them). Under DDP the all-reduced gradients, the same on every rank,
        decide alone (a rank's own forward only names the place), so every rank skips the same
        step; under FSDP each rank's own verdict on its shard is agreed in one collective."""
        batch = self._host.last_batch()  # the batch whose gradients the step consumes
        pending, self._pending = self._pending, None
        poison = self._poison
        if poison is not None and poison.skipped_in is not None and poison.skipped_in != batch:
            self._drop_poison()  # its batch's steps were skipped; this is a later batch's
            poison = None
        poisoned = poison.event if poison is not None and poison.spoils_step() else None
        replicated = self._check.on and self._fleet.gradients_replicated()
        bad: Optional[BadStep] = None
        if not replicated:
            if poisoned is not None:
                bad = BadStep.of_event(poisoned)
            elif pending is not None:
                bad = BadStep.of_record(pending.record, pending.frame)
        if bad is None and self._check.on and not scaler_checked:  # every batch, sampled or not
            bad = self._guard_verdict(optimizer, batch)
            if bad is not None and poisoned is not None:
                bad = BadStep.of_event(poisoned)  # the place it began
            elif bad is not None and bad.rec is not None:
                born = self._host.localize(bad.rec)  # an unsampled batch's forward, replayed
                if born is not None:
                    bad = BadStep.of_event(born)
        if self._fleet.gradients_sharded(self._host.generation()) \
                and self._fleet.any_rank(bad is not None) and bad is None:
            bad = BadStep(batch)  # another rank's shard: every rank skips the same step
        if bad is None:
            self._drop_poison()  # this step consumes gradients no verdict holds for
        elif bad.event is not None and poison is not None and not poison.gone:
            poison.skipped_in = batch
        return bad

    def _skip(self, bad: BadStep, cannot: Optional[str]) -> None:
        """Record the skip of this step; raise instead, as on_detect="raise" would, when it
        `cannot` be skipped (why) or max_skipped_steps steps in a row were skipped already."""
        limit = self._skips.max_streak
        if cannot is not None:
            note = f"; this optimizer step could not be skipped ({cannot}), so on_detect=\"skip\" raised"
        elif self._skips.nonfinite_streak >= limit:
            note = (f"; {limit} optimizer steps in a row were skipped already (max_skipped_steps={limit}), "
                    "so on_detect=\"skip\" raised")
        else:
            self._host.emit(self._skips.skipped_nonfinite(bad.batch, current_rank(), bad.module, bad.module_class,
                                                          bad.tensor, bad.kind, bad.phase))
            return
        if bad.rec is not None:  # a gradient check's record: detected (recorded, then raised) now
            self._host.detect(bad.rec, bad.frame, force=note)
        elif bad.event is not None:  # the forward's detection, recorded when it was made
            self._host.escalate(bad.event, note)
        else:  # another rank's shard: this rank has nothing of its own to show
            self._host.escalate(NonFiniteEvent(bad.batch, current_rank(), "", "", "", "", (), time.time(),
                                               phase="backward"), note + " (found on another rank)", recorded=False)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._check.take_back()
        if self._skipping_step:  # the step skipped itself, or ran on a stand-in: no weight changed
            self._skipping_step = False
            return
        self._drop_poison()  # a step took the gradients
        self._host.weights_changed()  # any optimizer, fused ones included
        self._skips.step_taken()
        batch = self._host.last_batch()
        if self._optim_state is not None and self._host.steps_live() and self._host.watches(batch):
            rec = self._optim_state.record(optimizer, batch)
            if rec.frame_count:
                rec.readback()  # one transfer per step
                self._host.phase_stats(rec)
                self._host.check(rec, 0)

    # ---------------------------------------------------------------- skips
    def _scaler_skipped(self, optimizer: Any) -> None:
        """The GradScaler skipped the step of the batch begun last: in a batch every_n_batches
        did not record, its forward is replayed now, while its inputs are held (an fp16
        overflow there is then named as a recorded batch names it: a detection; the skip is
        counted as ever, at the scale's drop, when the replay finds nothing)."""
        batch = self._host.last_batch()
        if not self._host.steps_live() or self._host.watches(batch):
            return
        self._host.localize(Record(batch))

    def skipped(self, batch: Optional[int] = None) -> None:
        """Count a skipped step; `batch`: the batch whose gradients it would have consumed
        (default: the last batch begun; bad gradients pending name their own batch)."""
        pending, self._pending = self._pending, None
        scale = self._scale.last if self._scale is not None else None
        if batch is None:
            batch = self._host.last_batch()
        poison = self._poison
        if poison is not None and poison.event.batch_number <= batch:
            self._drop_poison()  # that batch's step did not happen (a GradScaler's skip): not skipped twice
        for event in self._skips.skipped(pending, batch, current_rank(), scale):
            self._host.emit(event)

    def at_detach(self) -> None:
        """Bad gradients no step consumed: the run skipped that step. Else, a drop of the scale
        since the last batch is the last step's skip (no batch came after it to read the scale).
        The optimizers get their own step back."""
        if self._skipper is not None:
            self._skipper.remove()
        if self._scaler_skips is not None:
            self._scaler_skips.remove()
        self._drop_poison()
        self._check.take_back()  # (a step that raised after the flag was handed: it would skip every later step)
        try:
            self.settle()  # the last step's check: no batch came after it to read it
        except NonFiniteDetected as exc:  # recorded in the sinks; detach does not raise
            log.error("tensorwatch_otel: the last optimizer step's gradients held inf/nan (%s); recorded at "
                      "detach", exc)
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
