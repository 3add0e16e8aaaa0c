"""Statistics inside the compiled graph (experimental; on with TENSORWATCH_GRAPH_STATS=1).

With it, a watched submodule's forward hook traced by dynamo adds no op with a Python body:
it adds plain aten ops that take each of the call's tensors' abs min and abs max (its
parameters, inputs and output, as float64: exact for every float and integer dtype up to 2**53)
and write them, with a sequence number, into a per-device float64 buffer. Inductor fuses the
reductions into the kernels around them; nothing runs in Python per module call. Each such call
site is a *site*: its place in the buffer, its module's op slot and the structure of its values
are fixed when the graph is traced (`site()`, run by dynamo at trace time only).

At run time the buffer is zeroed when a recorded batch begins (one fill per device) and read
when the model's own call returns (one copy per device): the sites whose sequence number moved
ran in this batch, and become the batch's frames in the order they ran, named as eager watching
names them. The sequence number comes from a device counter each site bumps, so sites of
several graphs (graph breaks, recompiles) keep their order.

Only where the model's own hooks run eagerly (`torch.compile(model)`, `watch(torch.compile(m))`):
their pre- and post-hooks begin and end the batch around the graph. Where they are traced too
(`model.compile()`), the ops of core/compiled.py are used as before. Not measured in the graph:
`target_dtypes` counts, histograms and activation gradients (`gradients=True`); with any of
them the ops are used."""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import naming
from .env import ENV_GRAPH_STATS
from .events import NOTE_NONE, NOTE_NOT_TENSOR

_F = Any


def _constant_result(fn: _F) -> _F:
    """torch._dynamo.assume_constant_result without importing dynamo (a second at import):
    dynamo runs the function at trace time and keeps its result as a constant of the graph."""
    fn._dynamo_marked_constant = True
    return fn


#: rows of each device's buffer (float64): sites beyond it take the ops of core/compiled.py
CAPACITY = 1 << 16

#: dtypes measured in the graph (integers widened to int64 before abs(): abs(-128) of an int8
#: is -128; bool read as int32), as the eager routes measure them
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
MEASURED = frozenset(FLOATS + INTEGERS + (torch.bool,))

# one value's place in a site's layout: "m" measured, "e" empty, or an Other note
_MEASURED, _EMPTY = "m", "e"


def enabled() -> bool:
    """TENSORWATCH_GRAPH_STATS=1 (core/env.py)."""
    return os.environ.get(ENV_GRAPH_STATS, "").strip() == "1"


#: On or off for the process (from the environment at import; tests set it). Dynamo guards on it:
#: a graph traced with one setting is traced again under the other.
ON = enabled()


class Site:
    """One traced call site: its rows `[base, base + width)` in its device's buffer (two per
    measured value, then the sequence number), its module's op slot, the structure of its
    inputs and output (core/compiled.py's spec), its parameter names and per value its kind."""

    __slots__ = ("device", "base", "width", "slot", "spec", "params", "kinds", "dtypes")

    def __init__(self, device: torch.device, base: int, width: int, slot: int, spec: str,
                 params: Tuple[str, ...], kinds: str, dtypes: Tuple[str, ...]) -> None:
        self.device = device
        self.base = base
        self.width = width
        self.slot = slot
        self.spec = spec
        self.params = params
        self.kinds = kinds
        self.dtypes = dtypes


