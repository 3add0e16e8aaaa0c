"""The compiled front end: watcher hooks that torch.compile traces into its graph call one custom
op per hook; the op's Python body runs the eager hook at run time, on the graph's real tensors.

Dynamo traces the forward hooks and pre-hooks registered on a module into the graph of the code
that calls it. Traced, a hook only adds a call to `tensorwatch::pre` or `tensorwatch::post`
with its slot number (which watcher, which module), the module's input and output tensors and a
spec string describing the structure around them (tuples, dicts, None, other values). At run
time the op rebuilds that structure around the real tensors and calls the watcher's eager hook,
so a compiled call fills the same Record as an eager one: same frames, names, caches, batch
boundaries and detection, with nothing to read inside the graph. Every op mutates one token
tensor, which keeps them in call order and keeps them from being removed as dead code; being
opaque to inductor, they run between the fused kernels, on the values those produced.
"""

from __future__ import annotations

import importlib
import logging
import threading
import types
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..measure import graph_stats
from .copies import Hook, ModuleHook, Unwatched
from .op_slots import SLOTS, EagerPreHook, Slot
from .op_spec import rebuild, spec_of
from ..measure.device_path import immediate
from ..errors import AbortAfterBatch, NonFiniteDetected
from ..process import said_once

log = logging.getLogger(__name__)

# Ordering token: every op reads and writes it, so the ops keep the order the hooks ran in.
_TOKEN = torch.zeros(1)


_live = SLOTS.live  # (a module-level alias: one lookup fewer per op call)


# ------------------------------------------------------------------------------ the ops
def _op_failed(exc: Exception) -> None:
    """An error of ours inside a compiled graph: logged once, the graph goes on."""
    if said_once("compiled op failed"):
        log.error("tensorwatch_otel: recording inside a compiled graph failed (%s: %s); training goes on",
                  type(exc).__name__, exc)


class _Open(threading.local):
    """The calling thread's module calls whose pre op ran and whose post op has not yet."""

    def __init__(self) -> None:
        self.stack: List[Slot] = []


OPEN = _Open()


def _unwind(stack: List[Slot], lo: int) -> None:
    """Calls left open by an exception inside a compiled graph (no hook runs there when a
    forward raises, unlike eager's always_call hooks): their hooks run now, innermost first,
    with no values, so the batch ends as it would have in eager mode."""
    while len(stack) > lo:
        s = stack.pop()
        w, post = s.watcher(), s.post()
        if w is None or not w.attached or post is None:
            continue
        try:
            post(s.module(), (), {}, None)
        except (NonFiniteDetected, AbortAfterBatch):
            pass  # the interrupted batch's detection: in the sinks already; the first exception goes on
        except Exception as exc:
            _op_failed(exc)


class _Ran:
    """`.calls`: pre ops run so far (graphs holding a watcher's hooks). Where it moved since a
    watcher began, no unsampled batch of it takes hooks off (core/frames/quiet.py)."""

    calls = 0


ran = _Ran()


def _pre_op(token: torch.Tensor, slot_t: torch.Tensor) -> None:
    ran.calls += 1  # (before the hook: the root's, on an unsampled batch, would take hooks off)
    stack = OPEN.stack
    try:
        for s in _live(int(slot_t)):
            if s in stack:  # its last call never returned (an exception inside the graph)
                _unwind(stack, stack.index(s))
            w, pre = s.watcher(), s.pre()
            if w is not None and w.attached and pre is not None:
                pre(s.module(), ())
                stack.append(s)
    except (NonFiniteDetected, AbortAfterBatch):
        raise  # by design: a stop published by another rank, raised at the batch start
    except Exception as exc:
        _op_failed(exc)


def _pre_fake(token: torch.Tensor, slot_t: torch.Tensor) -> None:
    return None


