"""The device path of the statistics: a module call's dense 16/32-bit float tensors measured by
one fused Triton kernel into a per-batch slot buffer per device, read back in one copy per batch.

Each measured tensor gets a slot of two int32s in its device's buffer: the abs min and abs max
as sign-cleared float32 bit patterns (with the sign bit clear, the integer order of the patterns
is the order of the magnitudes, subnormals, inf, and NaN above inf included). Both are kept
with atomic max: the abs max as the pattern, the abs min as 0x7FFFFFFF minus the pattern, so a
zeroed slot is the neutral start of both and the buffer is reset with one fill. The kernel
reads each element once and makes nothing tensor-sized. The record holds a `SlotStat` per
tensor until the read-back (Record.readback), which copies each device's used slots to the host once
(pinned memory, non_blocking, one event on CUDA), gives every slot its values and resets the
buffer.

With target_dtypes (core/measure/magnitude.py) a tensor's slot is wider: after its two words come its
counts row (a `CountLayout`: how many elements fall in each range of sign-cleared patterns, and,
for 8-bit targets, how many the scaled cast flushes), int32 words counted by atomic add in the
same read, or, for the 8-bit targets, in a second launch over the same tensors once the abs max
is in the slot (that threshold needs it); the counts come back in the same one copy per batch.

The backend is chosen once per device: CUDA with Triton importable takes this path; a CPU takes
it only when forced (`set_mode("force")`, for tests and benchmarks, with TRITON_INTERPRET=1 set
before Triton is first imported: Triton's interpreter then runs the same kernel on CPU
tensors); `set_mode("off")` keeps every device on the routes of stats.py (benchmarks compare
the two). Everything else keeps the routes of stats.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch

log = logging.getLogger(__name__)

#: dtypes the kernel reads (each converted to float32 exactly); others go through stats.measure
KERNEL_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
#: most tensors one launch reads (a module call gathering more takes one launch per this many):
#: each count is a kernel variant compiled on first use
MAX_TENSORS = 16
#: deferred forward frames (SlotBuffer.defer): a table launch when this many tensors wait...
FLUSH_TENSORS = 256
#: ... or when they hold this many bytes (they stay alive until it)
FLUSH_BYTES = 1 << 28
_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the table kernel's dtype codes
_SIZE_SHIFT = (2, 1, 1)  # log2 of the element size, by dtype code
#: reads whose values slot codes can still look up (SlotBuffer.decoded): a cached weight's code is
#: reused until the weights are measured again (at the latest every 32 batches)
KEPT_READS = 64
#: the reads within which a cached slot code is used again (the rest of KEPT_READS: the reads a
#: frame's own record may still make before it reads back); an older one is measured again
FRESH_READS = 48
INITIAL_SLOTS = 1024
_MASK = 0x7FFFFFFF  # the sign-cleared pattern's largest value; also the abs-min slot's complement base
_INF_BITS = 0x7F800000
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PARAMETER = torch.nn.Parameter
_STRIDED = torch.strided
_CPU_KEY = -1  # a buffer's key: the CUDA device index, or this for the CPU

MODES = ("auto", "force", "off")


class _DevicePath:
    """The process's choice of devices (`mode`, see set_mode) and its kernels, made once each."""

    def __init__(self) -> None:
        self.mode = "auto"
        self.lock = threading.Lock()
        # interpreted? -> (the abs min/max kernel, the scaled-underflow kernel, the table kernel),
        # each launched as kernel[grid](...), or None
        self.kernels: Dict[bool, Optional[Tuple[Any, Any, Any]]] = {}


DEVICE_PATH = _DevicePath()


def set_mode(mode: str) -> None:
    """Which devices recorders made from now on measure on the device path: ``auto`` (CUDA with
    Triton), ``force`` (CPU tensors too, under Triton's interpreter: tests and benchmarks of the
    CUDA code on a machine without a GPU) or ``off`` (none). Not a user option."""
    if mode not in MODES:
        raise ValueError(f"device path mode {mode!r}: expected one of {', '.join(MODES)}")
    DEVICE_PATH.mode = mode


