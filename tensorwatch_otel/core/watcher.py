"""The watcher: forward hooks that record a frame per module call, read the batch's statistics
back in one host transfer when the batch ends, and hand events to the sinks.

A batch ends when a thread's outermost watched call ends: the root's forward, as in
transformers.debug_utils (with gradient accumulation every micro-batch forward is a batch; eval
forwards count too, `generate()` one batch per decoding step), or, for a model used through
its submodules (`model.encode(...)`), each outermost submodule call; inside `with
watcher.batch():` every watched call of that thread is one batch, ended when the block ends.
Each thread has its own batch in progress; batch numbers come from one counter, taken when a
thread's batch starts. The sinks are given to it (the port in core/ports.py): the core imports no sink.
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


class _BatchState:
    """One thread's batch in progress: the call depth (pre-hook +1, forward hook -1), the record
    being filled (None between batches), whether this batch is recorded, how many `batch()`
    blocks hold it open, the frames already checked, the root's inputs waiting for a number,
    and the thread's finished records a detection ring reaches back into."""

    __slots__ = ("depth", "rec", "active", "held", "checked", "inputs", "history")

    def __init__(self, max_frames: int):
        self.depth = 0
        self.rec: Optional[Record] = None
        self.active = False
        self.held = 0
        self.checked = 0
        self.inputs: Optional[tuple] = None
        self.history = History(max_frames)


class _PerThread(threading.local):
    """`.st`: the calling thread's _BatchState, made on its first access in that thread."""

    def __init__(self, max_frames: int):
        self.st = _BatchState(max_frames)


