"""Statistics inside the compiled graph: on by default for graphs on every device
(TENSORWATCH_GRAPH_STATS: ``1``, ``cpu`` for graphs on the CPU only, ``0`` off).

With it, a watched submodule's forward hook traced by dynamo adds no op with a Python body: it
adds plain aten ops that take each of the call's tensors' abs min and abs max (its parameters,
inputs and output, as float64: exact for every float and integer dtype up to 2**53) and write
them, as one row, into its device's *table*: a ring of rows in a buffer at a fixed address
(torch._dynamo.mark_static_address), with a counter on the device giving each row its place. A
row holds the batch stamp (a device scalar the host sets when a recorded batch begins), the
module's row id (a tensor the module's hook holds: data, not a constant, so modules sharing
their code share one graph) and the call's layout number, then the statistics. A layout (a
`Site`) is one traced call's structure: its parameter names, the structure of its inputs and
output (core/frames/compiled.py's spec), each value's kind and dtype, fixed when the graph is traced
(`_new_site`, run by dynamo at trace time only; sites and tables: core/measure/graph_sites.py).
Nothing runs in Python per module call; the rows are written in the graph, so CUDA graphs
(mode="reduce-overhead") capture them, and nothing is stored on a Python object (activation
checkpointing's operator takes no side effect).

When a recorded batch begins its stamp is set on every table; when the model's own call
returns (or an eager frame follows a graph: `pending()`), the rows written since the watcher's
last read are read in one copy per device: those of this batch's stamp and of the watcher's
modules become its frames, in the order they ran, named as eager watching names them.

Only where the model's own hooks run eagerly around the graph (under `torch.compile(model)`,
`watch(torch.compile(m))` and `model.compile()` alike, on the torch versions tested): their pre-
and post-hooks begin and end the batch. A graph that traced them (`mark_root_traced`), a call
on another device than its module's row id, and a watcher with `target_dtypes`,
`gradients=True` or `check="module"` keep the ops of core/frames/compiled.py."""

import weakref
from typing import Any, Container, Dict, List, Sequence, Tuple

import torch

from .graph_sites import HEAD, KIND_EMPTY, KIND_MEASURED, ROW, ROW_VALUES, SITES, Site, Table, table_name

_F = Any
_TRACE_TIME: List[Any] = []  # the functions dynamo must run at trace time (configure())


def constant_result(fn: _F) -> _F:
    """Marks `fn` for `configure()`: torch._dynamo.assume_constant_result (dynamo runs the
    function at trace time and keeps its result as a constant of the graph), applied when the
    first watch() loads dynamo, not at import (a second)."""
    _TRACE_TIME.append(fn)
    return fn


def configure() -> None:
    """Marks the trace-time functions for dynamo (core/frames/compiled.py's hook_guards(), at the first
    watch(), dynamo loaded)."""
    import torch._dynamo

    for fn in _TRACE_TIME:
        torch._dynamo.assume_constant_result(fn)


#: dtypes measured in the graph (integers widened to int64 before abs(): abs(-128) of an int8
#: is -128; bool read as int32), as the eager routes measure them
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
MEASURED = frozenset(FLOATS + INTEGERS + (torch.bool,))

# one value's place in a site's layout (core/measure/graph_sites.py): the names the traced code reads
_MEASURED, _EMPTY = KIND_MEASURED, KIND_EMPTY


#: On or off for the process; dynamo guards on it: a graph traced with one setting is traced again
#: under the other. Set by use_mode() from TENSORWATCH_GRAPH_STATS where a watcher's options are
#: built (core/config.py); until then the default.
ON = True
#: Graphs on every device (``1``, the default), not only on the CPU (``cpu``).
EVERY_DEVICE = True


def use_mode(mode: str) -> None:
    """The process's in-graph statistics: ``1`` (every device), ``cpu`` or ``0`` (nowhere), as
    core/env.py parsed TENSORWATCH_GRAPH_STATS."""
    global ON, EVERY_DEVICE
    ON = mode != "0"
    EVERY_DEVICE = mode == "1"


def device_allowed(device_type: str) -> bool:
    """At trace time: graphs on this device type measure inside the graph."""
    return EVERY_DEVICE or device_type == "cpu"


@constant_result
def _new_site(dev_type: str, dev_index: int, spec: str, params: Tuple[str, ...], kinds: str,
              dtypes: Tuple[str, ...]) -> int:
    """At trace time only (dynamo runs it once and keeps its result as a constant): the new
    layout's number (its device's table is made with the first)."""
    return SITES.add(dev_type, dev_index, spec, params, kinds, dtypes)


