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

import dataclasses
import functools
import logging
import threading
import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Type

import torch

from .behaviour import Behaviour
from .budget import FixedSampling, OverheadBudget
from .config import WatchConfig
from .errors import AbortAfterBatch, NonFiniteDetected
from .events import BatchStats, BatchTraceEvent
from .fleet import FleetStop
from .ports import Sink, SinkFanout
from .rank import current_rank
from .events import NOTE_EMPTY, NOTE_NO_DATA
from .record import FrameDraft, History, ModuleInfo, Record
from .recorder import FrameRecorder
from .backward import BackwardRecorder
from .detection import DetectionPipeline
from .attach import HookSet
from .compiled import _live as _live_slots, _parsed as _parsed_spec, run_eagerly_when_called_eagerly, traced_post
from . import graph_stats
from .copies import ModuleHook
from . import transforms
from .step_monitor import StepHost, StepMonitor
from .steps import FUSED_DEVICES, StepGuard
from .finite import all_finite, output_tensors
from .optim_state import OptimizerStateReader

if TYPE_CHECKING:  # pragma: no cover
    from .capture import BatchCapture

log = logging.getLogger(__name__)

_MAX_PENDING = 2_000_000  # stat slots held before an early read-back (no root forward seen)
_WEIGHT_REFRESH = 32  # no-grad batches between full weight re-measurements (see _end_batch)


class _BatchState:
    """One thread's batch in progress: the call depth (pre-hook +1, forward hook -1), the record
    being filled (None between batches), whether this batch is recorded, how many `batch()`
    blocks hold it open, the frames already checked, the root's inputs waiting for a number,
    and the thread's finished records a detection ring reaches back into."""

    __slots__ = ("depth", "rec", "active", "quiet", "entry", "held", "checked", "inputs", "history")

    def __init__(self, max_frames: int) -> None:
        self.depth = 0
        self.rec: Optional[Record] = None
        self.active = False
        self.quiet = False  # an unsampled batch: the hooks of the modules it calls are off (core/quiet.py)
        self.entry: Optional[torch.nn.Module] = None  # while quiet: the outermost call's module
        self.held = 0
        self.checked = 0
        self.inputs: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]] = None
        self.history = History(max_frames)


class _PerThread(threading.local):
    """`.st`: the calling thread's _BatchState, made on its first access in that thread."""

    def __init__(self, max_frames: int) -> None:
        self.st = _BatchState(max_frames)


