"""One watch's session: its collaborators, built once and in order, and what they ask of each
other.

The watcher (core/watcher.py) builds one Session per watch() and is its public face. A
collaborator receives the objects it uses; where it needs one built after it, or the watch's
state (attached or not), it receives the session itself as its host, typed by a Protocol in its
own module (LifecycleHost, StepHost, BackwardHost, DetectionHost), and asks through it when
called, never while being built. `__init__` below is the construction order, top to bottom;
the methods after it are what the hosts answer.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Optional, Sequence

import torch

from .batch.behaviour import Behaviour
from .batch.detection import DetectionPipeline, MakeProbe
from .batch.lifecycle import BatchLifecycle
from .batch.sampling import FixedSampling, OverheadBudget
from .config import WatchConfig
from .events import NonFiniteEvent
from .frame_stats import BatchStats, TensorStat
from .fleet import FleetStop
from .frames.attach import HookSet
from .frames.backward import BackwardRecorder
from .frames.compiled import compiling_here
from .frames.quiet import QuietBatches
from .frames.recorder import FrameRecorder
from .ports import Sink, SinkFanout
from .rank import current_rank
from .record import Record
from .history import History
from .frame_draft import ModuleInfo
from .steps.guard import StepGuard
from .steps.monitor import StepMonitor
from .steps.on_detect import choose as choose_on_detect
from .steps.optim_state import OptimizerStateReader
from .steps.tracker import StepTracker

log = logging.getLogger(__name__)


class HookFailures:
    """The hooks' failures to record a module call or a gradient: counted, the first said at
    ERROR with its module and exception; training goes on."""

    def __init__(self) -> None:
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def failed(self, info: ModuleInfo, exc: Exception) -> None:
        self._count += 1
        if self._count == 1:
            log.error("tensorwatch_otel: could not record %s (%s): %s: %s; training goes on, "
                      "further failures are counted", info.path or "(root)", info.cls,
                      type(exc).__name__, exc)


class Session:
    """One watch's collaborators (see the module docstring). `local`: a replay's probe, whose
    detections are not published to the other ranks; `make_probe` builds such a probe."""

    def __init__(self, model: torch.nn.Module, sinks: Sequence[Sink], config: WatchConfig, behaviour: Behaviour,
                 grad_scaler: Any, local: bool, make_probe: MakeProbe) -> None:
        self.config = config
        self.attached = False  # the hooks are on the model (attach() to detach())
        self.fanout = SinkFanout(sinks, strict=config.strict)
        # which batches are measured (core/batch/sampling.py); with max_overhead it times the watcher's work
        self.sampling: "FixedSampling | OverheadBudget" = FixedSampling(config.every_n_batches, config.trace_batches) \
            if config.max_overhead is None else OverheadBudget(config.max_overhead, config.every_n_batches,
                                                               config.trace_batches, emit=self.fanout.on_event,
                                                               rank=current_rank())
        self.recorder = FrameRecorder(model)  # what a module call measures (core/frames/recorder.py)
        self.failures = HookFailures()  # a hook that could not record: counted, said once
        self.on_detect = choose_on_detect(config.on_detect)  # what a detection does to training
        self._rescan_failed = False  # finding replaced parameters again failed once: not tried again
        # the rank that detected first stops every rank (core/fleet.py)
        self.fleet = FleetStop(self.durable, self.batches_begun, self.on_detect.stops_ranks and not local,
                               model=model, publishes=not local)
        # ring, capture, replay, fleet, flush, raise (core/batch/detection.py)
        self.detection = DetectionPipeline(model, config, behaviour, self.on_detect, self.fanout, self.fleet,
                                           host=self, make_probe=make_probe)
        # optimizer steps, skips, the loss scale, the step guard (core/steps/monitor.py)
        self.steps = StepMonitor(self, self.fleet, grad_scaler, config.max_skipped_steps, config.gradients,
                                 on_detect=self.on_detect, captures=bool(config.capture_dir))
        self.backward = BackwardRecorder(self)  # gradients=True (core/frames/backward.py)
        quiet = QuietBatches(model)  # the hooks an unsampled batch takes off (core/frames/quiet.py)
        # each thread's batch: begun, recorded, ended (core/batch/lifecycle.py)
        self.life = BatchLifecycle(model, config, behaviour, recorder=self.recorder, sampling=self.sampling,
                                   fanout=self.fanout, fleet=self.fleet, detect=self.detection, steps=self.steps,
                                   backward=self.backward, quiet=quiet, host=self)
        # every hook and handle, the model's parameters and their owners (core/frames/attach.py)
        self.hooks = HookSet(model, config, slot_owner=self, quiet=quiet, pre_hook=self.life.pre_hook,
                             make_hook=self.life.make_hook,
                             capture_hook=self.life.capture_hook if self.detection.capture is not None else None,
                             param_hook=self.backward.param_hook, params_current=self.params_current,
                             batch_number=self.life.batch_number)
        self.step_hooks: Optional[StepTracker] = None  # the optimizer step hooks (core/steps/tracker.py), at attach

    # ---------------------------------------------------------------- lifetime
    def attach(self) -> None:
        """The hooks on the model, the optimizer step hooks, the step guard."""
        hooks = self.hooks
        hooks.place()
        self.step_hooks = StepTracker(hooks.index, self.params_current, self.timed(self.steps.before_step),
                                      self.timed(self.steps.after_step))
        cfg = self.config
        # gradients=True localizes bad gradients in the backward of a recorded batch: the step guard
        # adds the batches every_n_batches or max_overhead do not record, and on_detect="skip", whose verdict is
        # on the gradients the step consumes (DDP's all-reduced ones, a GradScaler's unscaled ones)
        guard = cfg.guard_steps and (not cfg.gradients or self.on_detect.guards_every_step or cfg.sampling)
        self.steps.use(StepGuard(hooks.index, self.recorder.device_stats) if guard else None,
                       OptimizerStateReader(hooks.index) if cfg.optimizer_state else None)
        self.attached = True
        hooks.say_if_compiled()  # torch.compile'd (or model.compile() in place): hooks run as ops

    def detach(self, owned: Sequence[Sink]) -> None:
        """Every hook off, the sinks flushed and those in `owned` closed."""
        self.attached = False
        self.hooks.remove()
        if self.step_hooks is not None:
            self.step_hooks.remove()
        self.steps.at_detach()
        self.detection.release_inputs()  # the last batch's inputs (held for a replay) are not kept alive
        self.fanout.flush(self.config.flush_timeout_s)
        for s in owned:
            try:
                s.close()
            except Exception as exc:  # closing must not raise into user code
                log.warning("tensorwatch_otel: closing %s failed: %s", type(s).__name__, exc)
        self.recorder.clear()

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, its time counted as the watcher's when a budget times it."""
        sampling = self.sampling
        if not sampling.timed:
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = sampling.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                sampling.spend(t0)
        return timed

    # ---------------------------------------------------------------- what the hosts answer
    def live(self) -> bool:
        return self.attached

    def steps_live(self) -> bool:
        return self.attached and not self.detection.replaying

    def backward_watched(self) -> bool:
        return self.attached and self.sampling.watches(self.life.last_batch())

    def watches(self, batch: int) -> bool:
        return self.sampling.watches(batch)

    def last_batch(self) -> int:
        """The batch begun last (a batch() block's own while it is open): the one a backward or
        an optimizer step belongs to."""
        return self.life.last_batch()

    def batches_begun(self) -> int:
        return self.life.batches

    def history(self) -> History:
        return self.life.history

    def hooked(self) -> int:
        return self.hooks.hooked

    def generation(self) -> int:
        return self.hooks.index.generation

    def params_current(self) -> None:
        """Parameters or submodules replaced since the last look (to_empty(), load_state_dict(
        assign=True), fully_shard, a module swap) are found again: owners, hooks, step guard."""
        if self._rescan_failed or not self.attached or compiling_here() or self.hooks.current():
            return
        try:
            self.hooks.rescan()
            self.recorder.weights_replaced()
        except Exception as exc:  # finding them again must not stop training: said once
            self._rescan_failed = True
            log.error("tensorwatch_otel: could not find the model's replaced parameters or modules again "
                      "(%s: %s); training goes on, watching what was found at watch()", type(exc).__name__, exc)

    def failed(self, info: ModuleInfo, exc: Exception) -> None:
        self.failures.failed(info, exc)

    def kind_of(self, rec: Record, fi: int, stat: Optional[TensorStat]) -> str:
        return self.recorder.kind(rec, fi, stat)

    def forget_batch(self) -> None:
        self.recorder.acts_seen.clear()

    def weights_changed(self) -> None:
        self.recorder.invalidate_weights()

    def detect(self, rec: Record, fi: int, replicated: bool = False, force: Optional[str] = None) -> None:
        self.detection.detected(rec, fi, replicated=replicated, force=force)

    def escalate(self, event: NonFiniteEvent, note: str, recorded: bool = True) -> None:
        self.detection.escalate(event, note, recorded=recorded)

    def check(self, rec: Record, first_frame: int) -> None:
        self.detection.check(rec, first_frame)

    def localize(self, rec: Record) -> Optional[NonFiniteEvent]:
        return self.detection.localized(rec)

    def durable(self, event: Any) -> None:
        self.detection.durable(event)

    def emit(self, event: Any) -> None:
        self.fanout.on_event(event)

    def forward_poisoned(self, event: NonFiniteEvent, params: List[torch.Tensor]) -> None:
        self.steps.forward_poisoned(event, params)

    def backward_done(self, rec: Record, owners: List[Optional[torch.Tensor]], gids: List[int]) -> None:
        self.steps.backward_done(rec, owners, gids)

    def phase_stats(self, rec: Record) -> None:
        """Gradients and optimizer state to the metric sinks, as series of their own."""
        if self.fanout.wants_batches:
            self.fanout.on_batch(BatchStats(rec.batch_number, current_rank(), time.time(), rec, phase=rec.phase))
