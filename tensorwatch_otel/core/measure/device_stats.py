"""The device path of one recorder (`DeviceStats`): a module call's dense 16/32-bit float tensors
gathered (`DeviceFrame`) and measured by the fused Triton kernels into a per-batch slot buffer per
device, read back in one copy per batch.

Which devices take the path, and its kernels, are device_path.py's; the buffer (slot_buffer.py)
takes each tensor's slot and launches the kernels (device_launch.py); slot_words.py says what a
slot holds.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .device_path import DEVICE_PATH, KERNEL_DTYPES, kernel, triton_interpreting
from .device_launch import on_device
from .slot_buffer import SlotBuffer, SlotStat
from .slot_words import INF_BITS, CountLayout

#: elements a tensor with a counts layout may have: each count is an int32 word read as
#: unsigned, exact below 2**32 (larger tensors keep the torch ops' counts)
MAX_COUNTED = 1 << 32
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_CPU_KEY = -1  # a buffer's key: the CUDA device index, or this for the CPU


class DeviceStats:
    """The device path of one recorder: a slot buffer per device whose backend is the fused
    kernel, chosen once per device."""

    def __init__(self) -> None:
        self.cpu = DEVICE_PATH.mode == "force" and triton_interpreting()
        self.buffers: Dict[int, Optional[SlotBuffer]] = {}
        # the buffer, while there is exactly one (a model on one GPU): the one-in-one-out frames'
        # (core/frames/device_calls.py); None before the first and once there are several
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
        return _per_device(tensors, keys, lambda k, ts: self._launch(k, ts, layout))

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
        return _per_device(tensors, keys, lambda k, ts: self._buffer(k).defer(ts, key))

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
        first, stats = buf.measure(tensors, None)
        # each tensor's abs max word: inf or NaN iff its pattern is at least inf's
        with on_device(buf):
            his = buf.slots[2 * first + 1:2 * (first + len(tensors)):2]
            flag = (his >= INF_BITS).any().to(torch.float32)
        return stats, flag

    def _launch(self, key: int, tensors: List[torch.Tensor], layout: Optional[CountLayout]) -> List[SlotStat]:
        buf = self.stats.buffer(key)
        assert buf is not None  # add() took these tensors only with a buffer
        return buf.measure(tensors, layout)[1]


def _per_device(tensors: List[torch.Tensor], keys: List[int],
                measure: Callable[[int, List[torch.Tensor]], List[SlotStat]]) -> List[SlotStat]:
    """A frame's tensors on several devices: `measure(device key, its tensors)` per device, the
    SlotStats back in the order the tensors were added (a frame on one device takes none of it)."""
    by_place: Dict[int, SlotStat] = {}
    for k in dict.fromkeys(keys):
        idx = [i for i, x in enumerate(keys) if x == k]
        by_place.update(zip(idx, measure(k, [tensors[i] for i in idx])))
    return [by_place[i] for i in range(len(tensors))]