class BatchScope:
    """What `Watcher.batch()` returns: a context manager, re-entrant, for the calling thread."""

    __slots__ = ("_watcher", "_state")

    def __init__(self, watcher: "Watcher"):
        self._watcher = watcher
        self._state: List[_BatchState] = []

    def __enter__(self) -> "Watcher":
        self._state.append(self._watcher._hold())
        return self._watcher

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._watcher._release(self._state.pop(), exc_type is not None)
        return False


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
        self._batches = 0  # batches begun, by every thread: the next batch's number
        self.detections = 0
        self._fanout = SinkFanout(sinks, strict=config.strict)
        self._owned = list(owned_sinks)
        self._handles: list = []
        self._lock = threading.Lock()
        self._attached = False
        self._tls = _PerThread(config.max_frames)  # each thread's batch in progress
        self._recorder = FrameRecorder(model)
        self._backward = BackwardRecorder(self._last_batch,
                                          lambda: self._attached and self._watches(self._last_batch()),
                                          self._backward_done, self._hook_failed)
        self.grad_scaler = grad_scaler
        self._scale = ScaleReader(grad_scaler) if grad_scaler is not None else None
        self._pending: Optional[PendingGradients] = None  # non-finite gradients no step consumed yet
        self._skipping_step = False  # a fused optimizer's step that skips itself (GradScaler's found_inf)
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
        self._failed_hooks = 0
        self._hook_error_logged = False
        self._fleet = FleetStop(self._record_durable, lambda: self._batches, config.on_detect == "raise",
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

    @property
    def batch_number(self) -> int:
        """The number of the calling thread's batch in progress; between its batches, the number
        the next batch takes (the batches begun so far, by every thread)."""
        rec = self._tls.st.rec
        return rec.batch_number if rec is not None else self._batches

    def _last_batch(self) -> int:
        """The batch begun last (a batch() block's own while it is open): the one a backward or
        an optimizer step belongs to."""
        return max(self._batches - 1, 0)

    @property
    def _history(self) -> History:
        """The calling thread's finished records."""
        return self._tls.st.history

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
        return BatchScope(self)

    def _hold(self) -> "_BatchState":
        st = self._tls.st
        st.held += 1
        return st

    def _release(self, st: "_BatchState", failed: bool) -> None:
        st.held -= 1
        if st.held or st.depth or st.rec is None:
            return
        if not failed:
            self._end_batch(st)
            return
        try:  # the user's exception goes on; a detection here is in the sinks already
            self._end_batch(st)
        except (NonFiniteDetected, AbortAfterBatch):
            pass

    def _watches(self, batch: int) -> bool:
        cfg = self.config
        return batch % cfg.every_n_batches == 0 or batch in cfg.trace_batches

    # ---------------------------------------------------------------- hot path
    def _make_hook(self, info: ModuleInfo):
        record = self.behaviour.record
        recorder = self._recorder
        tls = self._tls
        graph_task = torch._C._current_graph_task_id
        compiling = torch.compiler.is_compiling
        grad_enabled = torch.is_grad_enabled
        set_grad = torch._C._set_grad_enabled
        check_module = self.config.check == "module"

        def hook(module, args, kwargs, output):
            if self._replaying:
                return
            if compiling():
                self._compiled_away()
                return
            st = tls.st
            if not st.active and st.depth > 1:  # an inner call of an unsampled batch: nothing to do
                st.depth -= 1
                return
            outside_backward = graph_task() == -1  # inside: checkpoint recomputation, not a batch
            try:
                if st.active and info.recorded and outside_backward:
                    rec = st.rec
                    try:
                        grad = grad_enabled()
                        set_grad(False)  # (torch.no_grad() without its three Python calls)
                        try:
                            if info.is_root and self._weight_infos:
                                for winfo, _ in self._weight_infos:
                                    recorder.weights_frame(rec, winfo)
                            record(recorder, rec, info, args, kwargs, output)
                        finally:
                            set_grad(grad)
                        if grad and self._grad_acts:
                            self._backward.hook_activations(info, args, output)
                    except Exception as exc:  # a frame we cannot take must not stop training
                        self._hook_failed(info, exc)
                    if check_module:
                        rec.readback()
                        self._check(rec, len(rec.frames) - 1)
                    elif len(rec.stats) > _MAX_PENDING:
                        rec.readback()
            finally:  # a detection in the outermost frame must still end the batch
                st.depth -= 1
                if st.depth <= 0:
                    st.depth = 0
                    if outside_backward and st.rec is not None:
                        self._end_call(st, info.is_root)
        return hook

    def _pre_hook(self, module, args):
        if self._replaying or torch.compiler.is_compiling():
            return
        st = self._tls.st
        if st.depth == 0:
            self._outermost_call(st)
        st.depth += 1

    def _outermost_call(self, st: _BatchState) -> None:
        """An outermost watched call of this thread starts; it begins a batch unless one is open
        (a `batch()` block) or it runs inside a backward (checkpoint recomputation)."""
        self._params_current()  # replaced parameters get their gradient hooks before the backward
        begins = st.rec is None and torch._C._current_graph_task_id() == -1
        if begins:
            try:  # multi-rank: the stop published by a rank may be raised here
                self._fleet.at_batch_start()
            except NonFiniteDetected:
                st.inputs = None  # the call never runs: no batch begins, the hook records nothing
                raise
        if torch.is_grad_enabled():
            # Training batches always measure live weights (fused optimizers, `.data` writes
            # and in-place casts move no _version); no-grad batches (eval, generate) reuse
            # them until a step, a version/storage/dtype change, or every 32 batches.
            self._recorder.invalidate_weights()
        if self._pending is not None and (self._pending.was_reset() or (
                self._scale is not None and self._scale.dropped_since_read())):
            self._skipped()  # the bad gradients were reset (or the scaler backed off) without a step
        if begins:
            with self._lock:  # one counter for every thread
                b = self._batches
                self._batches = b + 1
            st.rec = Record(b)
            st.active = self._attached and self._watches(b)
            st.checked = 0
        if st.inputs is not None:
            args, kwargs = st.inputs
            st.inputs = None
            if st.rec is not None:
                self._capture.hold(st.rec.batch_number, args, kwargs)  # tensors by reference

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
        # runs before the root's pre-hook, which numbers the batch and hands these on
        if not self._replaying and not torch.compiler.is_compiling():
            st = self._tls.st
            if st.depth == 0:
                st.inputs = (args, kwargs)

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
    def _end_call(self, st: _BatchState, root: bool) -> None:
        """This thread's outermost watched call ended (its batch is `st.rec`)."""
        rec = st.rec
        if st.held:
            self._check_call(st)  # inside batch(): the batch goes on
        elif root or self.behaviour.outermost_call_ends_batch or rec.batch_number in self.config.trace_batches:
            self._end_batch(st)
        elif rec.frames:
            # the peer's batches end with the root only: check what this call added, keep the
            # frames in the ring, and carry on in the same batch (bounded memory)
            st.rec = Record(rec.batch_number, header=False)
            rec.readback()
            try:
                if self.config.check == "batch":
                    self._check(rec, 0)
            finally:
                st.history.keep(rec)

    def _check_call(self, st: _BatchState) -> None:
        """Inside batch(): check the frames the outermost call just added (one read-back), so a
        detection raises before a backward or step that would follow it in the same batch."""
        rec = st.rec
        first, st.checked = st.checked, len(rec.frames)
        cfg = self.config
        if not st.active or first == st.checked or cfg.check != "batch" or not (
                self.behaviour.detect_in_traced_batches or rec.batch_number not in cfg.trace_batches):
            return
        rec.readback()
        self._check(rec, first)

    def _end_batch(self, st: _BatchState) -> None:
        rec = st.rec
        st.rec = None
        st.active = False
        st.checked = 0
        b = rec.batch_number
        self._recorder.end_batch()
        if (b + 1) % _WEIGHT_REFRESH == 0:
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
                    st.history.keep(rec)
        cfg = self.config
        if cfg.abort_after_batch is not None and b >= cfg.abort_after_batch:
            self._abort(b)

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

    def _abort(self, batch: int) -> None:
        cfg = self.config
        event = AbortAfterBatchEvent(batch, current_rank(), time.time())
        self._fanout.on_event(event)
        self._fanout.flush(cfg.flush_timeout_s)
        raise AbortAfterBatch(self.behaviour.abort_message(batch + 1, cfg.abort_after_batch))

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

    def _before_step(self, optimizer, closure=None, args=(), kwargs=None):
        if closure is not None:
            # optimizer.step(closure) (Lightning's automatic optimization): the closure runs the
            # forward and backward inside the step; the gradients it leaves are checked when it
            # returns, before the step changes any weight
            def checked(*a, **k):
                loss = closure(*a, **k)
                if self._attached:
                    self._before_step(optimizer)
                return loss

            if len(args) > 1:  # (the optimizer, closure, ...)
                return (args[0], checked) + tuple(args[2:]), kwargs
            return args, dict(kwargs or {}, closure=checked)
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf.__class__ is torch.Tensor and not torch.compiler.is_compiling() and (
                self._guard is not None or self._pending is not None or self._scale is not None):
            # A GradScaler hands its verdict to a fused optimizer (AdamW(fused=True)): step()
            # runs on the still-scaled gradients and writes nothing when found_inf is set. The
            # scaler checked every gradient of this optimizer: one read of its verdict, instead
            # of the guard's; a skip stays a skip (counted here with gradients=True, else by the
            # scale's drop at the next read).
            self._skipping_step = bool(found_inf)
            if self._skipping_step:
                if self._pending is not None:
                    self._skipped()
                return
            if self._pending is None:
                self._fleet.at_optimizer_step()
                return
        pending, self._pending = self._pending, None
        if pending is not None:
            self._skips.step_taken()
            self._detected(pending.record, pending.frame)
        self._fleet.at_optimizer_step()  # multi-rank: the ranks' common stop point
        if pending is None and self._guard is not None and self._attached and not self._replaying \
                and not torch.compiler.is_compiling():  # (a compiled optimizer step: no read inside its graph)
            # after the stop point: a stop already under way (another rank's, or this rank's
            # forward detection) is raised there, not named again at the gradients it spoilt
            batch = self._last_batch()  # the batch whose gradients the step consumes
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
        if self._skipping_step:  # the fused step skipped itself: no weight changed
            self._skipping_step = False
            return
        self._recorder.invalidate_weights()  # any optimizer, fused ones included
        self._skips.step_taken()
        if self._optim_state is not None and self._attached and self._watches(self._last_batch()):
            rec = self._optim_state.record(optimizer, self._last_batch())
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
            batch = self._last_batch()
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
