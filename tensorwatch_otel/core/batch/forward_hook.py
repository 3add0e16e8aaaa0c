"""A watched module's forward hook (`ForwardHook`): the watcher's hot path, run at every watched
call's return. It records the call's frame into the calling thread's batch, checks the outermost
call of an unsampled batch, and hands the batch's end to the lifecycle (core/batch/lifecycle.py),
which makes every phase change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Protocol, Tuple

import torch

from ..measure import graph_stats
from ..frames import transforms
from ..frames.compiled import run_eagerly_when_called_eagerly, slot_tensor, traced_here, traced_post, traced_row, \
    writes_rows
from ..frames.copies import ModuleHook
from ..record import Record
from ..frame_draft import ModuleInfo
from .thread_batch import PerThread, ThreadBatch

if TYPE_CHECKING:  # pragma: no cover
    from ..frames.backward import BackwardRecorder
    from .detection import DetectionPipeline
    from .sampling import FixedSampling, OverheadBudget

_MAX_PENDING = 2_000_000  # stat slots held before an early read-back (no root forward seen)

#: How a hook takes a call's frame into a record: (record, module info, args, kwargs, output).
Take = Callable[[Record, ModuleInfo, Tuple[Any, ...], Dict[str, Any], Any], None]


class HookLifecycle(Protocol):
    """What a forward hook asks of the lifecycle that made it (core/batch/lifecycle.py's
    BatchLifecycle): the batch's in-graph rows, the unsampled call's check, the frames it cannot
    take itself, and the outermost call's end."""

    @property
    def graph_active(self) -> bool: ...

    def rows_unseen(self, rec: Record) -> bool: ...

    def graph_frames(self, rec: Record) -> None: ...

    def check_output(self, st: ThreadBatch, info: ModuleInfo, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                     output: Any, take: Take) -> None: ...

    def take_unwrapped(self, rec: Record, info: ModuleInfo, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                       output: Any) -> None: ...

    def hook_failed(self, info: ModuleInfo, exc: Exception) -> None: ...

    def check_module(self, rec: Record, first: int) -> None: ...

    def end_call(self, st: ThreadBatch, root: bool, output: Any) -> None: ...


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

    __slots__ = ("_life", "_info", "_slot", "_take", "_own_grad", "_tls", "_detect", "_backward", "_check_module",
                 "_grad_acts", "_budget", "_row_id", "_params", "_pre")

    def __init__(self, life: HookLifecycle, info: ModuleInfo, slot: int, take: Take, tls: PerThread,
                 detect: DetectionPipeline, backward: BackwardRecorder, *, check_module: bool, grad_acts: bool,
                 budget: "FixedSampling | OverheadBudget | None", take_turns_grad_off: bool = False) -> None:
        super().__init__()
        self._life = life
        self._info = info
        self._slot = slot_tensor(slot) if slot else None  # (its op slot, as the ops take it)
        self._take = take
        # `take` turns autograd off itself where it needs it (FrameRecorder.frame): not turned off here
        self._own_grad = take_turns_grad_off
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
    def lifecycle(self) -> HookLifecycle:
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
            wrapped = _transforms()  # torch.func's tensors: measured through what they wrap
            if self._own_grad and not wrapped:
                self._take(rec, info, args, kwargs, output)
                if self._grad_acts and _grad_enabled():
                    self._backward.hook_activations(info, args, output)
            else:
                grad = _grad_enabled()
                _set_grad(False)  # (torch.no_grad() without its three Python calls)
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
