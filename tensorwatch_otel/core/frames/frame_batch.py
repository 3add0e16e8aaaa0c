"""One thread's frame in progress (`FrameBatch`): the dense tensors a module call's hook walks,
gathered and measured in one kernel call when the frame is complete (the CPU kernel, or the fused
device kernel on the device path), their values put in the frame's draft and the recorder's
caches (core/frames/recorder.py)."""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

import torch

from ..frame_draft import FrameDraft, ModuleInfo
from ..record import Record
from ..measure.cpu_kernel import KERNEL
from ..measure.device_stats import DeviceFrame, DeviceStats
from ..measure.host_batch import HostBatch
from ..measure.slot_buffer import SlotStat
from ..measure.slot_words import CountLayout
from ..measure.stats import measure_host as measure

# a tensor's places in its frame's draft until the frame's kernel call fills them (finish(),
# before the draft goes to the record: a frame that fails is dropped with them)
UNREAD: Tuple[float, float] = (math.nan, math.nan)  # placeholders, never read

# a measurement: two 0-d device tensors, two floats on the host (the CPU kernel), or a device
# buffer's slot at both places until the batch's read-back (core/measure/slot_buffer.py)
StatPair = Union[Tuple[torch.Tensor, torch.Tensor], Tuple[float, float], Tuple[SlotStat, SlotStat], Tuple[int, int]]
# the recorder's caches: id(param) -> (param, version, data_ptr, dtype, (mn, mx)); id(tensor) ->
# (weakref, version, (mn, mx), dtype)
ParamsSeen = Dict[int, Tuple[torch.Tensor, int, int, torch.dtype, StatPair]]
ActSeen = Tuple["weakref.ref[torch.Tensor]", int, StatPair, torch.dtype]
ActsSeen = Dict[int, ActSeen]


class FrameBatch(threading.local):
    """One thread's frame in progress: its dense tensors, measured in one kernel call when the
    frame is complete (each thread has its own: a model may be called from several). `gather`
    takes them: the CPU kernel's HostBatch, or on a device-path recorder this object, which
    gives each tensor to the fused device kernel when its device takes the device path and to
    the CPU kernel otherwise (`on_device`: which one, per tensor taken)."""

    def __init__(self, device: Optional[DeviceStats]) -> None:
        self.host = HostBatch()
        self.device: Optional[DeviceFrame] = None if device is None else device.frame()
        self.gather: Union[HostBatch, FrameBatch] = self.host if self.device is None else self
        self.on_device: List[bool] = []
        # (stats position, tensor, True for a parameter / False / the position of its twin, version, data_ptr)
        self.pending: List[Tuple[int, torch.Tensor, Union[bool, int], int, int]] = []
        # id -> (stats position, tensor, version) gathered this frame
        self.acts: Dict[int, Tuple[int, torch.Tensor, int]] = {}
        self.on = False

    def add(self, t: torch.Tensor) -> bool:
        """(A device-path recorder's `gather`.) Take `t` for the device kernel, else for the CPU
        kernel; False when neither reads it as it is."""
        device = self.device  # (never None here: gather is self only with a device)
        if device is not None and device.add(t):
            self.on_device.append(True)
            return True
        if self.host.add(t):
            self.on_device.append(False)
            return True
        return False

    def clear(self) -> None:
        self.host.clear()
        if self.device is not None:
            self.device.clear()
        self.on_device = []

    def measure(self, pending: List[Tuple[int, torch.Tensor, Union[bool, int], int, int]],
                layout: Optional[CountLayout], key: object) -> List[Any]:
        """(A device-path recorder's frame end.) The values of the tensors taken, two places per
        tensor in the order taken: a SlotStat (at both) for the device kernel's, floats for the
        CPU kernel's (each measured alone when that kernel is not loaded). With target_dtypes
        (`layout`) only the device kernel takes tensors, and counts them too, at once; else
        they wait for a launch with other frames' (DeviceFrame.defer; `key`: the module)."""
        on_device, self.on_device = self.on_device, []
        device = self.device
        slots = (device.launch(layout) if layout is not None else device.defer(key)) \
            if device is not None and True in on_device else []
        floats = self.host.measure() if False in on_device else None
        taken = [t for _, t, twin, _, _ in pending if twin.__class__ is not int]
        values: List[Any] = []
        i = j = 0
        for t, dev in zip(taken, on_device):
            if dev:
                values += (slots[i], slots[i])
                i += 1
            elif floats is not None:
                values += floats[j:j + 2]
                j += 2
            else:
                m = measure(t)
                values += (float("nan"), float("nan")) if isinstance(m, str) else m
        return values

    def start(self) -> None:
        """Dense float tensors of one frame go to the kernel in one call (at finish()): the
        CPU kernel when it is loaded, or the fused device kernel on the device path; each is
        still measured during the hook that sees it."""
        self.on = self.device is not None or getattr(KERNEL.get(), "host_many", None) is not None

    def finish(self, rec: Record, d: FrameDraft, info: ModuleInfo, params_seen: ParamsSeen, acts_seen: ActsSeen,
               counted_slot: Callable[[SlotStat], None]) -> None:
        """Measure the frame's gathered tensors (one kernel call) and put their values in the
        draft's places and the recorder's caches (`counted_slot`: a SlotStat that is a tensor's
        counts row too, with target_dtypes)."""
        pending = self.pending
        self.on = False
        if not pending:
            return
        self.pending = []
        self.acts.clear()
        values: Optional[Sequence[Any]]  # floats, or SlotStats (each at both its places)
        precision = rec.precision
        plan = precision.plan if precision is not None else None
        counted = plan is not None  # target_dtypes: each SlotStat is the tensor's counts row too
        if self.device is not None:  # the device kernel's SlotStats, and the CPU kernel's floats
            # (a lent parameter, accelerate's offload, lives for the call only: measured at once)
            values = self.measure(pending, plan.device_layout() if plan is not None else None,
                                None if info.lent else info)
        else:
            values = self.host.measure()
        stats = d.stats
        if values is None:  # the kernel went away meanwhile (tests): measure each as before
            for pos, t, is_param, _version, _ptr in pending:
                m = measure(t) if is_param.__class__ is not int else (stats[is_param], stats[is_param + 1])
                if isinstance(m, str):  # (never for a tensor the kernel took)
                    m = (float("nan"), float("nan"))
                stats[pos], stats[pos + 1] = m
            return
        j = 0
        for pos, t, is_param, version, ptr in pending:
            if is_param.__class__ is int:  # the same tensor as at position is_param, earlier
                stats[pos] = stats[is_param]
                stats[pos + 1] = stats[is_param + 1]
                continue
            r: StatPair = (values[j], values[j + 1])
            j += 2
            stats[pos] = r[0]
            stats[pos + 1] = r[1]
            if counted:  # (only the device kernel's SlotStats here)
                slot = cast(SlotStat, r[0])
                d.counts[pos // 2] = slot
                counted_slot(slot)
            if is_param:
                params_seen[id(t)] = (t, version, ptr, t.dtype, r)
            else:
                try:
                    acts_seen[id(t)] = (weakref.ref(t), version, r, t.dtype)
                except (TypeError, RuntimeError):  # no weakref (inference tensors): no reuse
                    pass

    def abandon(self) -> None:
        """A frame that could not be taken: its draft is dropped (the record never saw it), and
        so is what this thread gathered for it."""
        self.pending = []
        self.acts.clear()
        self.gather.clear()
        self.on = False