def _post_op(token: torch.Tensor, slot_t: torch.Tensor, spec: str, tensors: List[torch.Tensor]) -> None:
    try:
        live = _live(int(slot_t))
        if not live:
            return
        try:
            args, kwargs, output = rebuild(spec, tensors)
        except Exception as exc:  # the hook still runs (no values): the batch still ends
            _op_failed(exc)
            args, kwargs, output = (), {}, None
        stack = OPEN.stack
        for s in live:
            if stack and stack[-1] is s:
                stack.pop()
            w, post = s.watcher(), s.post()
            if w is not None and w.attached and post is not None:
                with immediate():  # (the graph's buffers are reused as it goes on: measured now)
                    post(s.module(), args, kwargs, output)
    except (NonFiniteDetected, AbortAfterBatch):
        _unwind(OPEN.stack, 0)  # the enclosing calls end, as eager's always_call hooks end them
        raise  # by design: the detection (on_detect="raise") leaves the compiled call
    except Exception as exc:
        _op_failed(exc)


def _post_fake(token: torch.Tensor, slot_t: torch.Tensor, spec: str, tensors: List[torch.Tensor]) -> None:
    return None


def _define_ops() -> "torch.library.Library":
    """`tensorwatch::pre` and `tensorwatch::post`, defined by schema with one kernel for every
    backend (CompositeExplicitAutograd) and a fake for tracing. Not `torch.library.custom_op`:
    its Python autograd, ADInplaceOrView and default-filling layers cost half of a compiled
    module call's whole cost (docs/performance.md, "Figures behind the code"), where the dispatcher's own
    fallthroughs do the same for an op that returns nothing. The token is declared mutated, so
    the ops keep their order and are not dropped as dead code. The slot is a 0-d CPU tensor the
    hook holds (`slot_tensor`): data of the graph, not a constant dynamo would guard on, so
    modules sharing their code share one graph with the ops too."""
    lib = torch.library.Library("tensorwatch", "DEF")
    lib.define("pre(Tensor(a!) token, Tensor slot) -> ()")
    lib.define("post(Tensor(a!) token, Tensor slot, str spec, Tensor[] tensors) -> ()")
    lib.impl("pre", _pre_op, "CompositeExplicitAutograd")
    lib.impl("post", _post_op, "CompositeExplicitAutograd")
    torch.library.register_fake("tensorwatch::pre", _pre_fake, lib=lib)
    torch.library.register_fake("tensorwatch::post", _post_fake, lib=lib)
    return lib


_LIB = _define_ops()


# ------------------------------------------------------------------------------ traced side
@graph_stats.constant_result
def _graph_holds_hooks() -> bool:
    """At trace time: a graph traced a watcher's submodule hooks as rows (core/measure/graph_stats.py);
    `ran` moves, so unsampled batches keep the hooks on."""
    ran.calls += 1
    return True


def writes_rows(row_id: Optional[torch.Tensor], args: Tuple[Any, ...]) -> bool:
    """At trace time, asked alike by a submodule's pre-hook and forward hook: the call writes a
    row of in-graph statistics (core/measure/graph_stats.py) instead of calling the ops: in-graph
    statistics are on, the hook has a row id (see ForwardHook), the model's own hooks are not
    traced here, graphs on its device measure inside, and the call's first tensor input, if
    any, is on that device. Read from the row id's device and the call's values only: modules
    sharing their code decide alike (no constant of a module's own, which dynamo would guard)."""
    if not graph_stats.ON or row_id is None or not graph_stats.rows_here(row_id.device.type):
        return False
    for a in args:
        if isinstance(a, torch.Tensor):
            return bool(a.device == row_id.device)
    return True


def traced_row(module: torch.nn.Module, row_id: torch.Tensor, params: str, args: Tuple[Any, ...],
               kwargs: Dict[str, Any], output: object) -> None:
    """Called by a submodule's forward hook while dynamo traces, where `writes_rows`: the aten
    ops that write the call's row (graph_stats.traced_site). `params`: the module's parameter
    names, comma-separated (a string: equal for modules sharing their code)."""
    if _exporting():
        return
    tensors: List[torch.Tensor] = []
    spec = spec_of(args, tensors, 0) + spec_of(kwargs, tensors, 0) + spec_of(output, tensors, 0)
    names = tuple(params.split(",")) if params else ()
    # each parameter read by name from the module (as its forward reads it): no guard on the
    # dict's keys
    held = module._parameters
    found = [(k, held[k]) for k in names]
    graph_stats.traced_site(row_id, spec, tuple(k for k, p in found if p is not None),
                            [p for _, p in found if p is not None], tensors)
    _graph_holds_hooks()


