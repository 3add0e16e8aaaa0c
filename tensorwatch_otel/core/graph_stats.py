"""Statistics inside the compiled graph: on by default for graphs on the CPU
(TENSORWATCH_GRAPH_STATS: ``cpu``, ``1`` for every device, ``0`` off).

With it, a watched submodule's forward hook traced by dynamo adds no op with a Python body:
it adds plain aten ops that take each of the call's tensors' abs min and abs max (its
parameters, inputs and output, as float64: exact for every float and integer dtype up to 2**53)
and a sequence number from a one-element device counter the call bumps, stacked into one small
tensor that the graph returns and dynamo stores on the call's *site* (`site.value = ...`, done
after the graph by the code dynamo generates around it). A site is one traced call: its
module's op slot and the structure of its values, fixed when the graph is traced (`_new_site`,
run by dynamo at trace time only); sites are found by number in a dict that only grows, and
dynamo guards on each site object alone, so a new graph adds no recompile to the others.
Inductor fuses the reductions into the kernels around them; nothing runs in Python per module
call but that store.

At run time the sites' values are cleared when a recorded batch begins, and read when the
model's own call returns: the sites holding a value ran in this batch, and become its frames in
the order of their sequence numbers (graph breaks and recompiles keep it), named as eager
watching names them; their values reach the host in one copy per device.

Only where the model's own hooks run eagerly around the graph (under `torch.compile(model)`,
`watch(torch.compile(m))` and `model.compile()` alike, on the torch versions tested): their pre-
and post-hooks begin and end the batch. A graph that traced them (`mark_root_traced`), and a
watcher with `target_dtypes`, `gradients=True` or `check="module"`, keep the ops of
core/compiled.py."""

import os
import threading
import types
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import naming
from .env import GRAPH_STATS_MODES, ConfigError, graph_stats_mode
from .events import NOTE_NONE, NOTE_NOT_TENSOR

_F = Any
_TRACE_TIME: List[Any] = []  # the functions dynamo must run at trace time (configure())


def constant_result(fn: _F) -> _F:
    """Marks `fn` for `configure()`: torch._dynamo.assume_constant_result (dynamo runs the
    function at trace time and keeps its result as a constant of the graph), applied when the
    first watch() loads dynamo, not at import (a second)."""
    _TRACE_TIME.append(fn)
    return fn


def configure() -> None:
    """Marks the trace-time functions for dynamo (core/compiled.py's hook_guards(), at the first
    watch(), dynamo loaded)."""
    import torch._dynamo

    for fn in _TRACE_TIME:
        torch._dynamo.assume_constant_result(fn)


#: dtypes measured in the graph (integers widened to int64 before abs(): abs(-128) of an int8
#: is -128; bool read as int32), as the eager routes measure them
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
MEASURED = frozenset(FLOATS + INTEGERS + (torch.bool,))

# one value's place in a site's layout: "m" measured, "e" empty, or an Other note
_MEASURED, _EMPTY = "m", "e"


def mode() -> str:
    """TENSORWATCH_GRAPH_STATS (core/env.py): ``cpu`` (default), ``1`` or ``0``. A bad value reads
    as the default here; `watch()` raises on it, naming the variable (core/config.py)."""
    try:
        return graph_stats_mode(os.environ)
    except ConfigError:
        return GRAPH_STATS_MODES[0]


_MODE = mode()
#: On or off for the process (from the environment at import; tests set it). Dynamo guards on it:
#: a graph traced with one setting is traced again under the other.
ON = _MODE != "0"
#: Graphs on every device (``1``), not only on the CPU (the default: in-graph statistics have not
#: yet been verified on a GPU, where CUDA graphs reuse the memory of a graph's outputs).
EVERY_DEVICE = _MODE == "1"


def device_allowed(device_type: str) -> bool:
    """At trace time: graphs on this device type measure inside the graph."""
    return EVERY_DEVICE or device_type == "cpu"


class Site:
    """One traced call: its module's op slot, the structure of its inputs and output (core/
    compiled.py's spec), its parameter names, per value its kind and dtype name; `value`, set
    after each run of its graph: two float64 values per measured value, then the sequence
    number (None: not run since the recorded batch began)."""

    __slots__ = ("device", "slot", "spec", "params", "kinds", "dtypes", "value", "rows")

    def __init__(self, device: torch.device, slot: int, spec: str, params: Tuple[str, ...], kinds: str,
                 dtypes: Tuple[str, ...]) -> None:
        self.device = device
        self.slot = slot
        self.spec = spec
        self.params = params
        self.kinds = kinds
        self.dtypes = dtypes
        self.value: Optional[torch.Tensor] = None
        self.rows: Optional[List[Tuple[str, str, str]]] = None  # layout(), made once

    def layout(self, kw_names: Dict[str, str], parse: Callable[[str], Tuple[Any, ...]]
               ) -> List[Tuple[str, str, str]]:
        """`names(self, kw_names, parse(self.spec))`, made once (the module's keyword names are
        its own; `parse`: core/compiled.py's spec parser)."""
        rows = self.rows
        if rows is None:
            rows = self.rows = names(self, kw_names, parse(self.spec))
        return rows


