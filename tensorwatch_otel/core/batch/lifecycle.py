"""A thread's batch, begun and ended: the state machine behind the watcher's hooks (the forward
pre-hook and hook of every watched module, the hot path), with the batch's end (read-back,
sinks, check) and the phase each thread's batch is in.

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

import enum
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch

from ..measure import graph_stats
from ..frames import transforms
from .behaviour import Behaviour
from ..frames.compiled import (compiling_here, run_eagerly_when_called_eagerly, slot_tensor, traced_here, traced_post,
                       traced_row, writes_rows)
from ..frames.copies import ModuleHook
from ..errors import AbortAfterBatch, NonFiniteDetected
from ..events import BatchTraceEvent
from ..frame_stats import BatchStats
from ..frames.finite import all_finite, output_tensors
from ..frames.graph_frames import GraphFrames
from ..rank import current_rank
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

_MAX_PENDING = 2_000_000  # stat slots held before an early read-back (no root forward seen)
_WEIGHT_REFRESH = 32  # no-grad batches between full weight re-measurements (see end_batch)


class Phase(enum.Enum):
    """Where a thread's batch is (see the module's docstring)."""

    IDLE = "idle"
    RECORDING = "recording"
    UNSAMPLED = "unsampled"
    QUIET = "quiet"


class ThreadBatch:
    """One thread's batch in progress: the lifecycle's record of it.

    `phase`, with `recording` (phase is RECORDING) and `quiet` (phase is QUIET) kept beside it for
    the hooks to read without a comparison, and `rec` (the record being filled; None exactly when
    IDLE) change only through `open`, `close` and `carry_on`. The rest are counters and slots the
    lifecycle and its hooks keep up directly: `depth` (pre-hook +1, forward hook -1), `entry`
    (while QUIET: the outermost call's module, whose hooks stay on), `held` (open `batch()`
    blocks), `checked` (frames already checked inside `batch()`), `inputs` (the root's inputs
    waiting for a batch number) and `history` (the thread's finished records a detection ring
    reaches back into)."""

    __slots__ = ("phase", "recording", "quiet", "rec", "depth", "entry", "held", "checked", "inputs", "history")

    def __init__(self, max_frames: int) -> None:
        self.phase = Phase.IDLE
        self.recording = False
        self.quiet = False
        self.rec: Optional[Record] = None
        self.depth = 0
        self.entry: Optional[torch.nn.Module] = None
        self.held = 0
        self.checked = 0
        self.inputs: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]] = None
        self.history = History(max_frames)

    def open(self, rec: Record, phase: Phase) -> None:
        """IDLE -> `phase` (RECORDING, UNSAMPLED or QUIET): a batch begins, filling `rec`."""
        self._to(phase)
        self.rec = rec
        self.checked = 0

    def close(self) -> Record:
        """An open phase -> IDLE: the batch ends; returns its record."""
        rec = self.rec
        self._to(Phase.IDLE)
        assert rec is not None  # (open: _to refused IDLE -> IDLE)
        self.rec = None
        self.entry = None
        self.checked = 0
        return rec

    def carry_on(self, rec: Record) -> Record:
        """The open batch goes on filling `rec`; returns the record filled so far."""
        done = self.rec
        if done is None:
            raise RuntimeError("tensorwatch_otel: no batch is open to carry on")
        self.rec = rec
        return done

    def _to(self, phase: Phase) -> None:
        # the one place the phase (and the flags the hooks read) changes: IDLE <-> an open phase
        if (self.phase is Phase.IDLE) is (phase is Phase.IDLE):
            raise RuntimeError(f"tensorwatch_otel: batch phase {self.phase.name} -> {phase.name} is not a transition")
        self.phase = phase
        self.recording = phase is Phase.RECORDING
        self.quiet = phase is Phase.QUIET


class _PerThread(threading.local):
    """`.st`: the calling thread's ThreadBatch, made on its first access in that thread."""

    def __init__(self, max_frames: int) -> None:
        self.st = ThreadBatch(max_frames)


