"""A thread's batch, begun and ended: the state machine behind the watcher's hooks (the forward
pre-hook of every watched module here, its forward hook in core/batch/forward_hook.py: the hot
path), with the batch's end (core/batch/end.py: read-back, sinks, check) and the phase each
thread's batch is in (core/batch/thread_batch.py).

A thread's batch is in one of four phases (`Phase`), changed only by `ThreadBatch.open` and
`ThreadBatch.close`, which refuse any other move:

    IDLE --(outermost call begins a batch)--> RECORDING | UNSAMPLED | QUIET --(batch ends)--> IDLE

- IDLE: no batch open. A call that runs inside a backward (checkpoint recomputation), one that
  torch.jit.trace traces, one refused by a fleet stop, or one made while a detection replays
  the batch begins none: the thread stays IDLE through it.
- RECORDING: a sampled batch: every watched call's hook records a frame.
- UNSAMPLED: a batch every_n_batches (or max_overhead) leaves unrecorded: only the outermost
  call's output is checked, as it returns.
- QUIET: an unsampled batch whose modules' hooks were taken off (core/frames/quiet.py): the outermost
  call (`entry`) keeps its hooks and ends it.

The batch ends (back to IDLE) when the thread's outermost watched call returns; it stays open
across calls inside `with watcher.batch():` (ended when the outermost block ends), and for a
model used through its submodules under the peer's behaviour (each such call's frames are
checked and kept, the batch ends with the root's call). A detection raised in the outermost
frame still ends the batch.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Dict, Optional, Protocol, Tuple

import torch

from ..measure import graph_stats
from ..frames import transforms
from .behaviour import Behaviour
from .end import BatchEnd
from .forward_hook import ForwardHook, Take
from .thread_batch import BatchNumbers, Phase, PerThread, ThreadBatch
from ..frames.compiled import compiling_here
from ..errors import AbortAfterBatch, NonFiniteDetected
from ..frames.finite import all_finite, output_tensors
from ..frames.graph_frames import GraphFrames
from ..frame_draft import ModuleInfo
from ..history import History
from ..record import Record
from ..steps.guard import FUSED_DEVICES

if TYPE_CHECKING:  # pragma: no cover
    from ..frames.backward import BackwardRecorder
    from .sampling import FixedSampling, OverheadBudget
    from ..config import WatchConfig
    from .detection import DetectionPipeline
    from ..fleet import FleetStop
    from ..ports import SinkFanout
    from ..frames.quiet import QuietBatches
    from ..frames.recorder import FrameRecorder
    from ..steps.monitor import StepMonitor

log = logging.getLogger(__name__)

_graph_task = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled
_tracing = transforms.tracing
_transforms = transforms.active


class LifecycleHost(Protocol):
    """What the lifecycle asks of the rest of its watch (the watch's session, core/session.py)."""

    def live(self) -> bool:
        """The watcher is attached."""

    def params_current(self) -> None:
        """Parameters or submodules replaced since the last look are found again."""

    def hooked(self) -> int:
        """Modules with hooks."""

    def failed(self, info: ModuleInfo, exc: Exception) -> None:
        """A hook that could not record: counted, the first said."""


class BatchLifecycle:
    """Every thread's batch of one watcher: numbers them (one counter for every thread), runs the
    hooks' per-call work through the phases, and ends each batch (read-back, sinks, check).

    Built by the watch's session with its collaborators and itself as the `host`; `pre_hook`,
    `make_hook` and `capture_hook` are what its HookSet places."""

    def __init__(self, model: torch.nn.Module, config: WatchConfig, behaviour: Behaviour, *,
                 recorder: FrameRecorder, sampling: "FixedSampling | OverheadBudget", fanout: SinkFanout,
                 fleet: FleetStop, detect: DetectionPipeline, steps: StepMonitor, backward: BackwardRecorder,
                 quiet: QuietBatches, host: LifecycleHost) -> None:
        self._model = model
        self._config = config
        self._behaviour = behaviour
        self._recorder = recorder
        self._sampling = sampling
        self._fleet = fleet
        self._detect = detect
        self._steps = steps
        self._backward = backward
        self._quiet = quiet
        self._host = host
        self._end = BatchEnd(config, behaviour, recorder=recorder, sampling=sampling, fanout=fanout, detect=detect,
                             steps=steps, quiet=quiet, hooked=host.hooked)
        self._tls = PerThread(config.max_frames)  # each thread's batch in progress
        self._numbers = BatchNumbers(self._second_thread)  # one counter for every thread
        self._graph = GraphFrames(model)  # its submodules' rows of in-graph statistics (core/frames/graph_frames.py)
        self._threads = False  # a second thread has called the model (its rows would be shared)
        self._said_shared = False  # (said so: _say_shared)
        self._said_untimed = False  # (said so: graph_frames)
        # in-graph rows for its submodules' hooks: not with what a row cannot give (counts, gradients,
        # a check per module)
        self._rows = graph_stats.ON and not config.target_dtypes and not config.gradients and config.check == "batch"
        self._unwrapped: Optional[transforms.UnwrappedRecorder] = None  # made at the first call inside torch.func

    # ---------------------------------------------------------------- what the watcher reads
    def state(self) -> ThreadBatch:
        """The calling thread's batch."""
        return self._tls.st

    @property
    def phase(self) -> Phase:
        """The calling thread's batch's phase."""
        return self._tls.st.phase

    @property
    def batches(self) -> int:
        """Batches begun so far, by every thread: the next batch's number."""
        return self._numbers.next

    def batch_number(self) -> int:
        """The calling thread's batch in progress; between its batches, the next one's."""
        rec = self._tls.st.rec
        return rec.batch_number if rec is not None else self._numbers.next

    def last_batch(self) -> int:
        """The batch begun last (a batch() block's own while it is open)."""
        return max(self._numbers.next - 1, 0)

    @property
    def history(self) -> History:
        """The calling thread's finished records."""
        return self._tls.st.history

    # ---------------------------------------------------------------- batch() blocks
    def hold(self) -> ThreadBatch:
        """A `batch()` block opens: the calling thread's batch stays open until it is released."""
        st = self._tls.st
        st.held += 1
        return st

    def release(self, st: ThreadBatch, failed: bool) -> None:
        """A `batch()` block ends (`failed`: by an exception, which goes on unchanged)."""
        st.held -= 1
        if st.held or st.depth or st.phase is Phase.IDLE:
            return
        if not failed:
            self._end_batch(st)
            return
        try:  # the user's exception goes on; a detection here is in the sinks already
            self._end_batch(st)
        except (NonFiniteDetected, AbortAfterBatch):
            pass

    # ---------------------------------------------------------------- hooks
    def make_hook(self, info: ModuleInfo, slot: int = 0) -> "ForwardHook":
        """A module's forward hook. `slot`: its op slot (core/frames/compiled.py), called in its place
        while dynamo traces; a submodule's hook also gets a row id (core/frames/graph_frames.py), by
        which it writes its rows inside compiled graphs instead."""
        recorder = self._recorder
        # the default behaviour records with the recorder's own frame(): one call less per frame,
        # and autograd turned off only where that frame needs it
        default = type(self._behaviour).record is Behaviour.record
        take: Take = recorder.frame if default else functools.partial(self._behaviour.record, recorder)
        sampling = self._sampling
        hook = ForwardHook(self, info, slot, take, self._tls, self._detect, self._backward,
                           check_module=self._config.check == "module", grad_acts=self._config.gradients,
                           budget=sampling if sampling.timed else None, take_turns_grad_off=default)
        if self._rows and not info.is_root and not info.lent:
            hook.rehome(self._graph.row_id(info, hook))
        return hook

    def pre_hook(self, module: Optional[torch.nn.Module], args: Tuple[Any, ...]) -> None:
        """Every watched module's forward pre-hook (registered through compiled.pre_hook, which
        runs it only outside dynamo's tracing)."""
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

    def capture_hook(self, module: Optional[torch.nn.Module], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """The root's input capture: runs before the root's pre-hook, which numbers the batch and
        hands these on."""
        if not self._detect.replaying and not compiling_here():
            st = self._tls.st
            if st.depth == 0:
                st.inputs = (args, kwargs)

    def _outermost_call(self, st: ThreadBatch, module: Optional[torch.nn.Module]) -> None:
        """An outermost watched call of this thread starts; it begins a batch unless one is open
        (a `batch()` block), it runs inside a backward (checkpoint recomputation) or
        torch.jit.trace traces it (the traced module is not watched)."""
        self._host.params_current()  # replaced parameters get their gradient hooks before the backward
        begins = st.phase is Phase.IDLE and _graph_task() == -1 and _tracing() is None
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
        self._steps.at_outermost_call(begins)  # bad gradients reset without a step: a skip
        quiet = self._quiet
        if begins:
            b = self._numbers.take()
            rec = Record(b, targets=self._config.target_dtypes)
            if self._host.live() and self._sampling.watches(b):
                st.open(rec, Phase.RECORDING)
                if self._graph.active:
                    self._graph.begin()  # the rows written from now on are this batch's
                    self._say_shared()
                if quiet.off:
                    quiet.put_back()  # a recorded batch: every hook on
            else:  # an unsampled batch: the modules it calls run without hooks where they can
                st.open(rec, Phase.QUIET if quiet.take_off(module) else Phase.UNSAMPLED)
        elif quiet.off and not st.quiet:
            quiet.put_back()  # a call outside a batch (a recomputation), or a batch() block's: every hook on
        if st.quiet:
            st.entry = module  # this outermost call's hooks are on: its forward hook ends it
        if st.inputs is not None:
            args, kwargs = st.inputs
            st.inputs = None
            capture = self._detect.capture
            if st.rec is not None and capture is not None:
                # tensors by reference; inputs are held only with a capture (capture_hook)
                capture.hold(st.rec.batch_number, args, kwargs)

    def _second_thread(self) -> None:
        """A second thread begins a batch (called under the counter's lock): quiet batches off,
        and in-graph rows said to be shared."""
        self._quiet.turn_off("a second thread calls the model")
        self._threads = True
        self._say_shared()

    def _say_shared(self) -> None:
        """A watcher whose compiled graphs write rows, its model called by a second thread: said
        once, at WARNING, that the rows are the process's (threads running its graphs at the same
        time can read each other's)."""
        if self._threads and self._graph.active and not self._said_shared:
            self._said_shared = True
            log.warning("tensorwatch_otel: a second thread calls a model whose compiled graphs measure "
                        "inside the graph: those values are kept per process, not per thread, so "
                        "threads running its graphs at the same time can read each other's; set "
                        "TENSORWATCH_GRAPH_STATS=0 before watch() to measure with "
                        "the ops, per thread; said once")

    def rows_unseen(self, rec: Record) -> bool:
        """At the model's own call's end: rows of this batch may wait unread though no graph said
        so (`pending`): graphs whose every row is written inside activation checkpointing's
        operator, which takes no side effect. Read when this watcher's graphs have written rows
        before, or when the batch holds no frame of a submodule yet while tables exist."""
        return self._graph.active and graph_stats.has_tables() and (self._graph.read_rows or not rec.frame_count)

    @property
    def graph_active(self) -> bool:
        """Some submodule hook of this watcher writes rows inside compiled graphs."""
        return self._graph.active

    def graph_frames(self, rec: Record) -> None:
        """The frames of this watcher's in-graph rows written in the batch since the last read
        (core/frames/graph_frames.py), in the order they ran, read with one copy per device: added
        before the model's own frame, where eager watching has its submodules' frames."""
        self._graph.frames(rec)
        if self._sampling.timed and self._graph.read_rows and not self._said_untimed:
            self._said_untimed = True
            log.warning("tensorwatch_otel: max_overhead cannot bound this model's watching: its compiled graphs "
                        "measure its modules inside the graph, in every batch, sampled or not, and that time "
                        "is the graph's (not the watcher's host work, which max_overhead times and "
                        "Watcher.overhead reports). To bound it, sample with every_n_batches and measure "
                        "with the ops (TENSORWATCH_GRAPH_STATS=0 before watch()), or "
                        "watch the model uncompiled; said once")

    def take_unwrapped(self, rec: Record, info: ModuleInfo, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                       output: Any) -> None:
        """A frame of a call inside torch.func transforms, measured through the tensors they wrap
        (core/frames/transforms.py); said once."""
        r = self._unwrapped
        if r is None:
            r = self._unwrapped = transforms.UnwrappedRecorder(self._model)
        r.say_once()
        with transforms.set_aside():
            if type(self._behaviour).record is Behaviour.record:
                r.frame(rec, info, args, kwargs, output)
            else:
                self._behaviour.record(r, rec, info, args, kwargs, output)

    def hook_failed(self, info: ModuleInfo, exc: Exception) -> None:
        """A frame or check that could not be taken: counted, training goes on."""
        self._host.failed(info, exc)

    def check_module(self, rec: Record, first: int) -> None:
        """check="module": the frame just taken, read back and checked."""
        rec.readback()
        self._detect.check(rec, first)

    def check_output(self, st: ThreadBatch, info: ModuleInfo, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                     output: Any, take: Take) -> None:
        """An unsampled batch's outermost call returned: its output (the loss alone when it
        carries one) checked for inf/nan in one read. A bad one is a detection, localized by a
        replay of the batch when it can be (core/batch/detection.py), else named at this call's frame.
        Inside torch.func transforms, read through the tensors they wrap (core/frames/transforms.py)."""
        if not self._host.live() or self._detect.replaying:
            return
        grad = _grad_enabled()
        try:
            _set_grad(False)
            try:
                tensors = output_tensors(output)
                wrapped = _transforms()
                if not tensors or (transforms.all_finite_plain if wrapped else all_finite)(tensors, FUSED_DEVICES):
                    return
                assert st.rec is not None  # (the caller checked)
                rec = Record(st.rec.batch_number, targets=self._config.target_dtypes)
                # the call's frame, for an event the replay cannot give
                if wrapped:
                    self.take_unwrapped(rec, info, args, kwargs, output)
                else:
                    take(rec, info, args, kwargs, output)
                rec.readback()
            finally:
                _set_grad(grad)
        except Exception as exc:  # a check that fails must not stop training
            self._host.failed(info, exc)
            return
        fi = rec.first_nonfinite_frame(0)
        self._detect.detected(rec, 0 if fi is None else fi)

    # ---------------------------------------------------------------- batch end
    def end_call(self, st: ThreadBatch, root: bool, output: Any) -> None:
        """This thread's outermost watched call ended (its batch is `st.rec`), returning `output`."""
        rec = st.rec
        assert rec is not None  # (checked by the caller)
        if st.held:
            self._check_call(st)  # inside batch(): the batch goes on
        elif root or self._behaviour.outermost_call_ends_batch or rec.batch_number in self._config.trace_batches:
            self._end_batch(st)
        elif rec.frame_count:
            # the peer's batches end with the root only: check what this call added, keep the
            # frames in the ring, and carry on in the same batch (bounded memory)
            st.carry_on(Record(rec.batch_number, header=False, targets=rec.targets))
            rec.readback()
            try:
                if self._config.check == "batch":
                    self._detect.check(rec, 0)
            finally:
                st.history.keep(rec)
        self._steps.call_returned(output)  # (on_detect="skip": a verdict made in this call follows its graph)

    def _check_call(self, st: ThreadBatch) -> None:
        """Inside batch(): check the frames the outermost call just added (one read-back), so a
        detection raises before a backward or step that would follow it in the same batch."""
        rec = st.rec
        assert rec is not None  # (inside a call of this batch)
        first, st.checked = st.checked, rec.frame_count
        cfg = self._config
        if not st.recording or first == st.checked or cfg.check != "batch" or not (
                self._behaviour.detect_in_traced_batches or rec.batch_number not in cfg.trace_batches):
            return
        rec.readback()
        self._detect.check(rec, first)

    def _end_batch(self, st: ThreadBatch) -> None:
        sampling = self._sampling
        t0 = sampling.clock()
        try:
            self._end.end(st)
        finally:
            sampling.spend(t0)