class _Sites:
    """The process's sites by number, and one sequence counter per device. Graphs reach a site
    and a counter as attributes of `holders` (a module object: dynamo reads a module's attribute
    afresh and guards on it alone; a dict grown while a graph is traced would be read as it was
    when the trace first looked at it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_number: Dict[int, Site] = {}
        self.counters: Dict[torch.device, torch.Tensor] = {}
        self.holders = types.ModuleType("tensorwatch_otel_graph_sites")
        self.dirty = False  # a site holds a value not read yet (set by the graphs' own code)

    def add(self, site: Site) -> int:
        with self.lock:
            if site.device not in self.counters:
                counter = torch.zeros(1, dtype=torch.float64, device=site.device)
                try:  # a fixed address: CUDA graphs (mode="reduce-overhead") may write it in place
                    torch._dynamo.mark_static_address(counter)
                except Exception:  # (an older torch: CUDA graphs then skip these graphs)
                    pass
                self.counters[site.device] = counter
                setattr(self.holders, counter_name(site.device), counter)
            number = len(self.by_number)
            self.by_number[number] = site
            setattr(self.holders, f"site_{number}", site)
            return number


def counter_name(device: torch.device) -> str:
    return f"counter_{device.type}_{-1 if device.index is None else device.index}"


SITES = _Sites()


@constant_result
def _new_site(dev_type: str, dev_index: int, slot: int, spec: str, params: Tuple[str, ...], kinds: str,
              dtypes: Tuple[str, ...]) -> int:
    """At trace time only (dynamo runs it once and keeps its result as a constant): the new
    site's number."""
    device = torch.device(dev_type, dev_index) if dev_index >= 0 else torch.device(dev_type)
    return SITES.add(Site(device, slot, spec, params, kinds, dtypes))


def _tracing_context() -> Any:
    try:
        return torch._guards.TracingContext.try_get()
    except Exception:
        return None


class _RootTraced:
    """The tracing contexts (one per graph being traced) that traced the model's own hooks."""

    def __init__(self) -> None:
        self._contexts: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def add(self, ctx: Any) -> None:
        self._contexts.add(ctx)

    def __contains__(self, ctx: Any) -> bool:
        return ctx in self._contexts


ROOT_TRACED = _RootTraced()


@constant_result
def mark_root_traced() -> bool:
    """At trace time: the model's own hooks are traced into this graph (`model.compile()`), so
    its batch begins and ends inside it: the sites of this graph take the ops instead."""
    ctx = _tracing_context()
    if ctx is not None:
        ROOT_TRACED.add(ctx)
    return True


def root_traced_here() -> bool:
    """At trace time: the graph being traced holds a model's own hooks (or no graph is traced)."""
    ctx = _tracing_context()
    return ctx is None or ctx in ROOT_TRACED


_DTYPE_NAMES = {dt: str(dt).replace("torch.", "") for dt in MEASURED}


def _kind(t: torch.Tensor) -> str:
    if t.dtype not in MEASURED or t.layout is not torch.strided or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return "x"
    if t.numel() == 0:
        return _EMPTY
    return _MEASURED


def traced_site(slot: int, spec: str, names: Tuple[str, ...], params: Sequence[torch.Tensor],
                tensors: Sequence[torch.Tensor]) -> None:
    """While dynamo traces a submodule's forward hook (its pre-hook added nothing): the site's
    aten ops, for its parameters (`params`, named `names`) and the call's tensors. Values on a
    second device, or of a kind the graph does not measure, are kept as not measured ("x").

    One stacked output per site: a graph output per statistic costs more (measured on CPU: an
    allocation each, and the compiled wrapper's Python per output)."""
    values: List[torch.Tensor] = list(params)
    values.extend(tensors)
    device = values[0].device if values else torch.device("cpu")
    kinds = ""
    dtypes: Tuple[str, ...] = ()
    measured: List[torch.Tensor] = []
    for t in values:
        k = _kind(t) if t.device == device else "x"
        kinds = kinds + k
        dtypes = dtypes + (_DTYPE_NAMES.get(t.dtype, "other"),)
        if k == _MEASURED:
            measured.append(t)
    number = _new_site(device.type, -1 if device.index is None else device.index, slot, spec, names, kinds, dtypes)
    holders = SITES.holders
    counter = getattr(holders, counter_name(device))
    stats: List[torch.Tensor] = []
    for t in measured:
        d = t.detach()
        if d.dim() < 4:
            # the same view, by as_strided: inductor stores the tensor first and the reductions
            # read what it stored (fused into the loop that writes it) instead of computing the
            # tensor a second time from its inputs (a GELU's output: erf twice per element).
            # Not for 4-D and 5-D tensors: inductor may keep those in a layout of its own
            # (channels-last around convolutions), and as_strided pins eager's, a copy each.
            d = torch.as_strided(d, d.size(), d.stride())
        if d.dtype is torch.bool:
            d = d.to(torch.int32)  # (inductor on torch 2.13 takes the amin of bool.to(uint8) as 0)
        elif d.dtype in INTEGERS and d.dtype is not torch.uint8:
            d = d.to(torch.int64)
        a = d.abs()
        stats.append(a.amin().to(torch.float64))
        stats.append(a.amax().to(torch.float64))
    counter.add_(1)
    stats.append(counter[0])
    getattr(holders, "site_" + str(number)).value = torch.stack(stats)
    SITES.dirty = True