class BatchLifecycle:
    """Every thread's batch of one watcher: numbers them (one counter for every thread), runs the
    hooks' per-call work through the phases, and ends each batch (read-back, sinks, check).

    Built by the watcher with its collaborators; `pre_hook`, `make_hook` and `capture_hook` are
    what its HookSet places. `live()` says whether the watcher is attached, `params_current()`
    finds replaced parameters again, `hooked()` counts the watched modules, `failed(info, exc)`
    counts a hook that failed."""

    def __init__(self, model: torch.nn.Module, config: WatchConfig, behaviour: Behaviour, *,
                 recorder: FrameRecorder, sampling: "FixedSampling | OverheadBudget", fanout: SinkFanout,
                 fleet: FleetStop, detect: DetectionPipeline, steps: StepMonitor, backward: BackwardRecorder,
                 quiet: QuietBatches, live: Callable[[], bool], params_current: Callable[[], None],
                 hooked: Callable[[], int], failed: Callable[[ModuleInfo, Exception], None]) -> None:
        self._model = model
        self._config = config
        self._behaviour = behaviour
        self._recorder = recorder
        self._sampling = sampling
        self._fanout = fanout
        self._fleet = fleet
        self._detect = detect
        self._steps = steps
        self._backward = backward
        self._quiet = quiet
        self._live = live
        self._params_current = params_current
        self._hooked = hooked
        self._failed = failed
        self._tls = _PerThread(config.max_frames)  # each thread's batch in progress
        self._lock = threading.Lock()
        self._batches = 0  # batches begun, by every thread: the next batch's number
        self._thread = 0  # the thread that began the last batch (a second one turns quiet batches off)
        self._said_root_alone = False  # (see _say_if_root_alone)
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
        return self._batches

    def batch_number(self) -> int:
        """The calling thread's batch in progress; between its batches, the next one's."""
        rec = self._tls.st.rec
        return rec.batch_number if rec is not None else self._batches

    def last_batch(self) -> int:
        """The batch begun last (a batch() block's own while it is open)."""
        return max(self._batches - 1, 0)

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
        # the default behaviour records with the recorder's own frame(): one call less per frame
        take: _Take = recorder.frame if type(self._behaviour).record is Behaviour.record \
            else functools.partial(self._behaviour.record, recorder)
        sampling = self._sampling
        hook = ForwardHook(self, info, slot, take, self._tls, self._detect, self._backward,
                           check_module=self._config.check == "module", grad_acts=self._config.gradients,
                           budget=sampling if sampling.timed else None)
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
        self._params_current()  # replaced parameters get their gradient hooks before the backward
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
            with self._lock:  # one counter for every thread
                b = self._batches
                self._batches = b + 1
                thread = threading.get_ident()
                if self._thread != thread:
                    if self._thread:
                        quiet.turn_off("a second thread calls the model")
                        self._threads = True
                        self._say_shared()
                    self._thread = thread
            rec = Record(b, targets=self._config.target_dtypes)
            if self._live() and self._sampling.watches(b):
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

    def _say_shared(self) -> None:
        """A watcher whose compiled graphs write rows, its model called by a second thread: said
        once, at WARNING, that the rows are the process's (threads running its graphs at the same
        time can read each other's)."""
        if self._threads and self._graph.active and not self._said_shared:
            self._said_shared = True
            log.warning("tensorwatch_otel: a second thread calls a model whose compiled graphs measure "
                        "inside the graph: those values are kept per process, not per thread, so "
                        "threads running its graphs at the same time can read each other's; set "
                        "TENSORWATCH_GRAPH_STATS=0 before importing tensorwatch_otel to measure with "
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
                        "with the ops (TENSORWATCH_GRAPH_STATS=0 before importing tensorwatch_otel), or "
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
        self._failed(info, exc)

    def check_module(self, rec: Record, first: int) -> None:
        """check="module": the frame just taken, read back and checked."""
        rec.readback()
        self._detect.check(rec, first)

    def check_output(self, st: ThreadBatch, info: ModuleInfo, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                     output: Any, take: "_Take") -> None:
        """An unsampled batch's outermost call returned: its output (the loss alone when it
        carries one) checked for inf/nan in one read. A bad one is a detection, localized by a
        replay of the batch when it can be (core/batch/detection.py), else named at this call's frame.
        Inside torch.func transforms, read through the tensors they wrap (core/frames/transforms.py)."""
        if not self._live() or self._detect.replaying:
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
            self._failed(info, exc)
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
            self._end_batch_timed(st)
        finally:
            sampling.spend(t0)

    def _end_batch_timed(self, st: ThreadBatch) -> None:
        sampled = not st.quiet
        if st.quiet:
            self._quiet.rest()  # off until a recorded batch, or a call the sentry sees
        rec = st.close()
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
                    # the last step's gradient check, read in that read-back: its detection first
                    self._steps.settle()
                    self._finish(rec, scale)
                finally:  # a batch that raised NonFiniteDetected still precedes the next ring
                    st.history.keep(rec)
            if sampled and rec.frame_count and not self._said_root_alone:
                self._say_if_root_alone(rec)
        if not rec.frame_count:
            self._steps.settle()  # (a read of its own)
        cfg = self._config
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
        inside = self._hooked() - 1
        if inside <= 0:
            return
        self._said_root_alone = True
        log.warning("tensorwatch_otel: batch %d recorded the model's own call only: none of its %d watched "
                    "submodules' hooks ran, so nothing inside the model is measured or checked (its output "
                    "is). A compiled graph that dropped the hooks, or code calling the submodules' forward() "
                    "directly, does this; said once", rec.batch_number, inside)

    def _finish(self, rec: Record, scale: Optional[float] = None) -> None:
        cfg = self._config
        traced = rec.batch_number in cfg.trace_batches
        rank = current_rank()
        fanout = self._fanout
        if fanout.wants_batches:
            # a Record is a _LazyFrames (materialize()): rows are made by the sink
            fanout.on_batch(BatchStats(rec.batch_number, rank, time.time(), rec,
                                       grad_scale=scale, steps_skipped=self._steps.steps_skipped,
                                       every_n_batches=self._sampling.every_n_batches,
                                       overhead=self._sampling.overhead))
        if traced:
            fanout.on_event(BatchTraceEvent(rec.batch_number, rank, rec.materialize(), time.time()))
        if cfg.check == "batch" and (self._behaviour.detect_in_traced_batches or not traced):
            self._detect.check(rec, 0)


_Take = Callable[[Record, ModuleInfo, Tuple[Any, ...], Dict[str, Any], Any], None]
_compiling = torch.compiler.is_compiling
_graph_task = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled
_tracing = transforms.tracing
_transforms = transforms.active


class ForwardHook(ModuleHook):
    """A watched module's forward hook: records the call's frame into the calling thread's batch
    and ends the batch when the outermost call returns (the watcher's hot path: it reads the
    ThreadBatch's flags and keeps its depth itself, and leaves every phase change to the
    lifecycle). `slot`: its op slot (core/frames/compiled.py), called in its place while dynamo traces.
    Copied with its module, it is a no-op (core/frames/copies.py)."""

    __slots__ = ("_life", "_info", "_slot", "_take", "_tls", "_detect", "_backward", "_check_module",
                 "_grad_acts", "_budget", "_row_id", "_params", "_pre")

    def __init__(self, life: BatchLifecycle, info: ModuleInfo, slot: int, take: _Take, tls: _PerThread,
                 detect: DetectionPipeline, backward: BackwardRecorder, *, check_module: bool, grad_acts: bool,
                 budget: "FixedSampling | OverheadBudget | None") -> None:
        super().__init__()
        self._life = life
        self._info = info
        self._slot = slot_tensor(slot) if slot else None  # (its op slot, as the ops take it)
        self._take = take
        self._tls = tls
        self._detect = detect
        self._backward = backward
        self._check_module = check_module
        self._grad_acts = grad_acts
        self._budget = budget  # times a measured frame
        # in-graph statistics (core/measure/graph_stats.py): its row id (None: the ops), its module's
        # parameter names (comma-separated: equal for modules sharing their code), its pre-hook
        self._row_id: Optional[torch.Tensor] = None
        self._params = ",".join(k for k, p in info.params.items() if p is not None)
        self._pre: Any = None

    @property
    def lifecycle(self) -> BatchLifecycle:
        return self._life

    @property
    def row_id(self) -> Optional[torch.Tensor]:
        return self._row_id

    def pair(self, pre: Any) -> None:
        """Its module's pre-hook (core/frames/compiled.py's PreHook), told of each new row id."""
        self._pre = pre

    def rehome(self, row_id: Optional[torch.Tensor]) -> None:
        """Its new row id (core/frames/graph_frames.py), its pre-hook's too."""
        self._row_id = row_id
        if self._pre is not None:
            self._pre.rehome(row_id)

    @property
    def info(self) -> ModuleInfo:
        return self._info

    def __call__(self, module: Optional[torch.nn.Module], args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 output: Any) -> None:
        """A module call returned: the hot path, in named steps (the branch a recorded frame takes
        is written out here, the rest are methods)."""
        if _compiling() and traced_here():
            return self._traced(module, args, kwargs, output)
        if self._detect.replaying:
            return None
        st = self._tls.st
        if not st.recording and st.depth > 1:  # an inner call of an unsampled batch: nothing to do
            st.depth -= 1
            return None
        if st.quiet and module is not st.entry:  # a hook still on in a quiet batch: its pre-hook did not count
            return None
        outside_backward = _graph_task() == -1  # inside: checkpoint recomputation, not a batch
        try:
            rec = st.rec
            if graph_stats.ON and st.recording and outside_backward and rec is not None \
                    and (graph_stats.pending() or self._info.is_root):
                self._read_graph_rows(rec)
            if not st.recording:  # the outermost call of an unsampled batch (inner ones returned above)
                if outside_backward and rec is not None and _tracing() is None:
                    self._check_unsampled(st, args, kwargs, output)
            # (jit.trace: an op run here would be traced into its graph)
            elif self._info.recorded and outside_backward and _tracing() is None:
                rec = st.rec  # (as the graph rows' read left it)
                assert rec is not None  # (a call of an open batch)
                self._record(rec, args, kwargs, output)
        finally:  # a detection in the outermost frame must still end the batch
            st.depth -= 1
            if st.depth <= 0:
                self._end_outermost(st, outside_backward, output)
        return None

    def _traced(self, module: Optional[torch.nn.Module], args: Tuple[Any, ...], kwargs: Dict[str, Any],
                output: Any) -> None:
        """Traced into a graph by dynamo: its ops write a row (core/measure/graph_stats.py), or an op runs
        this hook at run time (core/frames/compiled.py)."""
        row_id = self._row_id
        if module is not None and row_id is not None and writes_rows(row_id, args):
            traced_row(module, row_id, self._params, args, kwargs, output)
        elif self._slot is not None:
            traced_post(self._slot, args, kwargs, output)

    def _read_graph_rows(self, rec: Record) -> None:
        """The frames measured inside graphs that ran before this call returned (for the model's
        own call: its submodules'; else a call run eagerly between graphs), read when some graph
        wrote rows since the last read, or, at the model's own call, rows may wait unsaid."""
        life = self._life
        if (graph_stats.pending() or life.rows_unseen(rec)) and life.graph_active:
            life.graph_frames(rec)

    def _check_unsampled(self, st: ThreadBatch, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
        """The outermost call of a batch that records no frame: its output checked (timed by the
        budget)."""
        budget = self._budget
        t0 = budget.clock() if budget is not None else 0.0
        self._life.check_output(st, self._info, args, kwargs, output, self._take)
        if budget is not None:
            budget.spend(t0)

    def _record(self, rec: Record, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
        """The call's frame into `rec` (timed by the budget): taken without autograd, through
        what torch.func's tensors wrap; its activations' gradients hooked with gradients=True; a
        module check after it with check="module"."""
        budget = self._budget
        t0 = budget.clock() if budget is not None else 0.0
        info = self._info
        try:
            grad = _grad_enabled()
            _set_grad(False)  # (torch.no_grad() without its three Python calls)
            wrapped = _transforms()  # torch.func's tensors: measured through what they wrap
            try:
                if wrapped:
                    self._life.take_unwrapped(rec, info, args, kwargs, output)
                else:
                    self._take(rec, info, args, kwargs, output)
            finally:
                _set_grad(grad)
            if grad and self._grad_acts and not wrapped:
                self._backward.hook_activations(info, args, output)
        except Exception as exc:  # a frame we cannot take must not stop training
            self._life.hook_failed(info, exc)
        if self._check_module:
            self._life.check_module(rec, rec.frame_count - 1)
        elif rec.stat_count > _MAX_PENDING:
            rec.readback()
        if budget is not None:
            budget.spend(t0)

    def _end_outermost(self, st: ThreadBatch, outside_backward: bool, output: Any) -> None:
        """The outermost watched call returned: the batch's call ends (outside a backward)."""
        st.depth = 0
        if outside_backward and st.rec is not None:
            self._life.end_call(st, self._info.is_root, output)


run_eagerly_when_called_eagerly(ForwardHook.__call__.__code__)