class _Buffers:
    """The process's site table and its per-device buffers and counters."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bufs: Dict[torch.device, torch.Tensor] = {}
        self.counters: Dict[torch.device, torch.Tensor] = {}
        self.used: Dict[torch.device, int] = {}
        self.sites: List[Site] = []
        self.host: Dict[torch.device, torch.Tensor] = {}

    def place(self, device: torch.device, width: int) -> int:
        with self.lock:
            if device not in self.bufs:
                buf = torch.zeros(CAPACITY, dtype=torch.float64, device=device)
                counter = torch.zeros(1, dtype=torch.float64, device=device)
                for t in (buf, counter):
                    try:  # a fixed address: CUDA graphs (mode="reduce-overhead") may write it in place
                        torch._dynamo.mark_static_address(t)
                    except Exception:  # (an older torch: CUDA graphs then skip these graphs)
                        pass
                self.bufs[device] = buf
                self.counters[device] = counter
                self.used[device] = 0
            base = self.used[device]
            if base + width > CAPACITY:
                return -1
            self.used[device] = base + width
            return base


BUFFERS = _Buffers()


@_constant_result
def _new_site(dev_type: str, dev_index: int, slot: int, spec: str, params: Tuple[str, ...], kinds: str,
              dtypes: Tuple[str, ...]) -> int:
    """At trace time only (dynamo runs it once and keeps its result as a constant): a site's
    first row, or -1 when the buffer is full or the model's own hooks are traced in this graph.
    Its rows: two per measured value, then the sequence number."""
    device = torch.device(dev_type, dev_index) if dev_index >= 0 else torch.device(dev_type)
    width = 2 * kinds.count(_MEASURED) + 1
    base = BUFFERS.place(device, width)
    if base < 0:
        from .process import said_once

        if said_once("graph stats full"):
            import logging

            logging.getLogger(__name__).warning(
                "tensorwatch_otel: the in-graph statistics buffer is full (%d rows): calls traced from now on "
                "are not recorded", CAPACITY)
    if base >= 0:
        with BUFFERS.lock:
            BUFFERS.sites.append(Site(device, base, width, slot, spec, params, kinds, dtypes))
        from . import compiled  # (trace time only) graphs hold this watcher's hooks: quiet batches keep them

        compiled.ran.calls += 1
    return base


def _tracing_context() -> Any:
    try:
        return torch._guards.TracingContext.try_get()
    except Exception:
        return None


@_constant_result
def mark_root_traced() -> bool:
    """At trace time: the model's own hooks are traced into this graph (`model.compile()`), so
    its batch begins and ends inside it: the sites of this graph take the ops instead."""
    ctx = _tracing_context()
    if ctx is not None:
        try:
            ctx._tensorwatch_root_traced = True
        except Exception:
            pass
    return True


def _root_traced_here() -> bool:
    ctx = _tracing_context()
    return ctx is None or bool(getattr(ctx, "_tensorwatch_root_traced", False))


@_constant_result
def sites_here(slot: int) -> bool:
    """At trace time: the submodule hooks of op slot `slot` become a site (not ops) in this graph:
    the model's own hooks are not traced here, and its watcher wants nothing a site cannot give
    (target_dtypes counts, gradients=True, check="module")."""
    if _root_traced_here():
        return False
    from .compiled import SLOTS  # (trace time only)

    for s in SLOTS.live(slot):
        w = s.watcher()
        cfg = getattr(w, "config", None)
        if cfg is None or cfg.target_dtypes or cfg.gradients or cfg.check != "batch":
            return False
    return True


_DTYPE_NAMES = {dt: str(dt).replace("torch.", "") for dt in MEASURED}


def _kind(t: torch.Tensor) -> str:
    if t.dtype not in MEASURED or t.layout is not torch.strided or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return "x"
    if t.numel() == 0:
        return _EMPTY
    return _MEASURED


def traced_site(slot: int, spec: str, params: Dict[str, Optional[torch.nn.Parameter]],
                tensors: Sequence[torch.Tensor]) -> None:
    """While dynamo traces a submodule's forward hook (its pre-hook added nothing): the site's
    aten ops. Values on a second device, or of a kind the graph does not measure, are kept as
    not measured ("x"); a full buffer leaves the call unrecorded (said once)."""
    names: Tuple[str, ...] = ()
    values: List[torch.Tensor] = []
    for k, p in params.items():
        if p is not None:
            names = names + (k,)
            values.append(p)
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
    base = _new_site(device.type, -1 if device.index is None else device.index, slot, spec, names, kinds, dtypes)
    if base < 0:
        return
    width = 2 * len(measured) + 1
    buf = BUFFERS.bufs[device]
    counter = BUFFERS.counters[device]
    stats: List[torch.Tensor] = []
    for t in measured:
        d = t.detach()
        if d.dtype is torch.bool:
            d = d.to(torch.int32)  # (inductor on torch 2.13 takes the amin of bool.to(uint8) as 0)
        elif d.dtype in INTEGERS and d.dtype is not torch.uint8:
            d = d.to(torch.int64)
        a = d.abs()
        stats.append(a.amin().to(torch.float64))
        stats.append(a.amax().to(torch.float64))
    counter.add_(1)
    stats.append(counter[0])
    buf[base:base + width].copy_(torch.stack(stats))


def begin_batch() -> None:
    """A recorded batch begins: every site's rows zeroed (one fill per device, no sync)."""
    for device, buf in BUFFERS.bufs.items():
        n = BUFFERS.used.get(device, 0)
        if n:
            buf[:n].zero_()


def has_sites() -> bool:
    return bool(BUFFERS.sites)


def ran() -> List[Tuple[Site, List[float]]]:
    """The sites that ran since `begin_batch()` and their values (one copy per device), in the
    order they ran."""
    out: List[Tuple[float, Site, List[float]]] = []
    host: Dict[torch.device, List[float]] = {}
    for device, buf in BUFFERS.bufs.items():
        n = BUFFERS.used.get(device, 0)
        if n:
            host[device] = buf[:n].tolist()  # one copy (and, on CUDA, the wait for it)
    for site in BUFFERS.sites:
        vals = host.get(site.device)
        if vals is None:
            continue
        seq = vals[site.base + site.width - 1]
        if seq > 0:
            out.append((seq, site, vals[site.base:site.base + site.width - 1]))
    out.sort(key=lambda r: r[0])
    return [(s, v) for _, s, v in out]


def names(site: Site, kw_names: Dict[str, str]) -> List[Tuple[str, str, str]]:
    """(name, kind, dtype name) of each value of the site in the order eager watching records
    them: parameters, positional inputs, keyword inputs, output. Kind "m" (measured: two values
    in the site's rows), "e" (empty), "x" (not measured in the graph), or a note (None, not a
    tensor) with no dtype."""
    from .compiled import _parsed  # (the spec's parser)

    args, kwargs, output = _parsed(site.spec)
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