def begin_batch(sites: Iterable[Site]) -> None:
    """A recorded batch begins: none of `sites` (a watcher's) has run in it yet."""
    for site in sites:
        site.value = None
    SITES.dirty = any(s.value is not None for s in SITES.by_number.values())


def pending() -> bool:
    """Some site ran since its values were last taken (`ran()`, `begin_batch()`)."""
    return SITES.dirty


def has_sites() -> bool:
    return bool(SITES.by_number)


def site_count() -> int:
    return len(SITES.by_number)


def sites_from(number: int) -> List[Site]:
    """The sites numbered `number` and above (those traced since a caller looked last)."""
    by_number = SITES.by_number
    return [by_number[n] for n in range(number, len(by_number))]


def ran(sites: Iterable[Site]) -> List[Tuple[Site, List[float]]]:
    """Of `sites` (a watcher's), those that ran since `begin_batch()` or the
    last call, with their values (one copy per device), in the order they ran; their values are
    taken (a frame recorded eagerly between two graphs reads the first graph's sites before it,
    so the frames keep the order they ran). Other sites keep theirs."""
    done = [s for s in sites if s.value is not None]
    if not done:
        return []
    by_device: Dict[torch.device, List[Site]] = {}  # (each holds a value: `done`)
    for s in done:
        by_device.setdefault(s.device, []).append(s)
    out: List[Tuple[float, Site, List[float]]] = []
    for group in by_device.values():
        values = [s.value for s in group if s.value is not None]
        flat = torch.cat(values).tolist() if len(values) > 1 else values[0].tolist()  # one copy
        at = 0
        for s, v in zip(group, values):
            n = v.numel()
            out.append((flat[at + n - 1], s, flat[at:at + n - 1]))
            at += n
    for s in done:
        s.value = None
    SITES.dirty = any(s.value is not None for s in SITES.by_number.values())
    out.sort(key=lambda r: r[0])
    return [(s, v) for _, s, v in out]


def names(site: Site, kw_names: Dict[str, str], parsed: Tuple[Any, ...]) -> List[Tuple[str, str, str]]:
    """(name, kind, dtype name) of each value of the site in the order eager watching records
    them: parameters, positional inputs, keyword inputs, output. Kind "m" (measured: two values
    in the site's rows), "e" (empty), "x" (not measured in the graph), or a note (None, not a
    tensor) with no dtype. `parsed`: the site's spec parsed (args, kwargs, output)."""
    args, kwargs, output = parsed
    out: List[Tuple[str, str]] = [(p, "") for p in site.params]

    def walk(node: Tuple[Any, ...], name: str) -> None:
        c = node[0]
        if c == "T":
            out.append((name, ""))
        elif c == "N":
            out.append((name, NOTE_NONE))
        elif c == "X":
            out.append((name, NOTE_NOT_TENSOR))
        elif c == "(":
            for i, x in enumerate(node[1]):
                walk(x, naming.child(name, i))
        else:
            for k, x in node[1]:
                walk(x, naming.child(name, k))

    for i, a in enumerate(args[1] if args[0] == "(" else []):
        walk(a, naming.input_name(i))
    for k, v in (kwargs[1] if kwargs[0] == "{" else []):
        walk(v, kw_names.get(k) or f"input.{k}")
    walk(output, "output")
    kinds = iter(zip(site.kinds, site.dtypes))
    rows: List[Tuple[str, str, str]] = []
    for n, note in out:
        if note:
            rows.append((n, note, ""))
        else:
            k, dt = next(kinds)
            rows.append((n, k, dt))
    return rows