@constant_result
def _side_effects_allowed() -> bool:
    """At trace time: the graph may set a Python attribute after it runs (not inside a higher-
    order operator's body, activation checkpointing's among them, which refuses side effects)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx: Any = InstructionTranslator.current_tx()
        return tx is None or tx.output.current_tracer.parent is None
    except Exception:  # an internal that moved: no side effect (the rows are read at the batch's end)
        return False


def new_row_id(device: torch.device) -> Tuple[int, torch.Tensor]:
    """A module hook's row id: the number, and a one-element float64 tensor holding it on its
    module's device (its rows are written there; the CPU for a module on the meta device; one
    element, not 0-d: graph_sites.Table's stamp says why)."""
    number = SITES.new_row_id()
    if device.type == "meta":
        device = torch.device("cpu")
    return number, torch.full((1,), float(number), dtype=torch.float64, device=device)


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


@constant_result
def rows_here(device_type: str) -> bool:
    """At trace time: a submodule whose row id is on `device_type` writes rows in this graph
    (the model's own hooks are not traced here, and graphs on that device measure inside)."""
    return not root_traced_here() and device_allowed(device_type)


def traced_site(row_id: torch.Tensor, spec: str, names: Tuple[str, ...], params: Sequence[torch.Tensor],
                tensors: Sequence[torch.Tensor]) -> None:
    """While dynamo traces a submodule's forward hook (its pre-hook added nothing): the aten ops
    that write the call's row into the table of `row_id`'s device: for its parameters
    (`params`, named `names`) and the call's tensors. Values on another device, of a kind the
    graph does not measure, or past ROW_VALUES are kept as not measured ("x")."""
    values: List[torch.Tensor] = list(params)
    values.extend(tensors)
    device = row_id.device
    kinds = ""
    dtypes: Tuple[str, ...] = ()
    measured: List[torch.Tensor] = []
    for t in values:
        k = _kind(t) if t.device == device else "x"
        if k == _MEASURED and len(measured) >= ROW_VALUES:
            k = "x"
        kinds = kinds + k
        dtypes = dtypes + (_DTYPE_NAMES.get(t.dtype, "other"),)
        if k == _MEASURED:
            measured.append(t)
    number = _new_site(device.type, -1 if device.index is None else device.index, spec, names, kinds, dtypes)
    table = getattr(SITES.holders, table_name(device))
    row: List[torch.Tensor] = [table.stamp.view(()), row_id.view(()),
                               torch.full((), float(number), dtype=torch.float64, device=device)]
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
        row.append(a.amin().to(torch.float64))
        row.append(a.amax().to(torch.float64))
    width = len(row)
    place = (table.counter % table.capacity) * ROW + torch.arange(width, device=device)
    table.rows.view(-1).index_put_((place,), torch.stack(row))
    table.counter.add_(1)
    if _side_effects_allowed():
        SITES.dirty = True


def begin_batch() -> float:
    """A recorded batch begins: a new stamp on every table (the rows written from now on are its
    own); the stamp."""
    stamp = SITES.new_stamp()
    for table in list(SITES.tables.values()):
        table.stamp.fill_(stamp)
    return stamp


def pending() -> bool:
    """Some graph wrote rows since the last read (`ran()`)."""
    return SITES.dirty


def has_tables() -> bool:
    return bool(SITES.tables)


def site(number: int) -> Site:
    return SITES.by_number[number]


Row = Tuple[int, Site, List[float]]  # (row id, its layout, its statistics)


def ran(cursor: Dict[torch.device, Tuple[Table, int]], stamp: float, row_ids: Container[int]
        ) -> Tuple[List[Row], int]:
    """The rows written since `cursor` (per device: the table and its counter at the caller's
    last read, moved on here) of `row_ids` (a watcher's) in its batch begun at `stamp` (rows
    stamped with it or a later stamp), in the order they ran (one copy per device); and how many
    rows were overwritten before they were read (0: none). A table more than half filled
    between two reads is grown (a new one: its graphs trace again)."""
    out: List[Tuple[int, Row]] = []
    lost = 0
    for device, table in list(SITES.tables.items()):
        count, rows = table.written()
        seen = cursor.get(device)
        cursor[device] = (table, count)
        if seen is None or seen[0] is not table:  # a first read of this table: the whole ring
            last = max(0, count - table.capacity)
        else:
            last = seen[1]
            if count - last > table.capacity // 2:
                SITES.grow(device, 4 * (count - last))
        if count <= last:
            continue
        first = max(last, count - table.capacity)
        lost += first - last
        places = [r % table.capacity for r in range(first, count)]
        for order, row in enumerate(rows[places].tolist()):
            # (a batch of another watcher, begun inside this one's, stamped the rows after it
            # with its own, later stamp; rows of an earlier batch bear an earlier one)
            if row[0] < stamp or int(row[1]) not in row_ids:
                continue
            layout = SITES.by_number.get(int(row[2]))
            if layout is None:
                continue
            n = 2 * layout.measured
            out.append((first + order, (int(row[1]), layout, row[HEAD:HEAD + n])))
    SITES.dirty = False
    out.sort(key=lambda r: r[0])  # (one device's rows are in order; several: by place, as close as it gets)
    return [r[1] for r in out], lost
