"""The watcher: what `watch()` returns. It builds and wires the collaborators (hooks, recorder,
batch lifecycle, detection, step monitor, sinks) and is their public face; the batches themselves
are core/batch/lifecycle.py's.

A batch ends when a thread's outermost watched call ends: the root's forward, as in
transformers.debug_utils (with gradient accumulation every micro-batch forward is a batch; eval
forwards count too, `generate()` one batch per decoding step), or, for a model used through
its submodules (`model.encode(...)`), each outermost submodule call; inside `with
watcher.batch():` every watched call of that thread is one batch, ended when the block ends.
Each thread has its own batch in progress; batch numbers come from one counter, taken when a
thread's batch starts. The sinks are given to it (the port in core/ports.py): the core imports no sink.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import weakref
from types import TracebackType
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Type

import torch

from .frames.attach import HookSet
from .frames.backward import BackwardRecorder
from .batch.lifecycle import BatchLifecycle, ThreadBatch
from .batch.behaviour import Behaviour
from .batch.sampling import FixedSampling, OverheadBudget
from .config import WatchConfig
from .batch.detection import DetectionPipeline
from .frames.compiled import compiling_here
from .frame_stats import BatchStats
from .fleet import FleetStop
from .steps.on_detect import choose as choose_on_detect
from .steps.optim_state import OptimizerStateReader
from .ports import Sink, SinkFanout
from .frames.quiet import QuietBatches
from .rank import current_rank
from .frame_draft import ModuleInfo
from .history import History
from .record import Record
from .frames.recorder import FrameRecorder
from .steps.monitor import StepHost, StepMonitor
from .steps.guard import StepGuard
from .steps.tracker import StepTracker

log = logging.getLogger(__name__)


class BatchScope:
    """What `Watcher.batch()` returns: a context manager, re-entrant, for the calling thread."""

    __slots__ = ("_watcher", "_life", "_state")

    def __init__(self, watcher: "Watcher", life: BatchLifecycle) -> None:
        self._watcher = watcher
        self._life = life
        self._state: List[ThreadBatch] = []

    def __enter__(self) -> "Watcher":
        self._state.append(self._life.hold())
        return self._watcher

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> Literal[False]:
        self._life.release(self._state.pop(), exc_type is not None)
        return False


# Watchers alive in this process, for detect_overflow(); weak so a dropped watcher goes away.
ACTIVE: "weakref.WeakSet[Watcher]" = weakref.WeakSet()


class Watcher:
    """Hooks on every (included) module of `model`; see `watch()`. A context manager."""

    def __init__(self, model: torch.nn.Module, sinks: Sequence[Sink], config: WatchConfig,
                 owned_sinks: Sequence[Sink] = (), behaviour: Optional[Behaviour] = None,
                 grad_scaler: Any = None, local: bool = False) -> None:
        """`local`: a replay's probe; its detections are not published to the other ranks."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.config = config
        self.behaviour = behaviour or Behaviour()
        self._fanout = SinkFanout(sinks, strict=config.strict)
        # which batches are measured (core/batch/sampling.py); with max_overhead it times the watcher's work
        self._sampling: "FixedSampling | OverheadBudget" = FixedSampling(config.every_n_batches, config.trace_batches) \
            if config.max_overhead is None else OverheadBudget(config.max_overhead, config.every_n_batches,
                                                               config.trace_batches, emit=self._fanout.on_event,
                                                               rank=current_rank())
        self._owned = list(owned_sinks)
        self._lock = threading.Lock()
        self._attached = False
        self._recorder = FrameRecorder(model)
        self.grad_scaler = grad_scaler
        # (the collaborators built before the batch lifecycle reach it when called, not before)
        self._on_detect = choose_on_detect(config.on_detect)  # what a detection does to training
        self._fleet = FleetStop(lambda e: self._detect.durable(e), lambda: self._life.batches,
                                 self._on_detect.stops_ranks and not local, model=model, publishes=not local)
        # ring, capture, replay, fleet, flush, raise (core/batch/detection.py)
        self._detect = DetectionPipeline(model, config, self.behaviour, self._on_detect, self._fanout, self._fleet,
                                         self._recorder.kind, lambda: self._recorder.acts_seen.clear(),
                                         lambda: self._life.history, self._probe,
                                         forward_poisoned=lambda e, params: self._steps.forward_poisoned(e, params),
                                         sampled=self._watches)
        # optimizer steps, skips, the loss scale, the step guard (core/steps/monitor.py)
        self._steps = StepMonitor(StepHost(
            detect=self._detect.detected, escalate=self._detect.escalate, emit=self._fanout.on_event,
            phase_stats=self._phase_stats, check=self._detect.check, last_batch=self._last_batch,
            watches=self._watches, live=lambda: self._attached and not self._detect.replaying,
            weights_changed=self._recorder.invalidate_weights, generation=lambda: self._hooks.index.generation,
            localize=self._detect.localized),
            self._fleet, grad_scaler, config.max_skipped_steps, config.gradients, on_detect=self._on_detect,
            captures=bool(config.capture_dir))
        self._backward = BackwardRecorder(self._last_batch,
                                          lambda: self._attached and self._watches(self._life.last_batch()),
                                          self._steps.backward_done, self._hook_failed)
        quiet = QuietBatches(model)  # the hooks an unsampled batch takes off (core/frames/quiet.py)
        # each thread's batch: begun, recorded, ended (core/batch/lifecycle.py)
        self._life = BatchLifecycle(model, config, self.behaviour, recorder=self._recorder, sampling=self._sampling,
                                    fanout=self._fanout, fleet=self._fleet, detect=self._detect, steps=self._steps,
                                    backward=self._backward, quiet=quiet, live=lambda: self._attached,
                                    params_current=self._params_current, hooked=lambda: self._hooks.hooked,
                                    failed=self._hook_failed)
        # every hook and handle, the model's parameters and their owners (core/frames/attach.py)
        self._hooks = HookSet(model, config, slot_owner=self, quiet=quiet, pre_hook=self._life.pre_hook,
                              make_hook=self._life.make_hook,
                              capture_hook=self._life.capture_hook if self._detect.capture is not None else None,
                              param_hook=self._backward.param_hook, params_current=self._params_current,
                              batch_number=lambda: self.batch_number)
        self._step_hooks: Optional[StepTracker] = None  # the optimizer step hooks (core/steps/tracker.py)
        self._rescan_failed = False
        self._failed_hooks = 0
        self._hook_error_logged = False
        self._attach()

    # ---------------------------------------------------------------- lifetime
    def _attach(self) -> None:
        hooks = self._hooks
        hooks.place()
        self._step_hooks = StepTracker(hooks.index, self._params_current, self._timed(self._steps.before_step),
                                       self._timed(self._steps.after_step))
        cfg = self.config
        # gradients=True localizes bad gradients in the backward of a recorded batch: the step guard
        # adds the batches every_n_batches or max_overhead do not record, and on_detect="skip", whose verdict is
        # on the gradients the step consumes (DDP's all-reduced ones, a GradScaler's unscaled ones)
        guard = cfg.guard_steps and (not cfg.gradients or self._on_detect.guards_every_step or cfg.sampling)
        self._steps.use(StepGuard(hooks.index, self._recorder.device_stats) if guard else None,
                        OptimizerStateReader(hooks.index) if cfg.optimizer_state else None)
        self._attached = True
        ACTIVE.add(self)
        hooks.say_if_compiled()  # torch.compile'd (or model.compile() in place): hooks run as ops

    def detach(self) -> None:
        """Remove every hook, flush the sinks and close those the watcher created. Idempotent."""
        with self._lock:
            if not self._attached:
                return
            self._attached = False
        self._hooks.remove()
        if self._step_hooks is not None:
            self._step_hooks.remove()
        ACTIVE.discard(self)
        self._steps.at_detach()
        self._detect.release_inputs()  # the last batch's inputs (held for a replay) are not kept alive
        self._fanout.flush(self.config.flush_timeout_s)
        for s in self._owned:
            try:
                s.close()
            except Exception as exc:  # closing must not raise into user code
                log.warning("tensorwatch_otel: closing %s failed: %s", type(s).__name__, exc)
        self._recorder.clear()

    close = detach

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self._fleet.at_exit()  # multi-rank: a stop held for a later stop point is raised now
        finally:
            self.detach()

    @property
    def attached(self) -> bool:
        """Its hooks are on the model (between watch() and detach())."""
        return self._attached

    @property
    def sinks(self) -> List[Sink]:
        return self._fanout.sinks

    @property
    def sink_failures(self) -> Dict[str, int]:
        """Failures per sink method, counted since the watcher was built."""
        return dict(self._fanout.failures)

    @property
    def batch_number(self) -> int:
        """The number of the calling thread's batch in progress; between its batches, the number
        the next batch takes (the batches begun so far, by every thread)."""
        return self._life.batch_number()

    def _last_batch(self) -> int:
        """The batch begun last (a batch() block's own while it is open): the one a backward or
        an optimizer step belongs to."""
        return self._life.last_batch()

    @property
    def _history(self) -> History:
        """The calling thread's finished records."""
        return self._life.history

    def batch(self) -> BatchScope:
        """A context manager: every watched call inside it (in the calling thread) is one batch.

        Use it when one step calls several submodules directly, or to count a forward, its
        backward and the optimizer step as one batch. Nested blocks are the same batch; it ends
        when the outermost block ends, even on an exception (the exception goes on unchanged;
        the frames are still recorded). Each outermost call inside it is still checked as it
        ends, so a detection raises there, before the backward or the step that would follow.
        A block in which no watched call ran takes no batch number.

        Example::

            with watcher.batch():
                loss = model.head(model.encoder(x)).sum()
                loss.backward()
                optimizer.step()
        """
        return BatchScope(self, self._life)

    def _watches(self, batch: int) -> bool:
        return self._sampling.watches(batch)

    @property
    def measure_every_n_batches(self) -> int:
        """The watcher measures one batch in this many: every_n_batches, or the interval
        max_overhead chose last. Detection runs on every batch."""
        return self._sampling.every_n_batches

    @property
    def overhead(self) -> Optional[float]:
        """With max_overhead: the watcher's share of the step time over the last complete
        interval (its seconds over the rest of the step's); None without a budget, or before
        one interval is complete."""
        return self._sampling.overhead

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, its time counted as the watcher's when a budget times it."""
        sampling = self._sampling
        if not sampling.timed:
            return fn

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = sampling.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                sampling.spend(t0)
        return timed

    # ---------------------------------------------------------------- collaborators
    def _params_current(self) -> None:
        """Parameters or submodules replaced since the last look (to_empty(), load_state_dict(
        assign=True), fully_shard, a module swap) are found again: owners, hooks, step guard."""
        if self._rescan_failed or not self._attached or compiling_here() or self._hooks.current():
            return
        try:
            self._hooks.rescan()
            self._recorder.weights_replaced()
        except Exception as exc:  # finding them again must not stop training: said once
            self._rescan_failed = True
            log.error("tensorwatch_otel: could not find the model's replaced parameters or modules again "
                      "(%s: %s); training goes on, watching what was found at watch()", type(exc).__name__, exc)

    def _probe(self, model: torch.nn.Module, sink: Sink) -> "Watcher":
        """A silent watcher that checks every module as it returns (for a replay): the modules,
        frames and statistics this watcher records, every batch, forwards only."""
        config = dataclasses.replace(self.config, check="module", on_detect="report", every_n_batches=1,
                                     trace_batches=frozenset(), abort_after_batch=None, gradients=False,
                                     optimizer_state=False, capture_dir=None, rerun_on_detect=False,
                                     guard_steps=False, strict=False, max_overhead=None)
        return Watcher(model, [sink], config, local=True)

    def _hook_failed(self, info: ModuleInfo, exc: Exception) -> None:
        self._failed_hooks += 1
        if not self._hook_error_logged:
            self._hook_error_logged = True
            log.error("tensorwatch_otel: could not record %s (%s): %s: %s; training goes on, "
                      "further failures are counted", info.path or "(root)", info.cls,
                      type(exc).__name__, exc)

    # ---------------------------------------------------------------- gradients and steps
    def _phase_stats(self, rec: Record) -> None:
        """Gradients and optimizer state to the metric sinks, as series of their own."""
        if self._fanout.wants_batches:
            self._fanout.on_batch(BatchStats(rec.batch_number, current_rank(), time.time(),
                                             rec, phase=rec.phase))

    @property
    def steps_skipped(self) -> int:
        """Optimizer steps skipped so far (non-finite gradients no step consumed)."""
        return self._steps.steps_skipped

    @property
    def nonfinite_steps_skipped(self) -> int:
        """Optimizer steps the watcher skipped so far (on_detect="skip")."""
        return self._steps.nonfinite_steps_skipped

    @property
    def detections(self) -> int:
        """Detections made so far."""
        return self._detect.detections

    def overflow_check(self, event: object) -> None:
        """Hand a detect_overflow() finding to the sinks (durable before returning)."""
        self._detect.overflow_check(event)
