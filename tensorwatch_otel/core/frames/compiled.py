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

import functools
import importlib
import itertools
import logging
import threading
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import torch

from ..measure import graph_stats
from .copies import Hook, ModuleHook, Unwatched
from ..measure.device_path import immediate
from ..errors import AbortAfterBatch, NonFiniteDetected
from ..process import said_once

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from typing import Protocol

    class SlotOwner(Protocol):
        """What the ops read of a watcher (core/watcher.py's Watcher)."""

        @property
        def attached(self) -> bool: ...

# The watcher's eager hooks, as the ops call them: the module is None once it was freed.
EagerPreHook = Callable[[Optional[torch.nn.Module], Tuple[Any, ...]], object]
EagerPostHook = Callable[[Optional[torch.nn.Module], Tuple[Any, ...], Dict[str, Any], Any], object]
_F = TypeVar("_F", bound=Callable[..., object])

_MAX_ITEMS = 256  # as recorder.MAX_ITEMS: values looked at per container
_MAX_DEPTH = 6  # as recorder.MAX_DEPTH

# Ordering token: every op reads and writes it, so the ops keep the order the hooks ran in.
_TOKEN = torch.zeros(1)


class _Other:
    """Stands, at run time, for a value that is not a tensor, None or a container (noted as such)."""

    __slots__ = ()


_OTHER = _Other()


def _nothing() -> None:
    return None


def _weak(fn: Optional[_F]) -> Callable[[], Optional[_F]]:
    """A weak reference to a hook (held by its module while registered): the global slot table
    must not keep a watcher, its model and its sinks alive."""
    if fn is None:
        return _nothing
    return weakref.WeakMethod(fn) if hasattr(fn, "__self__") else weakref.ref(fn)


class _Slot:
    """What one op call site runs: the watcher's eager pre-hook and hook for one module, each
    held weakly (`s.pre()` is the pre-hook, or None once it is gone)."""

    __slots__ = ("watcher", "module", "pre", "post")

    def __init__(self, watcher: SlotOwner, module: torch.nn.Module, pre: EagerPreHook, post: Optional[EagerPostHook]):
        self.watcher = weakref.ref(watcher)
        self.module = weakref.ref(module)
        self.pre = _weak(pre)
        self.post = _weak(post)


class SlotTable:
    """Slot number -> its _Slot, for every watcher of the process. A number taken by a graph
    stays meaningful after its slot is released: it still names its module, so a graph traced
    for a watcher since detached, and reused for a new watcher of the same module, reaches the
    new watcher's slot."""

    def __init__(self) -> None:
        self._slots: Dict[int, _Slot] = {}
        self._module_of: Dict[int, "weakref.ref[torch.nn.Module]"] = {}
        self._by_module: "weakref.WeakKeyDictionary[torch.nn.Module, List[int]]" = weakref.WeakKeyDictionary()
        self._ids = itertools.count(1)

    def new(self, watcher: SlotOwner, module: torch.nn.Module, pre: EagerPreHook, post: Optional[EagerPostHook]) -> int:
        slot = next(self._ids)
        if slot % 1024 == 0:
            self._forget_freed()
        self._slots[slot] = _Slot(watcher, module, pre, post)
        self._module_of[slot] = weakref.ref(module)
        self._by_module.setdefault(module, []).append(slot)
        return slot

    def _forget_freed(self) -> None:
        """Drops the slots of modules freed since (a model dropped without detach(): its slots
        would keep its watcher and sinks alive)."""
        for k in [k for k, ref in self._module_of.items() if ref() is None]:
            del self._module_of[k]
            self._slots.pop(k, None)

    def release(self, slot: int) -> None:
        s = self._slots.pop(slot, None)
        if s is not None:
            m = s.module()
            live = self._by_module.get(m) if m is not None else None
            if live is not None and slot in live:
                live.remove(slot)

    def set_post(self, slot: int, post: EagerPostHook) -> None:
        self._slots[slot].post = _weak(post)

    def of_watcher(self, watcher: object) -> List[_Slot]:
        """The live slots whose hooks are `watcher`'s (benchmarks time them)."""
        return [s for s in self._slots.values() if s.watcher() is watcher]

    def live(self, slot: int) -> List[_Slot]:
        """The slots an op of number `slot` runs: its own, or, released, its module's live ones."""
        s = self._slots.get(slot)
        if s is not None:
            return [s]
        ref = self._module_of.get(slot)
        m = ref() if ref is not None else None
        if m is None:
            return []
        return [self._slots[i] for i in self._by_module.get(m, ()) if i in self._slots]


SLOTS = SlotTable()


class SlotHandle:
    """Releases a slot when the watcher removes its hooks (a RemovableHandle's shape)."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def remove(self) -> None:
        SLOTS.release(self.slot)


def new_slot(watcher: SlotOwner, module: torch.nn.Module, pre: EagerPreHook,
             post: Optional[EagerPostHook] = None) -> int:
    return SLOTS.new(watcher, module, pre, post)


def set_post(slot: int, post: EagerPostHook) -> None:
    SLOTS.set_post(slot, post)


_live = SLOTS.live


# ------------------------------------------------------------------------------ the ops
def _op_failed(exc: Exception) -> None:
    """An error of ours inside a compiled graph: logged once, the graph goes on."""
    if said_once("compiled op failed"):
        log.error("tensorwatch_otel: recording inside a compiled graph failed (%s: %s); training goes on",
                  type(exc).__name__, exc)


class _Open(threading.local):
    """The calling thread's module calls whose pre op ran and whose post op has not yet."""

    def __init__(self) -> None:
        self.stack: List[_Slot] = []


