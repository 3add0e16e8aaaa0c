"""The layout of the in-graph statistics (core/measure/graph_stats.py): a traced call's `Site`,
a device's `Table` of rows, and the process's `SITES` that number the sites, hold the tables and
give the row ids and batch stamps.

A row: the batch stamp, the module's row id and the call's site (layout) number, then two
statistics (abs min, abs max) per measured value of the site, ROW values in all. A site's
`layout()` names its values in the order eager watching records them (`names`).
"""

import hashlib
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import naming
from ..frame_stats import NOTE_NONE, NOTE_NOT_TENSOR

#: one value's place in a site's layout: "m" measured, "e" empty, "x" not measured, or an Other note
KIND_MEASURED, KIND_EMPTY = "m", "e"


class Site:
    """One traced call's layout: the structure of its inputs and output (core/frames/compiled.py's
    spec), its parameter names, per value its kind and dtype name; `number`, its layout number,
    written into each of its rows."""

    __slots__ = ("number", "spec", "params", "kinds", "dtypes", "_rows")

    def __init__(self, number: int, spec: str, params: Tuple[str, ...], kinds: str, dtypes: Tuple[str, ...]) -> None:
        self.number = number
        self.spec = spec
        self.params = params
        self.kinds = kinds
        self.dtypes = dtypes
        self._rows: Optional[List[Tuple[str, str, str]]] = None  # layout(), made once

    @property
    def measured(self) -> int:
        """Values measured (two statistics each in its rows)."""
        return self.kinds.count(KIND_MEASURED)

    def layout(self, kw_names: Dict[str, str], parse: Callable[[str], Tuple[Any, ...]]
               ) -> List[Tuple[str, str, str]]:
        """`names(self, kw_names, parse(self.spec))`, made once: the same for every module that
        shares the site, whatever its class (a keyword input is named `input.<key>` alike, with
        or without the module's `kw_names` cache of those names; `parse`: core/frames/
        compiled.py's spec parser)."""
        rows = self._rows
        if rows is None:
            rows = self._rows = names(self, kw_names, parse(self.spec))
        return rows


#: values one row holds; a call measuring more keeps the rest as not measured ("x")
ROW_VALUES = 32
HEAD = 3  # a row: stamp, row id, layout number, then two statistics per measured value
ROW = HEAD + 2 * ROW_VALUES
#: rows of a device's table at first (a ring: rows past it overwrite the oldest); grown when a
#: read finds more written since the last one than half of it
INITIAL_ROWS = 1024


class Table:
    """One device's ring of rows (core/measure/graph_stats.py's docstring; a row: above): `rows`,
    `counter` (rows written so far, int64) and `stamp` (the batch stamp the rows take), all at
    fixed addresses."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self.rows = torch.zeros(capacity, ROW, dtype=torch.float64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        # (one element, not a 0-d tensor: dynamo makes a 0-d float64 CPU tensor it reads a
        # symbolic float, which specialized afterwards makes it trace the whole graph again)
        self.stamp = torch.zeros(1, dtype=torch.float64, device=device)
        for t in (self.rows, self.counter, self.stamp):
            try:  # a fixed address: CUDA graphs (mode="reduce-overhead") write it in place
                torch._dynamo.mark_static_address(t, guard=False)
            except Exception:  # (an older torch: CUDA graphs then skip these graphs)
                pass

    def written(self) -> Tuple[int, torch.Tensor]:
        """(rows written so far, the rows on the host): one copy from a GPU."""
        if self.device.type == "cpu":
            return int(self.counter[0]), self.rows
        flat = torch.cat([self.counter.to(torch.float64), self.rows.view(-1)]).to("cpu")
        return int(flat[0]), flat[1:].view(self.capacity, ROW)


class _Sites:
    """The process's layouts by number, its tables (one per device) and its row ids. A layout's
    number is made from what it is (`layout_number`): traced again (another watch of the same
    model, a dynamo restart, a recompile, another process) it is the same constant in the
    graph, so the compile caches serve the graph. Graphs
    reach a device's table as attributes of `holders` (a module object: dynamo reads a module's
    attribute afresh and guards on it alone); a grown table is a new object there (the graphs
    that wrote the old one are traced again)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_number: Dict[int, Site] = {}
        self._numbers: Dict[Tuple[Any, ...], int] = {}  # a layout's number by what it is
        self.tables: Dict[torch.device, Table] = {}
        self.holders = types.ModuleType("tensorwatch_otel_graph_sites")
        self.dirty = False  # rows written since the last read (set by the graphs' own code)
        self.row_ids = 0  # row ids given so far (1, 2, ...: 0 is an unwritten row's)
        self.stamps = 0  # batch stamps given so far

    def add(self, dev_type: str, dev_index: int, spec: str, params: Tuple[str, ...], kinds: str,
            dtypes: Tuple[str, ...]) -> int:
        with self.lock:
            device = torch.device(dev_type, dev_index) if dev_index >= 0 else torch.device(dev_type)
            if device not in self.tables:
                table = Table(device, INITIAL_ROWS)
                table.stamp.fill_(float(self.stamps))  # (the batch under way began before its table)
                self._put_table(table)
            key = (device, spec, params, kinds, dtypes)
            number = self._numbers.get(key)
            if number is None:
                number = layout_number(key)
                while number in self.by_number:  # (two layouts of one hash: the next free number)
                    number = number % _NUMBERS + 1
                self._numbers[key] = number
                self.by_number[number] = Site(number, spec, params, kinds, dtypes)
            return number

    def _put_table(self, table: Table) -> None:
        self.tables[table.device] = table
        setattr(self.holders, table_name(table.device), table)

    def grow(self, device: torch.device, need: int) -> None:
        """A table of at least `need` rows for `device` (a new one: graphs trace again)."""
        with self.lock:
            old = self.tables.get(device)
            if old is not None and old.capacity < need:
                table = Table(device, max(need, 2 * old.capacity))
                table.stamp.copy_(old.stamp)
                self._put_table(table)

    def new_row_id(self) -> int:
        with self.lock:
            self.row_ids += 1
            return self.row_ids

    def new_stamp(self) -> float:
        with self.lock:
            self.stamps += 1
            return float(self.stamps)


_NUMBERS = 2 ** 52 - 1  # layout numbers 1.._NUMBERS: exact in a row's float64


def layout_number(key: Tuple[Any, ...]) -> int:
    """A layout's number from what it is (its device, structure, parameters, kinds, dtypes):
    the same in every process whatever it traced before, so the same model compiled in another
    process (a restarted run, another rank or test) is the same graph, served by inductor's
    cache on disk. A hash (`repr` of strings, tuples and a device: stable across processes)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _NUMBERS + 1


def table_name(device: torch.device) -> str:
    return f"table_{device.type}_{-1 if device.index is None else device.index}"


SITES = _Sites()


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