def _device_type(args: Tuple[Any, ...]) -> str:
    """The device type of a call's first positional tensor ("" for none): traced, a constant."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return ""


@graph_stats.constant_result
def traced_here() -> bool:
    """Whether dynamo is tracing in this thread; asked after `torch.compiler.is_compiling()`.

    That flag is the process's: while one thread traces a graph it is True in every thread, so a
    hook running eagerly in another thread would take itself for traced (its call then left
    unrecorded and its batch open: batches lost whenever a graph compiled while other threads
    ran, measured with threads and shapes recompiling under dynamic=False). At trace time dynamo
    runs this once and keeps its True; called eagerly it reads the thread's tracing context."""
    try:
        return torch._guards.TracingContext.try_get() is not None
    except Exception:  # (a torch without it: the flag alone, as before)
        return True


def compiling_here() -> bool:
    """`torch.compiler.is_compiling()` for this thread only (see `traced_here`)."""
    return torch.compiler.is_compiling() and traced_here()


def _exporting() -> bool:
    """True while torch.export traces, False while torch.compile does, both at trace time.

    Not `torch.compiler.is_exporting()`: dynamo folds that call to a constant, and before torch
    2.13 the constant is True under torch.compile too (measured on 2.11: every hook inside a
    compiled model dropped its op, the model silently unwatched but for the root). The flag it
    returns is read as a global instead, which dynamo reads for what it is (and guards on)."""
    if _EXPORTING_FLAG:
        return bool(torch.compiler._is_exporting_flag)
    return torch.compiler.is_exporting()


_EXPORTING_FLAG = hasattr(torch.compiler, "_is_exporting_flag")


def slot_tensor(slot: int) -> torch.Tensor:
    """The op slot `slot` as the ops take it: a 0-d int64 CPU tensor."""
    return torch.tensor(slot, dtype=torch.int64)


def traced_pre(slot_t: torch.Tensor) -> None:
    """Called by a pre-hook while dynamo traces: the op call that runs it at run time (none in
    a torch.export: an exported program is not this process's to watch)."""
    if not _exporting():
        torch.ops.tensorwatch.pre(_TOKEN, slot_t)


class _EagerCodes:
    """Hook code objects to mark for dynamo (see run_eagerly_when_called_eagerly): kept until
    dynamo is loaded at the first watch() (`configure`), marked at once after."""

    def __init__(self) -> None:
        self.codes: List[types.CodeType] = []
        self.configured = False

    def add(self, code: types.CodeType) -> None:
        self.codes.append(code)
        if self.configured:
            _mark_eager([code])

    def configure(self) -> bool:
        """Marks the codes kept so far; False when it ran before."""
        if self.configured:
            return False
        self.configured = True
        _mark_eager(self.codes)
        return True


EAGER = _EagerCodes()


def run_eagerly_when_called_eagerly(code: types.CodeType) -> None:
    """Marks a hook's code so that dynamo never compiles it as a frame of its own.

    Called from a module's eager `__call__` (the root of `torch.compile(model)`, whose
    `_call_impl` dynamo does not trace, or a compiled submodule), a hook is a top-level frame
    that dynamo would compile into a one-op graph guarded on the input's shape: a frame and a
    recompile per shape under `dynamic=False`, for nothing, since the hook then holds real
    tensors and runs its eager body anyway. Skipped as a top-level frame (with all it calls), it
    runs eagerly; traced from inside a graph (inlined), it is traced as before. Marked at the
    first watch() (loading dynamo takes about a second: not at import)."""
    EAGER.add(code)


