"""One device's slots for a batch (`SlotBuffer`): the device kernels measure a module call's
tensors into it, at once or deferred to one table launch over many calls' tensors, and the batch's
read-back copies it to the host once.

Each measured tensor gets a slot (slot_words.py says what its words hold). The record holds a
`SlotStat` per tensor until the read-back (Record.readback), which copies each device's used slots
to the host once (pinned memory, non_blocking, one event on CUDA), gives every slot its values and
resets the buffer. The launches are device_launch.py's; which devices have a buffer,
device_stats.py's.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from typing import Any, List, Optional, Set, Tuple

import torch

from .device_launch import BLOCK_CUDA, BLOCK_INTERPRETED, FLUSH_BYTES, FLUSH_TENSORS, MAX_TENSORS
from .device_launch import PROGRAMS_INTERPRETED, TABLE_PROGRAMS_CUDA, StagedTable
from .device_launch import launch, launch_scaled, launch_table
from .device_path import IMMEDIATE
from .slot_words import CountLayout, HostWords, KeptReads, decode_words

_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the table kernel's dtype codes
_SIZE_SHIFT = (2, 1, 1)  # log2 of the element size, by dtype code
INITIAL_SLOTS = 1024
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PARAMETER = torch.nn.Parameter
_STRIDED = torch.strided


class SlotStat:
    """One measured tensor's place in a device buffer until the batch's read-back, then its
    values: `lo` (abs min) and `hi` (abs max) as floats and, when it was measured with a
    CountLayout (`width` > 0), `counts` (that many ints), set (and `read` true) by the first
    `buffer.read()` after its launch. A record holds it at both of the tensor's places
    (Record.readback), and as the tensor's counts row with target_dtypes."""

    __slots__ = ("buffer", "index", "lo", "hi", "read", "width", "counts", "changed")

    def __init__(self, buffer: "SlotBuffer", width: int = 0, index: int = 0) -> None:
        self.buffer = buffer
        self.index = index  # its first slot in the buffer
        self.lo = self.hi = math.nan
        self.read = False  # lo and hi hold the values
        self.width = width
        self.counts: Tuple[int, ...] = ()
        # its tensor was written in place after its module returned and before its deferred
        # launch (SlotBuffer.defer): its value at the return is lost; lo and hi mean nothing
        self.changed = False


def _released(t: torch.Tensor) -> bool:
    """`t`'s storage no longer holds its elements: freed in place (FSDP frees an unsharded
    parameter's storage after its module's forward with `resize_(0)`, moving no version)."""
    try:
        return t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()
    except RuntimeError:
        return True


class Waiting:
    """The tensors of deferred frames waiting for a buffer's table launch, in the order taken:
    each held (its memory cannot be reused before the launch reads it), with its SlotStat
    (SlotBuffer.defer) or slot number (take_one) in `stats`, its version and module (`keys`) when
    taken, and its table row in `entries` (four ints: address, elements, dtype code, first slot
    word). The buffer appends to the lists in place (per tensor, no call); `clear` starts new
    ones after the launch."""

    __slots__ = ("tensors", "stats", "versions", "keys", "entries")

    def __init__(self) -> None:
        self.tensors: List[torch.Tensor] = []
        self.stats: List[Any] = []  # a SlotStat (defer), or a slot number (take_one)
        self.versions: List[int] = []
        self.keys: List[object] = []
        self.entries: List[int] = []

    def clear(self) -> None:
        """None waits (the table was launched): new lists, the launched ones left to whoever holds them."""
        self.tensors, self.stats, self.versions, self.keys, self.entries = [], [], [], [], []


