"""The weight table: a model's small dense CPU float weights, measured in one kernel call per
batch instead of one Python walk per weight per module call.

With thousands of small modules (the MoE shape) the per-weight Python of a frame cost more
than the reads themselves. The table holds every weight of this kind the recorder has framed
(a row each: address, element count, dtype code), and the first frame of a batch that needs
weights measures all rows at once (`state()`); a frame then takes a weight's two values from
its row while the weight is the row's tensor at the row's version, address and dtype (an
in-place write or a `.data =` since the read sends that weight down the per-frame path, which
measures it as it is at the call). Before each read the rows' addresses, element counts and
dtypes are checked against the tensors (a row is never read where its tensor no longer is).

Only tensors of at most SMALL elements are rows: a large weight's Python is nothing beside its
read, and a weight framed once (an expert no token reached since) is then read every batch at
a bounded cost (ELEMENTS in all). The table keeps its tensors alive until it is dropped:
`drop()` at detach, and at the next read when a framed module holds a weight it does not know
(parameters replaced: it is rebuilt from the frames that follow)."""

from __future__ import annotations

import array
import operator
import threading
from typing import Dict, List, Optional, Tuple

import torch

from .cpu_kernel import CODES, KERNEL
from .stats import host_readable, storage_freed

SMALL = 1 << 16  # elements of the largest row
ELEMENTS = 1 << 22  # elements of all rows together
# weights offered in one batch (held until the next read): every small weight of a model
# within ELEMENTS at once, so a large model fills the table at its first read (docs/performance.md)
OFFERS = 1 << 16
_PLAIN = (torch.Tensor, torch.nn.Parameter)

_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_dtype_of = operator.attrgetter("dtype")
_version_of = operator.attrgetter("_version")

# one read: id(tensor) -> row, the values (abs min, abs max of row i at 2i, 2i + 1), and per row
# the version, address and dtype the values belong to
TableState = Tuple[Dict[int, int], "array.array[float]", List[int], List[int], List[torch.dtype]]


def takes(p: torch.Tensor) -> bool:
    """Whether `p` can be a row: a plain dense contiguous CPU tensor of a dtype the kernel reads,
    1..SMALL elements, with a version counter (not made under inference_mode), whose storage
    holds its elements (FSDP frees an unsharded weight's storage between its uses: its address
    then changes, the read before the kernel's sees it, and the row goes)."""
    return p.__class__ in _PLAIN and host_readable(p) and p.numel() <= SMALL and not storage_freed(p)


class WeightTable:
    """See the module docstring. `offer()` adds a weight (from the next read on), `state()` is
    the current read (made on the first call after `invalidate()`), `drop()` forgets it all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tensors: List[torch.Tensor] = []
        self._ids: Dict[int, int] = {}
        self._offered: Dict[int, torch.Tensor] = {}
        self._elements = 0
        self._ptrs = array.array("q")
        self._ns = array.array("q")
        self._codes = array.array("b")
        self._dtypes: List[torch.dtype] = []
        self._state: Optional[TableState] = None
        self._stale = False

    def offer(self, p: torch.Tensor) -> bool:
        """`p` (for which `takes(p)`) becomes a row at the next read; False when the rows are
        full (ELEMENTS): `p` stays off the table."""
        if self._elements + p.numel() > ELEMENTS:
            return False
        if id(p) not in self._ids and len(self._offered) < OFFERS:
            self._offered[id(p)] = p
        return True

    def unknown(self) -> None:
        """A framed module holds a weight the table does not: rebuild it at the next read."""
        self._stale = True

    def invalidate(self) -> None:
        """The weights may have changed (a training batch, an optimizer step): read them again
        at the next `state()`."""
        self._state = None

    def end_batch(self) -> None:
        """Weights offered during the batch become rows at the next batch's read."""
        if self._offered or self._stale:
            self._state = None

    def drop(self) -> None:
        with self._lock:
            self._tensors, self._ids, self._offered = [], {}, {}
            self._elements = 0
            del self._ptrs[:], self._ns[:], self._codes[:]
            self._dtypes = []
            self._state = None
            self._stale = False

    def state(self) -> Optional[TableState]:
        """This batch's read of every row (None: no rows, or no kernel)."""
        st = self._state
        if st is not None:
            return st
        kernel = KERNEL.get()
        many = getattr(kernel, "host_many", None)
        if many is None:
            return None
        with self._lock:
            if self._state is not None:  # another thread read it meanwhile
                return self._state
            if self._stale:
                self._tensors, self._ids = [], {}
                self._elements = 0
                self._stale = False
            self._add_offered()
            ts = self._tensors
            if not ts:  # no rows yet: frames offer their weights for the next batch's read
                st = self._state = ({}, array.array("d"), [], [], [])
                return st
            ptrs = array.array("q", map(_data_ptr, ts))
            if ptrs != self._ptrs or list(map(_numel, ts)) != self._ns.tolist() \
                    or list(map(_dtype_of, ts)) != self._dtypes:
                self._rows()
                ptrs = self._ptrs
            k = len(ts)
            vals = array.array("d", bytes(16 * k))
            many(ptrs.buffer_info()[0], self._ns.buffer_info()[0], self._codes.buffer_info()[0], k,
                 vals.buffer_info()[0])
            st = self._state = (self._ids, vals, list(map(_version_of, ts)), ptrs.tolist(), self._dtypes)
            return st

    def _add_offered(self) -> None:
        offered, self._offered = self._offered, {}
        ids = dict(self._ids)  # a new dict: a read in use keeps its own
        for pid, p in offered.items():
            if pid in ids or not takes(p):
                continue
            n = p.numel()
            if self._elements + n > ELEMENTS:
                break
            self._elements += n
            ids[pid] = len(self._tensors)
            self._tensors.append(p)
        self._ids = ids

    def _rows(self) -> None:
        """Rows made again from the tensors as they are now; a tensor the kernel cannot read any
        more (moved, resized, cast) leaves the table."""
        keep = [p for p in self._tensors if takes(p)]
        self._tensors = keep
        self._ids = {id(p): i for i, p in enumerate(keep)}
        self._elements = sum(p.numel() for p in keep)
        self._ptrs = array.array("q", map(_data_ptr, keep))
        self._ns = array.array("q", map(_numel, keep))
        self._codes = array.array("b", (CODES[p.dtype] for p in keep))
        self._dtypes = [p.dtype for p in keep]


class NoWeightTable(WeightTable):
    """The weight table of a recorder whose CPU tensors take the device path: no rows (the
    weights of a module call are read with its other tensors, by the fused kernel)."""

    def offer(self, p: torch.Tensor) -> bool:
        return False

    def state(self) -> None:
        return None