def force_on_cpu(on: bool) -> None:
    """`set_mode("force")` when `on`, else `set_mode("auto")`."""
    set_mode("force" if on else "auto")


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors): TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def kernel(interpreted: bool) -> Optional[Tuple[Any, Any, Any]]:
    """The Triton kernels (_device_kernel.build) for GPU tensors (`interpreted` False) or for CPU
    tensors under Triton's interpreter (True), made on first use; None when Triton cannot be
    imported, or when TRITON_INTERPRET says otherwise at that first use."""
    kernels = DEVICE_PATH.kernels
    if interpreted in kernels:
        return kernels[interpreted]
    if triton_interpreting() != interpreted:  # Triton would make the other kind now
        return None
    with DEVICE_PATH.lock:
        if interpreted not in kernels:
            k: Optional[Tuple[Any, Any, Any]] = None
            try:
                from . import _device_kernel
                k = _device_kernel.build()
            except Exception as exc:  # no Triton, or one that cannot build: the torch ops stay
                log.info("tensorwatch_otel: the fused device statistics kernel is not available (%s: %s); "
                         "device tensors are measured with torch ops", type(exc).__name__, exc)
            kernels[interpreted] = k
    return kernels[interpreted]


def wanted() -> bool:
    """Whether a new recorder takes the device path for some device: CUDA is available, or the
    path is forced on the CPU under Triton's interpreter (Triton itself is imported later, at
    the first buffer a device needs)."""
    mode = DEVICE_PATH.mode
    if mode == "force":
        return triton_interpreting()
    return mode == "auto" and torch.cuda.is_available()