class SlotBuffer:
    """One device's slots for a batch: preallocated, grown geometrically when a batch needs more,
    reset by one fill at each read. A slot is two int32 words; a tensor measured with a
    CountLayout takes layout.words // 2 consecutive slots.

    Forward frames are deferred (`defer`): their tensors wait in the buffer's table (address,
    element count, dtype code, slot) and one launch of the table kernel measures the waiting
    tensors of many module calls (`flush`: at FLUSH_TENSORS tensors, FLUSH_BYTES bytes, before
    any other launch reads the buffer, and at the read), instead of one launch per call. A
    waiting tensor is held (its memory cannot be reused before the launch reads it), and its
    version is checked at the flush: one written in place meanwhile (an inplace ReLU, a
    residual `+=` on a module's output) has lost the value it had when its module returned,
    so its SlotStat says `changed`, and its module's frames are measured at once from then on
    (`eager`: a launch of their own, as every frame had before). The first batch learns those
    modules before any frame is deferred: its frames launch at once and its tensors' versions
    are checked at its read (`learning`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.capacity = 0
        self.used = 0
        self.counted = False  # some issued SlotStat has counts (read decodes them)
        self.slots = torch.empty(0, dtype=torch.int32, device=device)
        self.host = HostWords(self.cuda)  # where the read copies the slots (and, on CUDA, its event)
        self.issued: List[SlotStat] = []
        self._lock = threading.Lock()
        self._grow(INITIAL_SLOTS)
        # deferred frames (defer/flush): the waiting tensors, the bytes they hold, and the table
        # as the kernel reads it
        self.waiting = Waiting()
        self._bytes = 0
        self.table = StagedTable(device)
        self.eager: Set[object] = set()  # modules whose frames are measured at once (see above)
        self.learning = True  # the first batch: every frame at once, versions checked at the read
        self._learn: List[Tuple["weakref.ref[torch.Tensor]", int, object]] = []
        self.launches = 0  # table launches, for the tests' and benchmarks' counts
        # slot codes (take_one): the read number, and the reads kept for them (decoded)
        self.epoch = 0
        self.kept = KeptReads()
        self.several = torch.cuda.device_count() > 1 if self.cuda else False  # (a tensor's device is checked)
        self.changed_seen = 0  # SlotStats that said `changed`

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity)
        slots = torch.zeros(2 * cap, dtype=torch.int32, device=self.device)
        if self.used:
            slots[:2 * self.used].copy_(self.slots[:2 * self.used])
        self.slots = slots
        self.host.resize(2 * cap)
        self.capacity = cap

    def take(self, k: int, layout: Optional[CountLayout] = None) -> Tuple[int, List[SlotStat]]:
        """Slots for `k` tensors, consecutive (one each, or layout.words // 2 each with a
        CountLayout): the first's index and their SlotStats. The tensors waiting for a table
        launch are launched first (a launch of the caller's own follows)."""
        with self._lock:
            self._flush()
            return self._take(k, layout)

    def _take(self, k: int, layout: Optional[CountLayout]) -> Tuple[int, List[SlotStat]]:
        per = 1 if layout is None else layout.words // 2
        width = 0 if layout is None else layout.width
        first = self.used
        if first + per * k > self.capacity:
            self._grow(first + per * k)
        self.used = first + per * k
        stats = [SlotStat(self, width, first + per * j) for j in range(k)]
        self.issued += stats
        if width:
            self.counted = True
        return first, stats

    def measure(self, tensors: List[torch.Tensor], layout: Optional[CountLayout]) -> Tuple[int, List[SlotStat]]:
        """Slots for `tensors` (taken by DeviceFrame.add), measured now: one launch per
        MAX_TENSORS of them (with a CountLayout their counts too, and a second launch when it has
        scaled targets); the first slot's index and their SlotStats in order."""
        first, stats = self.take(len(tensors), layout)
        per = 1 if layout is None else layout.words // 2
        for i in range(0, len(tensors), MAX_TENSORS):
            part = tensors[i:i + MAX_TENSORS]
            if layout is None:
                launch(self, first + i, part)
            else:
                launch(self, first + per * i, part, layout)
                if layout.scaled:
                    launch_scaled(self, first + per * i, part, layout)
        return first, stats

    def defer(self, tensors: List[torch.Tensor], key: object) -> List[SlotStat]:
        """Slots for `tensors` (taken by DeviceFrame.add) of one forward frame of module `key`,
        measured by a later table launch (see the class); their SlotStats in order. Measured at
        once instead for a module learnt or being learnt, a `key` of None (tensors lent for the
        call only), and inside a compiled graph's op (`immediate()`: inductor reuses its buffers
        without moving a version)."""
        with self._lock:
            first, stats = self._take(len(tensors), None)
            if self.learning or key is None or key in self.eager or IMMEDIATE.depth:  # measured now, alone
                if self.learning:
                    self._learn += [(weakref.ref(t), t._version, key) for t in tensors]
                for i in range(0, len(tensors), MAX_TENSORS):
                    launch(self, first + i, tensors[i:i + MAX_TENSORS])
                return stats
            w = self.waiting
            entries, waiting, versions, keys = w.entries, w.tensors, w.versions, w.keys
            for j, t in enumerate(tensors):
                entries += (t.data_ptr(), t.numel(), _CODES[t.dtype], 2 * (first + j))
                waiting.append(t)
                versions.append(t._version)
                keys.append(key)
                self._bytes += t.numel() * t.element_size()
            w.stats.extend(stats)
            if len(waiting) >= FLUSH_TENSORS or self._bytes >= FLUSH_BYTES:
                self._flush()
            return stats

    def take_one(self, t: torch.Tensor, key: object) -> Optional[int]:
        """`defer([t], key)` for a tensor the table kernel reads as it is (DeviceFrame.add's
        test, on this buffer's device), when its frame may wait (not learnt, not learning, not
        inside a compiled graph): its slot's code (see `code`) instead of a SlotStat; else None,
        nothing taken (the caller measures the frame its general way). The recorder's
        one-in-one-out device frame, in few lines."""
        if t.__class__ not in _PLAIN or t.layout is not _STRIDED or self.learning or IMMEDIATE.depth \
                or key in self.eager:
            return None
        code = _CODES.get(t.dtype)
        if code is None or not t.is_contiguous():
            return None
        if self.cuda:
            if not t.is_cuda or (self.several and t.get_device() != self.device.index):
                return None
        elif not t.is_cpu:
            return None
        n = t.numel()
        if not n:
            return None
        lock = self._lock
        lock.acquire()
        try:
            slot = self.used
            if slot >= self.capacity:
                self._grow(slot + 1)
            self.used = slot + 1
            w = self.waiting  # (each of its lists read once)
            entries = w.entries
            entries += (t.data_ptr(), n, code, 2 * slot)
            waiting = w.tensors
            waiting.append(t)
            w.stats.append(slot)
            w.versions.append(t._version)
            w.keys.append(key)
            self._bytes += n << _SIZE_SHIFT[code]
            if len(waiting) >= FLUSH_TENSORS or self._bytes >= FLUSH_BYTES:
                self._flush()
            return (self.epoch << 32) | slot
        finally:
            lock.release()

    def waits(self) -> bool:
        """Slots taken since the last read (it would copy something)."""
        return self.used > 0

    def decoded(self, epoch: int) -> Optional[Tuple[torch.Tensor, Set[int]]]:
        """The values read at read number `epoch` (a float64 tensor: abs min, abs max of slot i at
        2i, 2i + 1) and the slots whose values were lost (`changed`), for the slot codes
        `take_one` gave then (code >> 32 is the read number, code & 0xFFFFFFFF the slot); the
        buffer is read first when `epoch` is the current one. None when that read is too old to
        be kept (KEPT_READS)."""
        if epoch == self.epoch:
            self.read()
        return self.kept.get(epoch)

    def flush(self) -> None:
        """Launch the waiting tensors' table (nothing when none waits)."""
        if self.waiting.tensors:
            with self._lock:
                self._flush()

    def _flush(self) -> None:
        w = self.waiting
        waiting = w.tensors
        if not waiting:
            return
        entries = w.entries
        stats, versions, keys = w.stats, w.versions, w.keys
        for j, t in enumerate(waiting):
            # written since its module returned (FSDP frees parameters' storage: those are checked)
            if t._version != versions[j] or (t.__class__ is _PARAMETER and _released(t)):
                stat = stats[j]
                if stat.__class__ is int:
                    self.kept.lose(stat)
                else:
                    stat.changed = True
                self.changed_seen += 1
                self.eager.add(keys[j])
        count = len(waiting)
        longest = max(t.numel() for t in waiting)
        block, most = (BLOCK_CUDA, TABLE_PROGRAMS_CUDA) if self.cuda else (BLOCK_INTERPRETED, PROGRAMS_INTERPRETED)
        programs = max(1, min(-(-longest // block), most // count))
        launch_table(self, entries, count, programs, block)
        self.launches += 1
        w.clear()
        self._bytes = 0

    def _learned(self) -> None:
        """The first batch read: modules whose measured tensors were written in place after they
        returned are measured at once from now on; the others' frames are deferred."""
        for ref, version, key in self._learn:
            t = ref()
            if t is not None and (t._version != version or _released(t)):
                self.eager.add(key)
        self._learn = []
        self.learning = False

    def read(self, extra: Optional[torch.Tensor] = None) -> List[float]:
        """Copy the used slots to the host (one copy), give every issued SlotStat its values and
        reset the slots for the next batch (one fill). `extra`, a 1-d float64 tensor on this
        buffer's device (the batch's other statistics), travels in the same copy: its values
        are returned. Waiting tensors are launched first."""
        with self._lock:
            self._flush()
            n = 2 * self.used
            issued, self.issued, self.used = self.issued, [], 0
            counted, self.counted = self.counted, False
            words = None if extra is None else extra.view(torch.int32)
            m = 0 if words is None else words.numel()
            if not n + m:
                return []
            host = self.host.first(n + m)
            event = self.host.event  # (CUDA buffers only)
            with torch.cuda.device(self.device) if event is not None else contextlib.nullcontext():
                # on the buffer's device's current stream, where its kernels ran
                src = self.slots[:n] if words is None else torch.cat([self.slots[:n], words])
                host.copy_(src, non_blocking=event is not None)
                if event is not None:
                    event.record()
                if n:
                    self.slots[:n].zero_()
            if event is not None:
                event.synchronize()
            self.table.rewind()  # every table row has reached the device
            if self.learning:
                self._learned()
            rest = host[n:].view(torch.float64).tolist() if m else []
            # every pair decoded: slot codes look their values up by slot (a counts word of a
            # counted slot decodes to a number nobody reads)
            decoded = decode_words(host[:n])
            epoch = self.epoch
            self.kept.keep(epoch, decoded)
            self.epoch = epoch + 1
            if issued:
                values = decoded.tolist()
                raw = host[:n].tolist() if counted else []
        if not issued:
            return rest
        if not counted:
            for s in issued:
                i = 2 * s.index
                s.lo = values[i]
                s.hi = values[i + 1]
                s.read = True
            return rest
        for s in issued:  # slots of several widths: each decoded at its place
            at = 2 * s.index
            s.lo, s.hi = values[at], values[at + 1]
            if s.width:
                s.counts = tuple(c & 0xFFFFFFFF for c in raw[at + 2:at + 2 + s.width])  # (unsigned)
            s.read = True
        return rest
