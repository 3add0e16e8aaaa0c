"""The watcher: forward hooks that record a frame per module call, read the batch's statistics
back in one host transfer when the batch ends, and hand events to the sinks.

A batch ends when the outermost watched call ends: the root's forward, as in
transformers.debug_utils (with gradient accumulation every micro-batch forward is a batch; eval
forwards count too, `generate()` one batch per decoding step), or, for a model used through
its submodules (`model.encode(...)`, a LightningModule calling `self.net(x)`), each outermost
submodule call. The sinks are given to it (the port in core/ports.py): the core imports no sink.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import naming
from .behaviour import Behaviour
from .config import WatchConfig
from .errors import AbortAfterBatch, NonFiniteDetected
from .events import AbortAfterBatchEvent, BatchStats, BatchTraceEvent, Frame, NonFiniteEvent
from .fleet import FleetStop
from .ports import Sink, SinkFanout
from .rank import current_rank
from .record import History, ModuleInfo, Record
from .recorder import FrameRecorder
from .backward import BackwardRecorder, producer_frame
from .capture import BatchCapture
from .rerun import host, replay_would_block, rerun_batch
from .attach import place_hooks, rescan, say_compiled
from .steps import PendingGradients, ScaleReader, SkipCounter, StepGuard

log = logging.getLogger(__name__)

_MAX_PENDING = 2_000_000  # stat slots held before an early read-back (no root forward seen)
_WEIGHT_REFRESH = 32  # no-grad batches between full weight re-measurements (see _end_batch)

# Watchers alive in this process, for detect_overflow(); weak so a dropped watcher goes away.
ACTIVE: "weakref.WeakSet[Watcher]" = weakref.WeakSet()


class Watcher:
    """Hooks on every (included) module of `model`; see `watch()`. A context manager."""

    def __init__(self, model: torch.nn.Module, sinks: Sequence[Sink], config: WatchConfig,
                 owned_sinks: Sequence[Sink] = (), behaviour: Optional[Behaviour] = None,
                 grad_scaler=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.config = config
        self.behaviour = behaviour or Behaviour()
        self.batch_number = 0
        self.detections = 0
        self._fanout = SinkFanout(sinks, strict=config.strict)
        self._owned = list(owned_sinks)
        self._handles: list = []
        self._lock = threading.Lock()
        self._attached = False
        self._depth = 0  # watched module calls in progress (pre-hook +1, forward hook -1)
        self._recorder = FrameRecorder(model)
        self._rec = Record(0)
        self._history = History(config.max_frames)
        self._backward = BackwardRecorder(lambda: max(self.batch_number - 1, 0),
                                          lambda: self._attached and self._watches(max(self.batch_number - 1, 0)),
                                          self._backward_done, self._hook_failed)
        self.grad_scaler = grad_scaler
        self._scale = ScaleReader(grad_scaler) if grad_scaler is not None else None
        self._pending: Optional[PendingGradients] = None  # non-finite gradients no step consumed yet
        self._skips = SkipCounter(config.max_skipped_steps)
        self._steps = None  # the StepTracker (core/attach.py)
        self._guard: Optional[StepGuard] = None  # the optimizer-step guard (core/attach.py)
        self._optim_state = None
        self._compiled = False
        self._compile_warned = False
        self._weight_infos: List[Tuple[ModuleInfo, torch.nn.Module]] = []
        # the model's parameters and their owners, found again when replaced (core/attach.py)
        self._index = None
        self._hooked = None  # module -> its hooks (weak keys)
        self._param_hooks: Dict[int, tuple] = {}  # id(param) -> (weakref, info, gradient hook handle)
        self._said_params_replaced = False
        self._rescan_failed = False
        self._grad_acts = config.gradients
        self._capture = BatchCapture(config.capture_dir or "", current_rank()) \
            if config.capture_dir or config.rerun_on_detect else None
        self._replaying = False
        self._active = self._watches(0)
        self._failed_hooks = 0
        self._hook_error_logged = False
        self._fleet = FleetStop(self._record_durable, lambda: self.batch_number, config.on_detect == "raise",
                                 model=model)
        self._attach()

    # ---------------------------------------------------------------- lifetime
    def _attach(self) -> None:
        place_hooks(self)
        self._attached = True
        ACTIVE.add(self)
        if getattr(self.model, "_compiled_call_impl", None) is not None:
            self._compiled_away()  # model.compile() in place: even the root's hooks run in the graph
        if self._compiled:
            say_compiled(self)

    def detach(self) -> None:
        """Remove every hook, flush the sinks and close those the watcher created. Idempotent."""
        with self._lock:
            if not self._attached:
                return
            self._attached = False
            handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        ACTIVE.discard(self)
        if self._pending is not None:  # bad gradients no step consumed: the run skipped it
            self._skipped()
        elif self._scale is not None and not self.config.gradients:
            self._last_scale_read()
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

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self._fleet.at_exit()  # multi-rank: a stop held for a later stop point is raised now
        finally:
            self.detach()

    @property
    def sinks(self) -> List[Sink]:
        return self._fanout.sinks

    @property
    def sink_failures(self) -> Dict[str, int]:
        """Failures per sink method, counted since the watcher was built."""
        return dict(self._fanout.failures)

    def _watches(self, batch: int) -> bool:
        cfg = self.config
        return batch % cfg.every_n_batches == 0 or batch in cfg.trace_batches

    # ---------------------------------------------------------------- hot path
    def _make_hook(self, info: ModuleInfo):
        record = self.behaviour.record
        recorder = self._recorder
        graph_task = torch._C._current_graph_task_id
        compiling = torch.compiler.is_compiling

        def hook(module, args, kwargs, output):
            if self._replaying:
                return
            if compiling():
                self._compiled_away()
                return
            outside_backward = graph_task() == -1  # inside: checkpoint recomputation, not a batch
            try:
                if self._active and info.recorded and outside_backward:
                    rec = self._rec
                    try:
                        with torch.no_grad():
                            if info.is_root and self._weight_infos:
                                for winfo, _ in self._weight_infos:
                                    recorder.weights_frame(rec, winfo)
                            record(recorder, rec, info, args, kwargs, output)
                        if self._grad_acts and torch.is_grad_enabled():
                            self._backward.hook_activations(info, args, output)
                    except Exception as exc:  # a frame we cannot take must not stop training
                        self._hook_failed(info, exc)
                    if self.config.check == "module":
                        rec.readback()
                        self._check(rec, len(rec.frames) - 1)
                    elif len(rec.stats) > _MAX_PENDING:
                        rec.readback()
            finally:  # a detection in the outermost frame must still end the batch
                self._depth -= 1
                if self._depth <= 0:
                    self._depth = 0
                    if outside_backward:
                        self._end_call(info.is_root)
        return hook

    def _pre_hook(self, module, args):
        if self._replaying or torch.compiler.is_compiling():
            return
        if self._depth == 0:  # an outermost call starts
            self._params_current()  # replaced parameters get their gradient hooks before the backward
            try:  # multi-rank: the stop published by a rank may be raised here
                self._fleet.at_batch_start()
            except NonFiniteDetected:
                self._active = False  # the call never runs: the always-called hook records nothing
                raise
            if torch.is_grad_enabled():
                # Training batches always measure live weights (fused optimizers, `.data` writes
                # and in-place casts move no _version); no-grad batches (eval, generate) reuse
                # them until a step, a version/storage/dtype change, or every 32 batches.
                self._recorder.invalidate_weights()
            if self._pending is not None and (self._pending.was_reset() or (
                    self._scale is not None and self._scale.dropped_since_read())):
                self._skipped()  # the bad gradients were reset (or the scaler backed off) without a step
        self._depth += 1

    def _params_current(self) -> None:
        """Parameters or submodules replaced since the last look (to_empty(), load_state_dict(
        assign=True), fully_shard, a module swap) are found again: owners, hooks, step guard."""
        if self._rescan_failed or not self._attached or torch.compiler.is_compiling() or self._index.current():
            return
        try:
            rescan(self)
        except Exception as exc:  # finding them again must not stop training: said once
            self._rescan_failed = True
            log.error("tensorwatch_otel: could not find the model's replaced parameters or modules again "
                      "(%s: %s); training goes on, watching what was found at watch()", type(exc).__name__, exc)

    def _capture_hook(self, module, args, kwargs):
        if self._depth == 0 and not self._replaying and not torch.compiler.is_compiling():
            self._capture.hold(self.batch_number, args, kwargs)  # tensors by reference

    def _probe(self, model: torch.nn.Module, sink: Sink) -> "Watcher":
        """A silent watcher that checks every module as it returns (for the re-run)."""
        return Watcher(model, [sink], WatchConfig.build(check="module", on_detect="report", max_frames=1,
                                                        guard_steps=False, environ={}))

    def _compiled_away(self) -> None:
        if not self._compile_warned and not self._compiled:
            self._compile_warned = True
            log.warning(
                "tensorwatch_otel: the watched model runs under torch.compile (compiled after watch(), or "
                "in place with model.compile()): its hooks are compiled away and nothing of it is watched. "
                "Call watch() on the compiled module (watch(torch.compile(model))) to watch its "
                "inputs, outputs and every weight.")

    def _hook_failed(self, info: ModuleInfo, exc: Exception) -> None:
        self._failed_hooks += 1
        if not self._hook_error_logged:
            self._hook_error_logged = True
            log.error("tensorwatch_otel: could not record %s (%s): %s: %s; training goes on, "
                      "further failures are counted", info.path or "(root)", info.cls,
                      type(exc).__name__, exc)

    # ---------------------------------------------------------------- batch end
    def _end_call(self, root: bool) -> None:
        """The outermost watched call ended."""
        if root or self.behaviour.outermost_call_ends_batch or self.batch_number in self.config.trace_batches:
            self._end_batch()
        elif self._rec.frames:
            # the peer's batches end with the root only: check what this call added, keep the
            # frames in the ring, and carry on in the same batch (bounded memory)
            rec = self._rec
            self._rec = Record(rec.batch_number, header=False)
            rec.readback()
            try:
                if self.config.check == "batch":
                    self._check(rec, 0)
            finally:
                self._history.keep(rec)

    def _end_batch(self) -> None:
        rec = self._rec
        b = self.batch_number
        self.batch_number = b + 1
        self._rec = Record(b + 1)
        self._active = self._attached and self._watches(b + 1)
        self._recorder.end_batch()
        if self.batch_number % _WEIGHT_REFRESH == 0:
            self._recorder.invalidate_weights()  # `.data` writes between no-grad batches
        scale_t = self._scale.tensor() if self._scale is not None else None
        scale = None
        if rec.frames or scale_t is not None:
            scale = rec.readback(scale_t)
            if scale_t is not None and self._scale.update(scale) and not self.config.gradients:
                # the scale dropped: the scaler skipped the step after batch b - 1 (the batch
                # whose gradients it would have consumed, as gradients=True numbers it)
                self._skipped(max(b - 1, 0))
            if scale is None and self._scale is not None:
                scale = self._scale.last  # no scale tensor yet: the scaler's init_scale
            if rec.frames:
                try:
                    self._finish(rec, scale)
                finally:  # a batch that raised NonFiniteDetected still precedes the next ring
                    self._history.keep(rec)
        cfg = self.config
        if cfg.abort_after_batch is not None and self.batch_number > cfg.abort_after_batch:
            self._abort()

    def _finish(self, rec: Record, scale: Optional[float] = None) -> None:
        cfg = self.config
        traced = rec.batch_number in cfg.trace_batches
        rank = current_rank()
        if self._fanout.wants_batches:
            self._fanout.on_batch(BatchStats(rec.batch_number, rank, time.time(), rec, grad_scale=scale,
                                             steps_skipped=self.steps_skipped))
        if traced:
            self._fanout.on_event(BatchTraceEvent(rec.batch_number, rank, rec.materialize(), time.time()))
        if cfg.check == "batch" and (self.behaviour.detect_in_traced_batches or not traced):
            self._check(rec, 0)

    def _check(self, rec: Record, first_frame: int) -> None:
        """Detect inf/nan in frames[first_frame:] of `rec` (their stats are on the host)."""
        if rec.detected:
            return
        fi = rec.first_nonfinite_frame(first_frame)
        if fi is not None:
            self._detected(rec, fi)

    def _ring(self, rec: Record, fi: int) -> Tuple[Frame, ...]:
        traced = self.config.trace_batches
        stops_at = self.behaviour.ring_stops_at
        return self._history.ring(rec, fi, lambda prev: stops_at(prev, traced))

    def _detected(self, rec: Record, fi: int, replicated: bool = False) -> None:
        """`replicated`: the values are the same on every rank (the step guard's all-reduced
        gradients), so every rank finds them at this point and may raise here."""
        rec.detected = True
        frames = self._ring(rec, fi)
        last = frames[-1]
        first = last.first_nonfinite()
        capture = self._capture.write(rec.batch_number) if self._capture is not None and self.config.capture_dir \
            else None
        reproduced = None
        if self.config.rerun_on_detect and rec.phase == "forward" and self._capture is not None \
                and not replay_would_block(self.model):
            self._replaying = True
            try:  # the user's model, not its DDP wrapper (whose forward broadcasts buffers)
                reproduced = rerun_batch(naming.unwrap_root(self.model), self._capture, rec.batch_number,
                                         last.module, first.name if first else "", self._probe)
            finally:
                self._replaying = False
        event = NonFiniteEvent(
            batch_number=rec.batch_number, rank=current_rank(), module=last.module,
            module_class=last.module_class, tensor=first.name if first else "",
            kind=self._recorder.kind(rec, fi, first), frames=frames, time=time.time(), phase=rec.phase,
            capture=capture, reproduced=reproduced, host=host() if reproduced is not None else None)
        raising = self.config.on_detect == "raise"
        if self._fleet.active():
            event = self._fleet.publish(event)  # multi-rank: first_rank is whoever published first
        self.detections += 1
        self._fanout.on_event(event)
        if raising:
            self._fanout.flush(self.config.flush_timeout_s)
            # drop what the aborted batch left behind so a caught exception leaves a clean state
            self._recorder.acts_seen.clear()
            exc = NonFiniteDetected(self.behaviour.detection_message(event), event)
            if not self._fleet.defer(exc, replicated):  # multi-rank: raised at the ranks' common stop point
                raise exc

    def _abort(self) -> None:
        cfg = self.config
        event = AbortAfterBatchEvent(self.batch_number - 1, current_rank(), time.time())
        self._fanout.on_event(event)
        self._fanout.flush(cfg.flush_timeout_s)
        raise AbortAfterBatch(self.behaviour.abort_message(self.batch_number, cfg.abort_after_batch))

    # ---------------------------------------------------------------- gradients and steps
    def _backward_done(self, rec: Record, owners: List[Optional[torch.Tensor]], gids: List[int]) -> None:
        rec.readback()
        self._phase_stats(rec)
        fi = rec.first_nonfinite_frame(0)
        if fi is not None:
            j = producer_frame(rec, fi, gids)
            if j != fi:  # one gradient, two names: keep the producer's frame only
                del rec.frames[fi], owners[fi]
                fi = j - 1
        if self._pending is not None and (fi is None or self._pending.was_reset(by_version=False)):
            self._skipped()  # the bad gradients were reset (set to None, or finite now): no step took them
        if fi is None:
            return
        # Not a detection yet: only a step that consumes these gradients makes one; a step
        # skipped instead (GradScaler) is counted as such.
        self._pending = PendingGradients(rec, fi, [p for p in owners[fi:] if p is not None][:1])

    def _phase_stats(self, rec: Record) -> None:
        """Gradients and optimizer state to the metric sinks, as series of their own."""
        if self._fanout.wants_batches:
            self._fanout.on_batch(BatchStats(rec.batch_number, current_rank(), time.time(), rec, phase=rec.phase))

    def _before_step(self, optimizer) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._skips.step_taken()
            self._detected(pending.record, pending.frame)
        self._fleet.at_optimizer_step()  # multi-rank: the ranks' common stop point
        if pending is None and self._guard is not None and self._attached and not self._replaying \
                and not torch.compiler.is_compiling():  # (a compiled optimizer step: no read inside its graph)
            # after the stop point: a stop already under way (another rank's, or this rank's
            # forward detection) is raised there, not named again at the gradients it spoilt
            batch = max(self.batch_number - 1, 0)  # the batch whose gradients the step consumes
            if self._watches(batch):
                self._guard_step(optimizer, batch)

    def _guard_step(self, optimizer, batch: int) -> None:
        """The step guard: one read; a detection named at the first bad gradient."""
        try:
            rec = self._guard.check(optimizer, batch)
            fi = rec.first_nonfinite_frame(0) if rec is not None else None
        except Exception as exc:  # the guard must not stop training: it goes off, said once
            self._guard = None
            log.error("tensorwatch_otel: the optimizer-step gradient check failed (%s: %s); training goes on "
                      "without it", type(exc).__name__, exc)
            return
        if fi is not None:
            self._detected(rec, fi, replicated=self._fleet.gradients_replicated())

    def _after_step(self, optimizer) -> None:
        self._recorder.invalidate_weights()  # any optimizer, fused ones included
        self._skips.step_taken()
        if self._optim_state is not None and self._attached and self._watches(max(self.batch_number - 1, 0)):
            rec = self._optim_state.record(optimizer, max(self.batch_number - 1, 0))
            if rec.frames:
                rec.readback()  # one transfer per step
                self._phase_stats(rec)
                self._check(rec, 0)

    def _skipped(self, batch: Optional[int] = None) -> None:
        """Count a skipped step; `batch`: the batch whose gradients it would have consumed
        (default: the last batch begun; bad gradients pending name their own batch)."""
        pending, self._pending = self._pending, None
        scale = self._scale.last if self._scale is not None else None
        if batch is None:
            batch = max(self.batch_number - 1, 0)
        for event in self._skips.skipped(pending, batch, current_rank(), scale):
            self._fanout.on_event(event)

    def _last_scale_read(self) -> None:
        """At detach: a drop of the scale since the last batch is the last step's skip (no batch
        came after it to read the scale)."""
        try:
            t = self._scale.tensor()
            dropped = t is not None and self._scale.update(float(t))
        except Exception as exc:  # detach must not raise for a scaler we cannot read
            log.warning("tensorwatch_otel: could not read the loss scale at detach: %s", exc)
            return
        if dropped:
            self._skipped()

    @property
    def steps_skipped(self) -> int:
        """Optimizer steps skipped so far (non-finite gradients no step consumed)."""
        return self._skips.total

    def _record_durable(self, event) -> None:
        self._fanout.on_event(event)
        self._fanout.flush(self.config.flush_timeout_s)

    def overflow_check(self, event) -> None:
        """Hand a detect_overflow() finding to the sinks (durable before returning)."""
        self._fanout.on_event(event)
        if event.kind:
            self._fanout.flush(self.config.flush_timeout_s)