def _mark_eager(codes: List[types.CodeType]) -> None:
    try:
        eval_frame = importlib.import_module("torch._dynamo.eval_frame")
        dynamo_types = importlib.import_module("torch._dynamo.types")  # (both private: looked up)
        skip = dynamo_types.FrameAction.SKIP
        # SKIP for the frames it calls as well: its eager body (recording, the batch's end,
        # the sinks) is no code for dynamo to compile
        for code in codes:
            eval_frame.set_code_exec_strategy(code, dynamo_types.FrameExecStrategy(skip, skip))
    except Exception as exc:  # a torch without it: the hooks are compiled as before
        log.debug("tensorwatch_otel: cannot mark hooks eager-only for dynamo: %s", exc)


class PreHook(ModuleHook):
    """The forward pre-hook registered on a module: the eager one, or its op while traced. The
    root's, run eagerly (a compiled model watched through its wrapper), first ends the calls an
    exception left open inside the last compiled call. Copied with its module, it is a no-op
    (core/frames/copies.py)."""

    __slots__ = ("_slot", "_eager", "_is_root", "_row_id")

    def __init__(self, slot: int, eager: EagerPreHook, is_root: bool = False,
                 row_id: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self._slot = slot_tensor(slot)
        self._eager = eager
        self._is_root = is_root
        self._row_id = row_id  # its forward hook's (core/batch/forward_hook.py's ForwardHook)

    def rehome(self, row_id: Optional[torch.Tensor]) -> None:
        """The row id its forward hook now has (its module moved to another device)."""
        self._row_id = row_id

    def __call__(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None
                 ) -> object:
        # (registered with_kwargs: its id stays taken in the module's kwargs dict while quiet
        # batches have it off, core/frames/attach.py; `kwargs` is not read)
        if _compiling() and traced_here():
            if self._is_root:
                if graph_stats.ON:
                    graph_stats.mark_root_traced()
            elif writes_rows(self._row_id, args):
                return None  # its forward hook writes the call's row (core/measure/graph_stats.py)
            traced_pre(self._slot)
            return None
        if self._is_root and OPEN.stack:
            _unwind(OPEN.stack, 0)
        return self._eager(module, args)


_compiling = torch.compiler.is_compiling
for _hook in (PreHook, Hook, Unwatched):  # (core/batch/forward_hook.py's ForwardHook is marked where it is defined)
    run_eagerly_when_called_eagerly(_hook.__call__.__code__)


def traced_post(slot_t: torch.Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: object) -> None:
    """Called by a hook while dynamo traces: the op call that runs it at run time, with the
    module's tensors and the structure around them (a constant of the graph)."""
    if _exporting():
        return
    tensors: List[torch.Tensor] = []
    spec = spec_of(args, tensors, 0) + spec_of(kwargs, tensors, 0) + spec_of(output, tensors, 0)
    torch.ops.tensorwatch.post(_TOKEN, slot_t, spec, tensors)


# ------------------------------------------------------------------------------ dynamo's settings


def hook_guards() -> None:
    """Hooks added or removed after a graph was compiled are ignored by that graph under torch's
    default (`skip_nnmodule_hook_guards=True`, no guard on the hook dicts), and a hooked module
    compiled after a hook-less one of the same class reuses the hook-less graph: either leaves a
    compiled model silently unwatched. Turned off once per process, said at INFO."""
    if not EAGER.configure():
        return
    graph_stats.configure()
    try:
        import torch._dynamo
        from torch._dynamo.utils import counters
        cfg = torch._dynamo.config
        if not getattr(cfg, "skip_nnmodule_hook_guards", False):
            return
        cfg.skip_nnmodule_hook_guards = False
        # graphs compiled before now hold no guard on hooks: they would run on, unwatched
        stale = counters["stats"]["unique_graphs"] > 0
        if stale:
            torch._dynamo.reset()
        log.info("tensorwatch_otel: set torch._dynamo.config.skip_nnmodule_hook_guards = False, so that "
                 "compiled graphs see the watcher's hooks added or removed (at most one recompile per "
                 "watch() or detach())%s", "; the graphs compiled before the first watch() were dropped "
                 "(torch._dynamo.reset()) and compile again at their next call" if stale else "")
    except Exception as exc:  # no dynamo (a torch without it): nothing is compiled
        log.debug("tensorwatch_otel: torch._dynamo not available: %s", exc)