class CountLayout:
    """What the kernels count per tensor for one tuple of target dtypes (made by
    magnitude.Plan.device_layout, the same counts as its row): `width` words after the slot's
    two, in the Plan's column order. `ranges` maps each kernel dtype to its (lo, hi) float32
    patterns, inclusive, one pair per direct column (the first: the non-zero finite elements);
    `scaled` holds a (fmax, bound) pair per 8-bit target, whose column follows the ranges'
    (see _device_kernel.scaled_underflow_slots). `words` is the slot's whole length, two words
    a slot unit (even, so slots stay aligned to the pair layout)."""

    __slots__ = ("width", "ranges", "scaled", "words", "ranges_p2", "scaled_p2", "_args")

    def __init__(self, ranges: Dict[torch.dtype, List[Tuple[int, int]]], scaled: List[Tuple[float, float]]) -> None:
        counts = {len(r) for r in ranges.values()}
        assert len(counts) == 1 and set(ranges) == KERNEL_DTYPES
        n_ranges = counts.pop()
        self.ranges = ranges
        self.scaled = scaled
        self.width = n_ranges + len(scaled)
        self.words = 2 + self.width + (self.width & 1)
        self.ranges_p2 = _pow2(n_ranges)
        self.scaled_p2 = _pow2(len(scaled))
        self._args: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    def args(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """The kernels' (ranges, scaled) tensors on `device` (int32 and float64), made once per
        device: a warm launch allocates nothing."""
        a = self._args.get(device)
        if a is None:
            rows: List[int] = []
            for dt in (torch.float32, torch.float16, torch.bfloat16):  # the kernel's row order
                pairs = self.ranges[dt] + [(1, 0)] * (self.ranges_p2 - len(self.ranges[dt]))
                rows += [v for p in pairs for v in p]
            scaled = self.scaled + [(1.0, -1.0)] * (self.scaled_p2 - len(self.scaled))
            a = (torch.tensor(rows, dtype=torch.int32, device=device),
                 torch.tensor([v for p in scaled for v in p], dtype=torch.float64, device=device))
            self._args[device] = a
        return a


def _pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1) (tl.arange's lengths)."""
    p = 1
    while p < n:
        p *= 2
    return p


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


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _released(t: torch.Tensor) -> bool:
    """`t`'s storage no longer holds its elements: freed in place (FSDP frees an unsharded
    parameter's storage after its module's forward with `resize_(0)`, moving no version)."""
    try:
        return t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()
    except RuntimeError:
        return True


class _Immediate(threading.local):
    """Depth of the calling thread's `immediate()` blocks."""

    def __init__(self) -> None:
        self.depth = 0


IMMEDIATE = _Immediate()


@contextlib.contextmanager
def immediate() -> Iterator[None]:
    """Frames recorded inside are measured at once, never deferred (core/frames/compiled.py's ops run
    the hooks inside a compiled graph, whose buffers inductor reuses without a version bump)."""
    IMMEDIATE.depth += 1
    try:
        yield
    finally:
        IMMEDIATE.depth -= 1


def decode_words(words: torch.Tensor) -> torch.Tensor:
    """The float values of a 1-d int32 CPU tensor of (abs-min complement, abs-max pattern)
    pairs, in torch ops: a float64 tensor of (abs min, abs max) pairs, NaN in both when the abs
    max is NaN (the contract of stats.measure)."""
    pairs = words.view(-1, 2)
    hi = pairs[:, 1]
    lo = torch.where(hi > _INF_BITS, hi, _MASK - pairs[:, 0])
    return torch.stack([lo, hi], dim=1).view(torch.float32).to(torch.float64).view(-1)


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
        self.host = torch.empty(0, dtype=torch.int32)
        self.issued: List[SlotStat] = []
        self.event: Optional[torch.cuda.Event] = torch.cuda.Event() if self.cuda else None
        self._lock = threading.Lock()
        self._grow(INITIAL_SLOTS)
        # deferred frames (defer/flush): the waiting tensors, their SlotStats, versions and
        # modules (`key`), the table's entries (four ints a tensor) and their bytes
        self._waiting: List[torch.Tensor] = []
        self._waiting_stats: List[Any] = []  # a SlotStat (defer), or a slot number (take_one)
        self._versions: List[int] = []
        self._keys: List[object] = []
        self._entries: List[int] = []
        self._bytes = 0
        # the table as the kernel reads it: pinned host rows written in order during a batch
        # (a row is copied to the device when the stream gets to it: never written twice before
        # the read's wait), and one device table reused by every launch (stream order)
        self._table_host = torch.empty(0, dtype=torch.int64)
        self._table_np: Any = self._table_host.numpy()  # its NumPy view (writes without a torch op)
        self._table_at = 0
        self._table_dev = torch.empty(0, dtype=torch.int64, device=device)
        self._old_tables: List[torch.Tensor] = []  # host tables outgrown this batch (rows in flight)
        self.eager: Set[object] = set()  # modules whose frames are measured at once (see above)
        self.learning = True  # the first batch: every frame at once, versions checked at the read
        self._learn: List[Tuple["weakref.ref[torch.Tensor]", int, object]] = []
        self.launches = 0  # table launches, for the tests' and benchmarks' counts
        # slot codes (take_one): the read number, and per read kept the decoded values and the
        # slots whose values were lost (decoded)
        self.epoch = 0
        self._decoded: Dict[int, Tuple[torch.Tensor, Set[int]]] = {}
        self._lost: Set[int] = set()
        self.several = torch.cuda.device_count() > 1 if self.cuda else False  # (a tensor's device is checked)
        self.changed_seen = 0  # SlotStats that said `changed`

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity)
        slots = torch.zeros(2 * cap, dtype=torch.int32, device=self.device)
        if self.used:
            slots[:2 * self.used].copy_(self.slots[:2 * self.used])
        self.slots = slots
        self.host = torch.empty(2 * cap, dtype=torch.int32, pin_memory=self.cuda)
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
            entries, waiting = self._entries, self._waiting
            for j, t in enumerate(tensors):
                entries += (t.data_ptr(), t.numel(), _CODES[t.dtype], 2 * (first + j))
                waiting.append(t)
                self._versions.append(t._version)
                self._keys.append(key)
                self._bytes += t.numel() * t.element_size()
            self._waiting_stats += stats
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
            self._entries += (t.data_ptr(), n, code, 2 * slot)
            waiting = self._waiting
            waiting.append(t)
            self._waiting_stats.append(slot)
            self._versions.append(t._version)
            self._keys.append(key)
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
        return self._decoded.get(epoch)

    def flush(self) -> None:
        """Launch the waiting tensors' table (nothing when none waits)."""
        if self._waiting:
            with self._lock:
                self._flush()

    def _flush(self) -> None:
        waiting = self._waiting
        if not waiting:
            return
        entries = self._entries
        stats = self._waiting_stats
        for j, t in enumerate(waiting):
            # written since its module returned (FSDP frees parameters' storage: those are checked)
            if t._version != self._versions[j] or (t.__class__ is _PARAMETER and _released(t)):
                stat = stats[j]
                if stat.__class__ is int:
                    self._lost.add(stat)
                else:
                    stat.changed = True
                self.changed_seen += 1
                self.eager.add(self._keys[j])
        count = len(waiting)
        longest = max(t.numel() for t in waiting)
        block, most = (_BLOCK_CUDA, _TABLE_PROGRAMS_CUDA) if self.cuda else (_BLOCK_INTERPRETED, _PROGRAMS_INTERPRETED)
        programs = max(1, min(-(-longest // block), most // count))
        launch_table(self, entries, count, programs, block)
        self.launches += 1
        self._waiting, self._waiting_stats, self._versions, self._keys, self._entries = [], [], [], [], []
        self._bytes = 0

    def stage(self, entries: List[int]) -> torch.Tensor:
        """The table kernel's rows for `entries` on the device: written to the next free rows of
        the pinned host table (never rewritten before the read's wait, so each asynchronous copy
        reads what was written for it), then copied to the device table (reused by every launch:
        stream order keeps a launch's rows until it ran)."""
        m = len(entries)
        if self._table_at + m > self._table_host.numel():
            if self._table_at:
                self._old_tables.append(self._table_host)
            self._table_host = torch.empty(max(4 * m, 2 * self._table_host.numel(), 1024), dtype=torch.int64,
                                           pin_memory=self.cuda)
            self._table_np = self._table_host.numpy()
            self._table_at = 0
        if self._table_dev.numel() < m:
            self._table_dev = torch.empty(max(m, 4 * FLUSH_TENSORS), dtype=torch.int64, device=self.device)
        at = self._table_at
        rows = self._table_host[at:at + m]
        self._table_np[at:at + m] = entries  # (one C-level write of the Python ints into the pinned rows)
        self._table_at = at + m
        table = self._table_dev[:m]
        table.copy_(rows, non_blocking=self.cuda)
        return table

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
            if self.host.numel() < n + m:
                self.host = torch.empty(max(n + m, 2 * self.host.numel()), dtype=torch.int32, pin_memory=self.cuda)
            host = self.host[:n + m]
            event = self.event  # (CUDA buffers only)
            with torch.cuda.device(self.device) if event is not None else _nothing():
                # on the buffer's device's current stream, where its kernels ran
                src = self.slots[:n] if words is None else torch.cat([self.slots[:n], words])
                host.copy_(src, non_blocking=event is not None)
                if event is not None:
                    event.record()
                if n:
                    self.slots[:n].zero_()
            if event is not None:
                event.synchronize()
            self._table_at = 0  # every table row has reached the device
            self._old_tables = []
            if self.learning:
                self._learned()
            rest = host[n:].view(torch.float64).tolist() if m else []
            # every pair decoded: slot codes look their values up by slot (a counts word of a
            # counted slot decodes to a number nobody reads)
            decoded = decode_words(host[:n])
            epoch = self.epoch
            self._decoded[epoch] = (decoded, self._lost)
            self._decoded.pop(epoch - KEPT_READS, None)
            self._lost = set()
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


class DeviceStats:
    """The device path of one recorder: a slot buffer per device whose backend is the fused
    kernel, chosen once per device."""

    def __init__(self) -> None:
        self.cpu = DEVICE_PATH.mode == "force" and triton_interpreting()
        self.buffers: Dict[int, Optional[SlotBuffer]] = {}
        # the buffer, while there is exactly one (a model on one GPU): the one-in-one-out frames'
        # (FrameRecorder._device_call); None before the first and once there are several
        self.one: Optional[SlotBuffer] = None
        self.coder: Optional[SlotBuffer] = None  # the buffer that gave slot codes (the one `one` was)
        self.interpreted = triton_interpreting()
        self._lock = threading.Lock()

    def buffer(self, key: int) -> Optional[SlotBuffer]:
        """The buffer of device `key` (a CUDA index, or _CPU_KEY), made on first use; None when
        that device does not take the device path."""
        buffers = self.buffers
        if key in buffers:
            return buffers[key]  # a SlotBuffer, or None: decided
        with self._lock:
            if key not in self.buffers:
                ok = (key == _CPU_KEY) == self.interpreted and kernel(self.interpreted) is not None
                dev = torch.device("cpu") if key == _CPU_KEY else torch.device("cuda", key)
                self.buffers[key] = SlotBuffer(dev) if ok else None
                made = [b for b in self.buffers.values() if b is not None]
                self.one = made[0] if len(made) == 1 else None
                if self.one is not None:
                    self.coder = self.one
            return self.buffers[key]

    def frame(self) -> "DeviceFrame":
        return DeviceFrame(self)


# launch shape: elements per program and loop step, and most programs per launch
_BLOCK_CUDA, _PROGRAMS_CUDA = 2048, 1024
_TABLE_PROGRAMS_CUDA = 4096  # programs of a table launch, all its tensors together (small ones exit at once)
_BLOCK_INTERPRETED, _PROGRAMS_INTERPRETED = 8192, 2
#: elements a tensor with a counts layout may have: each count is an int32 word read as
#: unsigned, exact below 2**32 (larger tensors keep the torch ops' counts)
MAX_COUNTED = 1 << 32


class DeviceFrame:
    """One thread's tensors of a module call gathered for one launch (`add`, then `launch`)."""

    __slots__ = ("stats", "tensors", "keys")

    def __init__(self, stats: DeviceStats) -> None:
        self.stats = stats
        self.tensors: List[torch.Tensor] = []
        self.keys: List[int] = []

    def add(self, t: torch.Tensor, counted: bool = False) -> bool:
        """Take `t` when the kernel reads it as it is (a plain dense contiguous non-empty
        float32/16/bf16 tensor on a device of the device path, below MAX_COUNTED elements when
        it is to be `counted` with a CountLayout); False otherwise."""
        if t.__class__ not in _PLAIN or t.dtype not in KERNEL_DTYPES or t.layout is not _STRIDED \
                or not t.is_contiguous() or not t.numel() or (counted and t.numel() >= MAX_COUNTED):
            return False
        if t.is_cuda:
            key = t.get_device()
        elif t.is_cpu and self.stats.cpu:
            key = _CPU_KEY
        else:
            return False
        if self.stats.buffer(key) is None:
            return False
        self.tensors.append(t)
        self.keys.append(key)
        return True

    def clear(self) -> None:
        self.tensors = []
        self.keys = []

    def launch(self, layout: Optional[CountLayout] = None) -> List[SlotStat]:
        """Measure the gathered tensors (one launch per device and MAX_TENSORS tensors; with a
        CountLayout their counts too, and a second launch when it has scaled targets) and
        return their SlotStats in the order they were added; the frame is emptied."""
        tensors, keys = self.tensors, self.keys
        self.tensors, self.keys = [], []
        if not tensors:
            return []
        key = keys[0]
        if keys.count(key) == len(keys):
            return self._launch(key, tensors, layout)
        by_place: Dict[int, SlotStat] = {}
        for k in dict.fromkeys(keys):
            idx = [i for i, x in enumerate(keys) if x == k]
            by_place.update(zip(idx, self._launch(k, [tensors[i] for i in idx], layout)))
        return [by_place[i] for i in range(len(tensors))]

    def defer(self, key: object) -> List[SlotStat]:
        """As `launch`, for a forward frame of module `key`: the tensors wait in their device's
        table for a launch that measures many frames' tensors at once (SlotBuffer.defer)."""
        tensors, keys = self.tensors, self.keys
        self.tensors, self.keys = [], []
        if not tensors:
            return []
        k0 = keys[0]
        if keys.count(k0) == len(keys):
            return self._buffer(k0).defer(tensors, key)
        by_place: Dict[int, SlotStat] = {}
        for k in dict.fromkeys(keys):
            idx = [i for i, x in enumerate(keys) if x == k]
            by_place.update(zip(idx, self._buffer(k).defer([tensors[i] for i in idx], key)))
        return [by_place[i] for i in range(len(tensors))]

    def _buffer(self, key: int) -> SlotBuffer:
        buf = self.stats.buffer(key)
        assert buf is not None  # add() took these tensors only with a buffer
        return buf

    def launch_flagged(self) -> Optional[Tuple[List[SlotStat], torch.Tensor]]:
        """Measure the gathered tensors, all on one device, as `launch` does, and also return a
        0-d float32 tensor on that device: 1.0 when any of them holds inf or NaN, else 0.0 (a
        fused optimizer's `found_inf`), computed on the device from their slots: nothing is
        read. None, and nothing launched, when the tensors are on several devices or none
        were gathered; the frame is emptied either way."""
        tensors, keys = self.tensors, self.keys
        self.tensors, self.keys = [], []
        if not tensors or keys.count(keys[0]) != len(keys):
            return None
        buf = self.stats.buffer(keys[0])
        assert buf is not None  # add() took these tensors only with a buffer
        first, stats = self._launch_at(buf, tensors, None)
        # each tensor's abs max word: inf or NaN iff its pattern is at least inf's
        with _on_device(buf):
            his = buf.slots[2 * first + 1:2 * (first + len(tensors)):2]
            flag = (his >= _INF_BITS).any().to(torch.float32)
        return stats, flag

    def _launch(self, key: int, tensors: List[torch.Tensor], layout: Optional[CountLayout]) -> List[SlotStat]:
        buf = self.stats.buffer(key)
        assert buf is not None  # add() took these tensors only with a buffer
        return self._launch_at(buf, tensors, layout)[1]

    @staticmethod
    def _launch_at(buf: SlotBuffer, tensors: List[torch.Tensor], layout: Optional[CountLayout]
                   ) -> Tuple[int, List[SlotStat]]:
        first, stats = buf.take(len(tensors), layout)
        per = 1 if layout is None else layout.words // 2
        for i in range(0, len(tensors), MAX_TENSORS):
            part = tensors[i:i + MAX_TENSORS]
            if layout is None:
                launch(buf, first + i, part)
            else:
                launch(buf, first + per * i, part, layout)
                if layout.scaled:
                    launch_scaled(buf, first + per * i, part, layout)
        return first, stats


def _shape(buf: SlotBuffer, tensors: List[torch.Tensor]) -> Tuple[int, int, Tuple[int, ...]]:
    """(elements per program, programs, sizes) of a launch over `tensors`."""
    longest = max(t.numel() for t in tensors)
    if buf.cuda:
        block, most = _BLOCK_CUDA, _PROGRAMS_CUDA
    else:
        block, most = _BLOCK_INTERPRETED, _PROGRAMS_INTERPRETED
    return block, min(most, -(-longest // block)), tuple(t.numel() for t in tensors)


def _kernels(buf: SlotBuffer) -> Tuple[Any, Any, Any]:
    k = kernel(not buf.cuda)
    assert k is not None  # a buffer exists only with its kernels
    return k


def _on_device(buf: SlotBuffer) -> Any:
    """The buffer's device made current for a launch, when it is another CUDA device."""
    if buf.cuda and buf.device.index != torch.cuda.current_device():
        return torch.cuda.device(buf.device)
    return _nothing()


def launch(buf: SlotBuffer, first: int, tensors: List[torch.Tensor], layout: Optional[CountLayout] = None) -> None:
    """One kernel launch measuring `tensors` into slots first, first + 1, ... of `buf` (with
    a CountLayout: first, first + layout.words // 2, ..., and their direct counts)."""
    k = _kernels(buf)[0]
    block, programs, sizes = _shape(buf, tensors)
    if layout is None:
        ranges, stride, n_ranges, ranges_p2 = buf.slots, 2, 0, 1
    else:
        ranges, stride, n_ranges, ranges_p2 = layout.args(buf.device)[0], layout.words, \
            layout.width - len(layout.scaled), layout.ranges_p2
    with _on_device(buf):
        k[(programs,)](buf.slots, tuple(tensors), sizes, first, programs, ranges, BLOCK=block, STRIDE=stride,
                       RANGES=n_ranges, RANGES_P2=ranges_p2)


def launch_table(buf: SlotBuffer, entries: List[int], count: int, programs: int, block: int) -> None:
    """One launch of the table kernel over `count` tensors listed in `entries` (four ints each:
    address, elements, dtype code, first slot word; SlotBuffer.defer), `programs` programs
    each, their rows staged and copied to the device first (SlotBuffer.stage)."""
    with _on_device(buf):
        table = buf.stage(entries)
        _kernels(buf)[2][(count, programs)](buf.slots, table, BLOCK=block)


def launch_scaled(buf: SlotBuffer, first: int, tensors: List[torch.Tensor], layout: CountLayout) -> None:
    """The second launch for a CountLayout with scaled (8-bit) targets, after `launch` on the
    same tensors and slots (in stream order: it reads their abs max from the slots)."""
    k = _kernels(buf)[1]
    block, programs, sizes = _shape(buf, tensors)
    scaled = layout.args(buf.device)[1]
    with _on_device(buf):
        k[(programs,)](buf.slots, tuple(tensors), sizes, first, programs, scaled, BLOCK=block, STRIDE=layout.words,
                       COLUMN=2 + layout.width - len(layout.scaled), SCALED=len(layout.scaled),
                       SCALED_P2=layout.scaled_p2)