OPEN = _Open()


def _unwind(stack: List[_Slot], lo: int) -> None:
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
    spec = _spec(args, tensors, 0) + _spec(kwargs, tensors, 0) + _spec(output, tensors, 0)
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
        self._row_id = row_id  # its forward hook's (batch_lifecycle.ForwardHook)

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
for _hook in (PreHook, Hook, Unwatched):  # (batch_lifecycle.ForwardHook is marked where it is defined)
    run_eagerly_when_called_eagerly(_hook.__call__.__code__)


def traced_post(slot_t: torch.Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: object) -> None:
    """Called by a hook while dynamo traces: the op call that runs it at run time, with the
    module's tensors and the structure around them (a constant of the graph)."""
    if _exporting():
        return
    tensors: List[torch.Tensor] = []
    spec = _spec(args, tensors, 0) + _spec(kwargs, tensors, 0) + _spec(output, tensors, 0)
    torch.ops.tensorwatch.post(_TOKEN, slot_t, spec, tensors)


def _spec(v: object, tensors: List[torch.Tensor], depth: int) -> str:
    """The structure of `v` as a string; its tensors appended to `tensors` in walk order. Kept
    to what dynamo folds into constants: isinstance, string concatenation, len."""
    if isinstance(v, torch.Tensor):
        tensors.append(v)
        return "T"
    if v is None:
        return "N"
    if depth >= _MAX_DEPTH:
        return "X"
    if isinstance(v, (tuple, list)):
        s = "("
        for x in v[:_MAX_ITEMS]:
            s = s + _spec(x, tensors, depth + 1)
        return s + ")"
    if isinstance(v, dict):
        s = "{"
        n = 0
        for k, x in v.items():
            if n >= _MAX_ITEMS:
                break
            n += 1
            key = k if isinstance(k, str) else str(k)
            s = s + str(len(key)) + ":" + key + _spec(x, tensors, depth + 1)
        return s + "}"
    return "X"


# ------------------------------------------------------------------------------ run-time side
# One parsed value: ("T",), ("N",), ("X",), ("(", [node, ...]) or ("{", [(key, node), ...]).
_Node = Tuple[Any, ...]


def rebuild(spec: str, tensors: List[torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any], object]:
    """(args, kwargs, output) of the hooked call, the real tensors in place as fresh aliases."""
    parsed = parsed_spec(spec)
    it = iter(_fresh(tensors))
    args, kwargs, output = (_fill(p, it) for p in parsed)
    return args, kwargs, output


@functools.lru_cache(maxsize=4096)
def parsed_spec(spec: str) -> Tuple[_Node, ...]:
    """`spec`'s parsed form (one spec per call site)."""
    return _parse(spec, 0)[0]


def _fresh(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """A new alias (same storage, same values) of each distinct tensor of one op call.

    Inductor reuses a buffer whose value is dead for a later value, keeping the Python tensor
    object and writing it from its kernels without moving `_version`: the graph's tensor of one
    module call can be the very object, at the very version, of an earlier call's different
    value. The recorder's caches know a tensor by identity and version, so handed the graph's
    own objects they would serve the earlier value's statistics. An alias lives for one op call
    only: a tensor seen twice in one call (a module returning its input) is still measured once,
    and nothing is carried from one call to the next."""
    out: List[torch.Tensor] = []
    seen: Dict[int, torch.Tensor] = {}
    for t in tensors:
        a = seen.get(id(t))
        if a is None:
            a = seen[id(t)] = t.detach()
        out.append(a)
    return out


def _parse(spec: str, i: int) -> Tuple[Tuple[_Node, ...], int]:
    """Parses the three values at spec[i:]: ("T",), ("N",), ("X",), ("(", items), ("{", [(k, v)])."""
    out: List[_Node] = []
    for _ in range(3):
        v, i = _parse_one(spec, i)
        out.append(v)
    return tuple(out), i


def _parse_one(spec: str, i: int) -> Tuple[_Node, int]:
    c = spec[i]
    if c in "TNX":
        return (c,), i + 1
    if c == "(":
        i += 1
        items: List[_Node] = []
        while spec[i] != ")":
            v, i = _parse_one(spec, i)
            items.append(v)
        return ("(", items), i + 1
    if c == "{":
        i += 1
        pairs: List[Tuple[str, _Node]] = []
        while spec[i] != "}":
            colon = spec.index(":", i)
            n = int(spec[i:colon])
            key = spec[colon + 1:colon + 1 + n]
            v, i = _parse_one(spec, colon + 1 + n)
            pairs.append((key, v))
        return ("{", pairs), i + 1
    raise ValueError(f"tensorwatch_otel: bad traced structure at {i}: {spec!r}")


def _fill(p: _Node, it: Iterator[torch.Tensor]) -> Any:  # a tensor, None, _OTHER, tuple or dict
    c = p[0]
    if c == "T":
        return next(it)
    if c == "N":
        return None
    if c == "X":
        return _OTHER
    if c == "(":
        return tuple(_fill(x, it) for x in p[1])
    return {k: _fill(x, it) for k, x in p[1]}


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