class BatchScope:
    """What `Watcher.batch()` returns: a context manager, re-entrant, for the calling thread."""

    __slots__ = ("_watcher", "_state")

    def __init__(self, watcher: "Watcher") -> None:
        self._watcher = watcher
        self._state: List[_BatchState] = []

    def __enter__(self) -> "Watcher":
        self._state.append(self._watcher._hold())
        return self._watcher

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> Literal[False]:
        self._watcher._release(self._state.pop(), exc_type is not None)
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
        self._batches = 0  # batches begun, by every thread: the next batch's number
        self._thread = 0  # the thread that began the last batch (a second one turns quiet batches off)
        self._fanout = SinkFanout(sinks, strict=config.strict)
        # which batches are measured (core/budget.py); with max_overhead it times the watcher's work
        self._sampling: "FixedSampling | OverheadBudget" = FixedSampling(config.every_n_batches, config.trace_batches) \
            if config.max_overhead is None else OverheadBudget(config.max_overhead, config.every_n_batches,
                                                               config.trace_batches, emit=self._fanout.on_event,
                                                               rank=current_rank())
        self._owned = list(owned_sinks)
        self._lock = threading.Lock()
        self._attached = False
        self._tls = _PerThread(config.max_frames)  # each thread's batch in progress
        self._recorder = FrameRecorder(model)
        self.grad_scaler = grad_scaler
        self._fleet = FleetStop(lambda e: self._detect.durable(e), lambda: self._batches,
                                 config.on_detect == "raise" and not local, model=model, publishes=not local)
        # ring, capture, replay, fleet, flush, raise (core/detection.py)
        self._detect = DetectionPipeline(model, config, self.behaviour, self._fanout, self._fleet,
                                         self._recorder.kind, lambda: self._recorder.acts_seen.clear(),
                                         lambda: self._tls.st.history, self._probe,
                                         forward_poisoned=lambda e: self._steps.forward_poisoned(e),
                                         sampled=self._watches)
        self._check = self._detect.check
        self._detected = self._detect.detected
        # optimizer steps, skips, the loss scale, the step guard (core/step_monitor.py)
        self._steps = StepMonitor(StepHost(
            detect=self._detected, escalate=self._detect.escalate, emit=self._fanout.on_event,
            phase_stats=self._phase_stats, check=self._check, last_batch=self._last_batch, watches=self._watches,
            live=lambda: self._attached and not self._replaying, weights_changed=self._recorder.invalidate_weights,
            generation=lambda: self._hooks.index.generation, localize=self._detect.localized),
            self._fleet, grad_scaler, config.max_skipped_steps, config.gradients, skip=config.on_detect == "skip")
        self._backward = BackwardRecorder(self._last_batch,
                                          lambda: self._attached and self._watches(self._last_batch()),
                                          self._steps.backward_done, self._hook_failed)
        self._said_root_alone = False  # (see _say_if_root_alone)
        # every hook and handle, the model's parameters and their owners (core/attach.py)
        self._hooks = HookSet(model, config, slot_owner=self, pre_hook=self._pre_hook, make_hook=self._make_hook,
                              capture_hook=self._capture_hook if self._capture is not None else None,
                              param_hook=self._backward.param_hook, params_current=self._params_current,
                              before_step=self._timed(self._steps.before_step),
                              after_step=self._timed(self._steps.after_step),
                              batch_number=lambda: self.batch_number)
        self._rescan_failed = False
        self._unwrapped: Optional[transforms.UnwrappedRecorder] = None  # made at the first call inside torch.func
        self._grad_acts = config.gradients
        self._failed_hooks = 0
        self._hook_error_logged = False
        self._attach()

    # ---------------------------------------------------------------- lifetime
    def _attach(self) -> None:
        hooks = self._hooks
        hooks.place()
        cfg = self.config
        # gradients=True localizes bad gradients in the backward of a recorded batch: the step guard
        # adds the batches every_n_batches does not record, and on_detect="skip", whose verdict is
        # on the gradients the step consumes (DDP's all-reduced ones, a GradScaler's unscaled ones)
        guard = cfg.guard_steps and (not cfg.gradients or cfg.on_detect == "skip" or cfg.every_n_batches > 1)
        self._steps.use(StepGuard(hooks.index) if guard else None,
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
        ACTIVE.discard(self)
        self._steps.at_detach()
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

    # ---------------------------------------------------------------- hot path
    def _make_hook(self, info: ModuleInfo, slot: int = 0) -> "ForwardHook":
        """`slot`: the hook's op slot (core/compiled.py), called in its place while dynamo traces."""
        recorder = self._recorder
        # the default behaviour records with the recorder's own frame(): one call less per frame
        take: _Take = recorder.frame if type(self.behaviour).record is Behaviour.record \
            else functools.partial(self.behaviour.record, recorder)
        return ForwardHook(self, info, slot, take)

    def _graph_frames(self, rec: Record) -> None:
        """The frames of this watcher's in-graph sites that ran in the batch (core/graph_stats.py),
        in the order they ran, read with one copy per device: added before the model's own
        frame, where eager watching has its submodules' frames."""
        for site, vals in graph_stats.ran():
            for s in _live_slots(site.slot):
                hook = s.post()
                if s.watcher() is not self or not isinstance(hook, ForwardHook):
                    continue
                info = hook._info
                if not info.recorded:
                    continue
                d = FrameDraft()
                j = 0
                for name, kind, dt in site.layout(info.kw_names, _parsed_spec):
                    if kind == "m":
                        d.add(name, (vals[j], vals[j + 1]), getattr(torch, dt))
                        j += 2
                    elif kind == "e":
                        d.items.append((name, NOTE_EMPTY))
                    elif kind == "x":
                        d.items.append((name, NOTE_NO_DATA))
                    else:
                        d.items.append((name, kind))
                rec.add_frame(info, d)

    def _take_unwrapped(self, rec: Record, info: ModuleInfo, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                        output: Any) -> None:
        """A frame of a call inside torch.func transforms, measured through the tensors they wrap
        (core/transforms.py); said once."""
        r = self._unwrapped
        if r is None:
            r = self._unwrapped = transforms.UnwrappedRecorder(self.model)
        r.say_once()
        with transforms.set_aside():
            if type(self.behaviour).record is Behaviour.record:
                r.frame(rec, info, args, kwargs, output)
            else:
                self.behaviour.record(r, rec, info, args, kwargs, output)

    def _pre_hook(self, module: Optional[torch.nn.Module], args: Tuple[Any, ...]) -> None:
        # registered through compiled.pre_hook, which runs it only outside dynamo's tracing
        if self._detect.replaying:
            return
        st = self._tls.st
        if st.depth == 0:
            sampling = self._sampling
            t0 = sampling.clock()
            self._outermost_call(st, module)
            sampling.spend(t0)
        elif st.quiet:
            return  # a hook still on inside a quiet batch (beside other hooks, or put back): not counted
        st.depth += 1

    def _outermost_call(self, st: _BatchState, module: Optional[torch.nn.Module]) -> None:
        """An outermost watched call of this thread starts; it begins a batch unless one is open
        (a `batch()` block), it runs inside a backward (checkpoint recomputation) or
        torch.jit.trace traces it (the traced module is not watched)."""
        self._params_current()  # replaced parameters get their gradient hooks before the backward
        begins = st.rec is None and torch._C._current_graph_task_id() == -1 and _tracing() is None
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
        self._steps.at_outermost_call()  # bad gradients reset without a step: a skip
        if begins:
            with self._lock:  # one counter for every thread
                b = self._batches
                self._batches = b + 1
                thread = threading.get_ident()
                if self._thread != thread:
                    if self._thread:
                        self._hooks.quiet.turn_off("a second thread calls the model")
                    self._thread = thread
            st.rec = Record(b, targets=self.config.target_dtypes)
            st.active = self._attached and self._watches(b)
            st.checked = 0
            if st.active and graph_stats.ON and graph_stats.has_sites():
                graph_stats.begin_batch()  # the sites that run from now on are this batch's
        quiet = self._hooks.quiet
        if begins and not st.active:
            st.quiet = quiet.take_off(module)  # an unsampled batch: the modules it calls run without hooks
        elif quiet.off and not st.quiet:
            quiet.put_back()  # a recorded batch, or a call outside a batch (a recomputation): every hook on
        if st.quiet:
            st.entry = module  # this outermost call's hooks are on: its forward hook ends it
        if st.inputs is not None:
            args, kwargs = st.inputs
            st.inputs = None
            capture = self._capture
            if st.rec is not None and capture is not None:
                # tensors by reference; inputs are held only with a capture (_capture_hook)
                capture.hold(st.rec.batch_number, args, kwargs)

    def _params_current(self) -> None:
        """Parameters or submodules replaced since the last look (to_empty(), load_state_dict(
        assign=True), fully_shard, a module swap) are found again: owners, hooks, step guard."""
        if self._rescan_failed or not self._attached or torch.compiler.is_compiling() or self._hooks.current():
            return
        try:
            self._hooks.rescan()
            self._recorder.weights_replaced()
        except Exception as exc:  # finding them again must not stop training: said once
            self._rescan_failed = True
            log.error("tensorwatch_otel: could not find the model's replaced parameters or modules again "
                      "(%s: %s); training goes on, watching what was found at watch()", type(exc).__name__, exc)

    def _capture_hook(self, module: Optional[torch.nn.Module], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        # runs before the root's pre-hook, which numbers the batch and hands these on
        if not self._replaying and not torch.compiler.is_compiling():
            st = self._tls.st
            if st.depth == 0:
                st.inputs = (args, kwargs)

    def _probe(self, model: torch.nn.Module, sink: Sink) -> "Watcher":
        """A silent watcher that checks every module as it returns (for a replay): the modules,
        frames and statistics this watcher records, every batch, forwards only."""
        config = dataclasses.replace(self.config, check="module", on_detect="report", every_n_batches=1,
                                     trace_batches=frozenset(), abort_after_batch=None, gradients=False,
                                     optimizer_state=False, capture_dir=None, rerun_on_detect=False,
                                     guard_steps=False, strict=False, max_overhead=None)
        return Watcher(model, [sink], config, local=True)

    def _check_output(self, st: _BatchState, info: ModuleInfo, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                      output: Any, take: "_Take") -> None:
        """An unsampled batch's outermost call returned: its output (the loss alone when it
        carries one) checked for inf/nan in one read. A bad one is a detection, localized by a
        replay of the batch when it can be (core/detection.py), else named at this call's frame."""
        if not self._attached or self._replaying or _transforms():
            return
        grad = _grad_enabled()
        try:
            _set_grad(False)
            try:
                tensors = output_tensors(output)
                if not tensors or all_finite(tensors, FUSED_DEVICES):
                    return
                assert st.rec is not None  # (the caller checked)
                rec = Record(st.rec.batch_number, targets=self.config.target_dtypes)
                take(rec, info, args, kwargs, output)  # the call's frame, for an event the replay cannot give
                rec.readback()
            finally:
                _set_grad(grad)
        except Exception as exc:  # a check that fails must not stop training
            self._hook_failed(info, exc)
            return
        fi = rec.first_nonfinite_frame(0)
        self._detect.detected(rec, 0 if fi is None else fi)

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
        assert rec is not None  # (checked by the caller)
        if st.held:
            self._check_call(st)  # inside batch(): the batch goes on
        elif root or self.behaviour.outermost_call_ends_batch or rec.batch_number in self.config.trace_batches:
            self._end_batch(st)
        elif rec.frame_count:
            # the peer's batches end with the root only: check what this call added, keep the
            # frames in the ring, and carry on in the same batch (bounded memory)
            st.rec = Record(rec.batch_number, header=False, targets=rec.targets)
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
        assert rec is not None  # (inside a call of this batch)
        first, st.checked = st.checked, rec.frame_count
        cfg = self.config
        if not st.active or first == st.checked or cfg.check != "batch" or not (
                self.behaviour.detect_in_traced_batches or rec.batch_number not in cfg.trace_batches):
            return
        rec.readback()
        self._check(rec, first)

    def _end_batch(self, st: _BatchState) -> None:
        sampling = self._sampling
        t0 = sampling.clock()
        try:
            self._end_batch_timed(st)
        finally:
            sampling.spend(t0)

    def _end_batch_timed(self, st: _BatchState) -> None:
        rec = st.rec
        assert rec is not None  # (callers check it)
        sampled = not st.quiet
        if st.quiet:
            st.quiet = False
            st.entry = None
            self._hooks.quiet.rest()  # off until a recorded batch, or a call the sentry sees
        st.rec = None
        st.active = False
        st.checked = 0
        b = rec.batch_number
        self._recorder.end_batch()
        if (b + 1) % _WEIGHT_REFRESH == 0:
            self._recorder.invalidate_weights()  # `.data` writes between no-grad batches
        scale_t = self._steps.scale_tensor()
        if rec.frame_count or scale_t is not None:
            # the loss scale travels in the batch's read-back; a drop is a skipped step
            scale = self._steps.batch_scale(b, rec.readback(scale_t))
            if rec.frame_count:
                try:
                    self._finish(rec, scale)
                finally:  # a batch that raised NonFiniteDetected still precedes the next ring
                    st.history.keep(rec)
            if sampled and rec.frame_count and not self._said_root_alone:
                self._say_if_root_alone(rec)
        cfg = self.config
        if cfg.abort_after_batch is not None and b >= cfg.abort_after_batch:
            self._detect.abort(b)

    def _say_if_root_alone(self, rec: Record) -> None:
        """A recorded batch whose frames are all the root's while the model has watched
        submodules: their hooks did not run, and the model is unwatched inside. Said once, at
        WARNING: a compiled graph that dropped them, or a wrapper calling their forward()
        directly, would otherwise leave a run that looks watched and is not."""
        if any(not rec.frame_info(fi).is_root for fi in range(rec.frame_count)):
            self._said_root_alone = True  # the submodules' hooks run: nothing to say, ever
            return
        inside = self._hooks.hooked - 1
        if inside <= 0:
            return
        self._said_root_alone = True
        log.warning("tensorwatch_otel: batch %d recorded the model's own call only: none of its %d watched "
                    "submodules' hooks ran, so nothing inside the model is measured or checked (its output "
                    "is). A compiled graph that dropped the hooks, or code calling the submodules' forward() "
                    "directly, does this; said once", rec.batch_number, inside)

    def _finish(self, rec: Record, scale: Optional[float] = None) -> None:
        cfg = self.config
        traced = rec.batch_number in cfg.trace_batches
        rank = current_rank()
        if self._fanout.wants_batches:
            # a Record is a _LazyFrames (materialize()): rows are made by the sink
            self._fanout.on_batch(BatchStats(rec.batch_number, rank, time.time(), rec,
                                             grad_scale=scale, steps_skipped=self.steps_skipped,
                                             every_n_batches=self._sampling.every_n_batches,
                                             overhead=self._sampling.overhead))
        if traced:
            self._fanout.on_event(BatchTraceEvent(rec.batch_number, rank, rec.materialize(), time.time()))
        if cfg.check == "batch" and (self.behaviour.detect_in_traced_batches or not traced):
            self._check(rec, 0)

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

    @property
    def _replaying(self) -> bool:
        return self._detect.replaying

    @property
    def _capture(self) -> Optional[BatchCapture]:
        return self._detect.capture

    def overflow_check(self, event: object) -> None:
        """Hand a detect_overflow() finding to the sinks (durable before returning)."""
        self._detect.overflow_check(event)


_Take = Callable[[Record, ModuleInfo, Tuple[Any, ...], Dict[str, Any], Any], None]
_compiling = torch.compiler.is_compiling
_graph_task = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled
_tracing = transforms.tracing
_transforms = transforms.active


class ForwardHook(ModuleHook):
    """A watched module's forward hook: records the call's frame into the calling thread's batch
    and ends the batch when the outermost call returns (the watcher's hot path). `slot`: its op
    slot (core/compiled.py), called in its place while dynamo traces. Copied with its module, it
    is a no-op (core/copies.py)."""

    __slots__ = ("_w", "_info", "_slot", "_take", "_tls", "_detect", "_check_module", "_budget")

    def __init__(self, watcher: "Watcher", info: ModuleInfo, slot: int, take: _Take) -> None:
        super().__init__()
        self._w = watcher
        self._info = info
        self._slot = slot
        self._take = take
        self._tls = watcher._tls
        self._detect = watcher._detect
        self._check_module = watcher.config.check == "module"
        self._budget = watcher._sampling if watcher._sampling.timed else None  # times a measured frame

    def __call__(self, module: Optional[torch.nn.Module], args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 output: Any) -> None:
        if _compiling():  # traced into a graph: an op runs this hook at run time
            if self._slot:
                traced_post(self._slot, args, kwargs, output, self._info)
            return
        if self._detect.replaying:
            return
        st = self._tls.st
        if not st.active and st.depth > 1:  # an inner call of an unsampled batch: nothing to do
            st.depth -= 1
            return
        if st.quiet and module is not st.entry:  # a hook still on in a quiet batch: its pre-hook did not count
            return
        info = self._info
        outside_backward = _graph_task() == -1  # inside: checkpoint recomputation, not a batch
        try:
            if graph_stats.ON and st.active and outside_backward and st.rec is not None and graph_stats.pending():
                # the frames measured inside graphs that ran before this call returned (for the
                # model's own call: its submodules'; else a call run eagerly between graphs)
                self._w._graph_frames(st.rec)
            budget = self._budget
            if not st.active:  # the outermost call of an unsampled batch (inner ones returned above)
                if outside_backward and st.rec is not None and _tracing() is None:
                    t0 = budget.clock() if budget is not None else 0.0
                    self._w._check_output(st, info, args, kwargs, output, self._take)
                    if budget is not None:
                        budget.spend(t0)
            # (jit.trace: an op run here would be traced into its graph)
            elif info.recorded and outside_backward and _tracing() is None:
                t0 = budget.clock() if budget is not None else 0.0
                rec = st.rec
                assert rec is not None  # (a call of an open batch)
                w = self._w
                try:
                    grad = _grad_enabled()
                    _set_grad(False)  # (torch.no_grad() without its three Python calls)
                    wrapped = _transforms()  # torch.func's tensors: measured through what they wrap
                    try:
                        if wrapped:
                            w._take_unwrapped(rec, info, args, kwargs, output)
                        else:
                            self._take(rec, info, args, kwargs, output)
                    finally:
                        _set_grad(grad)
                    if grad and w._grad_acts and not wrapped:
                        w._backward.hook_activations(info, args, output)
                except Exception as exc:  # a frame we cannot take must not stop training
                    w._hook_failed(info, exc)
                if self._check_module:
                    rec.readback()
                    w._check(rec, rec.frame_count - 1)
                elif rec.stat_count > _MAX_PENDING:
                    rec.readback()
                if budget is not None:
                    budget.spend(t0)
        finally:  # a detection in the outermost frame must still end the batch
            st.depth -= 1
            if st.depth <= 0:
                st.depth = 0
                if outside_backward and st.rec is not None:
                    self._w._end_call(st, info.is_root)


run_eagerly_when_called_eagerly(ForwardHook.__call__.__code__)
