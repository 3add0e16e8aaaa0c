"""The launches of the device kernels into a buffer's slots: their shapes, one launch over a
module call's tensors (`launch`, and `launch_scaled` for the counts of 8-bit targets), and the
deferred frames' table: when it is launched (FLUSH_TENSORS, FLUSH_BYTES), its rows staged for the
device (`StagedTable`) and its launch (`launch_table`). The buffer is slot_buffer.py's."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Protocol, Tuple

import torch

from .device_path import kernel
from .slot_words import CountLayout

#: most tensors one launch reads (a module call gathering more takes one launch per this many):
#: each count is a kernel variant compiled on first use
MAX_TENSORS = 16
#: deferred forward frames (SlotBuffer.defer): a table launch when this many tensors wait...
FLUSH_TENSORS = 256
#: ... or when they hold this many bytes (they stay alive until it)
FLUSH_BYTES = 1 << 28
# launch shape: elements per program and loop step, and most programs per launch
BLOCK_CUDA, PROGRAMS_CUDA = 2048, 1024
TABLE_PROGRAMS_CUDA = 4096  # programs of a table launch, all its tensors together (small ones exit at once)
BLOCK_INTERPRETED, PROGRAMS_INTERPRETED = 8192, 2


class StagedTable:
    """The table kernel's rows on their way to the device: pinned host rows written in order
    during a batch (a row is copied to the device when the stream gets to it: never written
    twice before the read's wait), and one device table reused by every launch (stream order)."""

    __slots__ = ("_device", "_cuda", "_host_rows", "_np", "_at", "_device_rows", "_outgrown")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._host_rows = torch.empty(0, dtype=torch.int64)
        self._np: Any = self._host_rows.numpy()  # its NumPy view (writes without a torch op)
        self._at = 0
        self._device_rows = torch.empty(0, dtype=torch.int64, device=device)
        self._outgrown: List[torch.Tensor] = []  # host tables outgrown this batch (rows in flight)

    def stage(self, entries: List[int]) -> torch.Tensor:
        """The table kernel's rows for `entries` on the device: written to the next free rows of
        the pinned host table (never rewritten before the read's wait, so each asynchronous copy
        reads what was written for it), then copied to the device table (reused by every launch:
        stream order keeps a launch's rows until it ran)."""
        m = len(entries)
        if self._at + m > self._host_rows.numel():
            if self._at:
                self._outgrown.append(self._host_rows)
            self._host_rows = torch.empty(max(4 * m, 2 * self._host_rows.numel(), 1024), dtype=torch.int64,
                                     pin_memory=self._cuda)
            self._np = self._host_rows.numpy()
            self._at = 0
        if self._device_rows.numel() < m:
            self._device_rows = torch.empty(max(m, 4 * FLUSH_TENSORS), dtype=torch.int64, device=self._device)
        at = self._at
        rows = self._host_rows[at:at + m]
        self._np[at:at + m] = entries  # (one C-level write of the Python ints into the pinned rows)
        self._at = at + m
        table = self._device_rows[:m]
        table.copy_(rows, non_blocking=self._cuda)
        return table

    def rewind(self) -> None:
        """Every row staged so far has reached the device (the buffer's read waited for its
        stream): the host rows are written again from the first."""
        self._at = 0
        self._outgrown = []


class Slots(Protocol):
    """What a launch writes into (a SlotBuffer): `slots`, int32 words on `device` (`cuda`: a
    CUDA device), and the rows of its deferred frames' `table`."""

    device: torch.device
    cuda: bool
    slots: torch.Tensor
    table: StagedTable


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _shape(buf: Slots, tensors: List[torch.Tensor]) -> Tuple[int, int, Tuple[int, ...]]:
    """(elements per program, programs, sizes) of a launch over `tensors`."""
    longest = max(t.numel() for t in tensors)
    if buf.cuda:
        block, most = BLOCK_CUDA, PROGRAMS_CUDA
    else:
        block, most = BLOCK_INTERPRETED, PROGRAMS_INTERPRETED
    return block, min(most, -(-longest // block)), tuple(t.numel() for t in tensors)


def _kernels(buf: Slots) -> Tuple[Any, Any, Any]:
    k = kernel(not buf.cuda)
    assert k is not None  # a buffer exists only with its kernels
    return k


def on_device(buf: Slots) -> Any:
    """The buffer's device made current for a launch, when it is another CUDA device."""
    if buf.cuda and buf.device.index != torch.cuda.current_device():
        return torch.cuda.device(buf.device)
    return _nothing()


def launch(buf: Slots, first: int, tensors: List[torch.Tensor], layout: Optional[CountLayout] = None) -> None:
    """One kernel launch measuring `tensors` into slots first, first + 1, ... of `buf` (with
    a CountLayout: first, first + layout.words // 2, ..., and their direct counts)."""
    k = _kernels(buf)[0]
    block, programs, sizes = _shape(buf, tensors)
    if layout is None:
        ranges, stride, n_ranges, ranges_p2 = buf.slots, 2, 0, 1
    else:
        ranges, stride, n_ranges, ranges_p2 = layout.args(buf.device)[0], layout.words, \
            layout.width - len(layout.scaled), layout.ranges_p2
    with on_device(buf):
        k[(programs,)](buf.slots, tuple(tensors), sizes, first, programs, ranges, BLOCK=block, STRIDE=stride,
                       RANGES=n_ranges, RANGES_P2=ranges_p2)


def launch_table(buf: Slots, entries: List[int], count: int, programs: int, block: int) -> None:
    """One launch of the table kernel over `count` tensors listed in `entries` (four ints each:
    address, elements, dtype code, first slot word; SlotBuffer.defer), `programs` programs
    each, their rows staged and copied to the device first (StagedTable.stage)."""
    with on_device(buf):
        table = buf.table.stage(entries)
        _kernels(buf)[2][(count, programs)](buf.slots, table, BLOCK=block)


def launch_scaled(buf: Slots, first: int, tensors: List[torch.Tensor], layout: CountLayout) -> None:
    """The second launch for a CountLayout with scaled (8-bit) targets, after `launch` on the
    same tensors and slots (in stream order: it reads their abs max from the slots)."""
    k = _kernels(buf)[1]
    block, programs, sizes = _shape(buf, tensors)
    scaled = layout.args(buf.device)[1]
    with on_device(buf):
        k[(programs,)](buf.slots, tuple(tensors), sizes, first, programs, scaled, BLOCK=block, STRIDE=layout.words,
                       COLUMN=2 + layout.width - len(layout.scaled), SCALED=len(layout.scaled),
                       SCALED_P2=layout.scaled_p2)
