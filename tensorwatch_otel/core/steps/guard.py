"""The step guard: the gradients an optimizer step will consume, checked before it runs; the
non-finite gradients a backward left that no step has consumed yet.

A non-finite gradient is a detection only when a step consumes it. Without `gradients=True`,
the StepGuard checks the gradients a step is about to consume in one host read, before the
step runs: an inf born in the loss or in the backward is named at the
parameter's gradient before the optimizer writes NaN into the weights. GradScaler's skipped
steps never reach the optimizer's step, so the guard never sees them (a fused optimizer that
takes the scaler's found_inf and skips itself: the guard reads that verdict instead). A step
given a closure is checked when the closure has run its forward and backward. The steps
themselves are seen by core/steps/tracker.py; skipped steps are counted by core/steps/scaler.py.
"""

from __future__ import annotations

import logging
import math
import operator
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import torch

from ..frame_draft import FrameDraft, ModuleInfo
from ..record import Record
from ..frames.finite import all_finite
from ..measure.stats import measure

if TYPE_CHECKING:
    from ..measure.device_stats import DeviceStats
    from ..measure.slot_buffer import SlotStat
    from ..frames.param_index import ParamIndex


log = logging.getLogger(__name__)
_grad_of = operator.attrgetter("grad")
_first = operator.itemgetter(0)


class PendingGradients:
    """Non-finite gradients at the end of a backward, not yet consumed by a step.

    `marks` remember, for the first bad parameters, which gradient tensor held the bad values
    and at which version: if it is gone or was written since (zero_grad, GradScaler.unscale_),
    the gradients were reset; unchanged means they are still accumulating."""

    __slots__ = ("record", "frame", "marks")

    def __init__(self, record: Record, frame: int, params: List[torch.Tensor]):
        self.record = record
        self.frame = frame
        self.marks: List[Tuple[weakref.ref[torch.Tensor], int, int]] = []
        for p in params[:4]:
            g = p.grad
            if g is not None:
                self.marks.append((weakref.ref(p), id(g), g._version))

    def was_reset(self, by_version: bool = True) -> bool:
        """True when a bad gradient is gone, replaced, or (`by_version`) written in place since.
        After a backward only replacement counts: accumulation writes in place too."""
        for ref, gid, version in self.marks:
            p = ref()
            if p is None:
                return True
            g = p.grad
            if g is None or id(g) != gid or (by_version and g._version != version):
                return True
        return not self.marks


#: Devices whose gradients the guard checks with one fused inf-norm (a launch or two for all of
#: them); elsewhere (CPU) the statistics kernel reads all of them in one call, which is faster there.
FUSED_DEVICES = ("cuda",)
Watched = List[Tuple[torch.Tensor, ModuleInfo, str]]  # (parameter, its module, "weight.grad")


class StepGuard:
    """The gradients an optimizer step will consume, checked before it runs: one host read per
    step (CUDA: one fused inf-norm over each device's gradients; CPU: one call of the
    statistics kernel for all dense gradients, its values on the host at once, no read of its
    own), then, only when that read finds inf/nan, a record of every gradient to name the
    first bad one. Where the step need not wait (`launch`), no read: the gradients go into the
    device path's slot buffer, with a device flag for a fused optimizer. Only parameters of
    watched modules (`index.owners`, see core/frames/attach.py) count; the list is made again when the
    model's parameters change."""

    def __init__(self, index: ParamIndex, device: Optional[DeviceStats] = None) -> None:
        self._index = index
        self._device = device  # the recorder's device path (its slot buffers), or None
        self._params: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Tuple[Tuple[int, ...], Watched]]" = \
            weakref.WeakKeyDictionary()

    def _watched(self, optimizer: torch.optim.Optimizer) -> Watched:
        groups = optimizer.param_groups
        index = self._index
        key = (index.generation,) + tuple(len(g["params"]) for g in groups)
        cached = self._params.get(optimizer)
        if cached is not None and cached[0] == key:
            return cached[1]
        owners = index.owners
        found: Dict[int, torch.Tensor] = {}
        for g in groups:
            for p in g["params"]:
                if index.owner(p) is not None:
                    found[id(p)] = p
        # backward order, roughly: the model's parameters last to first, whatever the groups
        # (weight decay splits them): the parameters nearest the loss get their gradients first,
        # so the first bad one in this order is the nearest to where the backward broke
        out: Watched = [(found[pid], owners[pid][0], owners[pid][1] + ".grad")
                        for pid in reversed(list(owners)) if pid in found]
        try:
            self._params[optimizer] = (key, out)
        except TypeError:
            pass
        return out

    def check(self, optimizer: torch.optim.Optimizer, batch: int) -> Optional[Record]:
        """None when every gradient the step consumes is finite (one host read); else a
        backward record of all of them, on the host, with a non-finite frame."""
        watched = self._watched(optimizer)
        if not watched:
            return None
        with torch.no_grad():
            if self._all_finite(watched):
                return None
            return self._locate(watched, batch)

    def launch(self, optimizer: torch.optim.Optimizer, batch: int) -> Optional["LaunchedCheck"]:
        """The check without a read, where the device path takes every gradient the step
        consumes (on one device): their abs min/max measured into the slot buffer (a launch per
        MAX_TENSORS gradients), whose next read-back (the next batch's) brings them to the host,
        and a flag on the device for a fused optimizer's `found_inf`. None, with nothing
        launched, where a read is needed (gradients on the CPU kernel's route, on several
        devices, sparse or of other dtypes)."""
        device = self._device
        if device is None:
            return None
        frame = device.frame()
        places: List[Tuple[ModuleInfo, str, torch.dtype]] = []  # (no gradient is held: their places only)
        for p, info, name in self._watched(optimizer):
            g = p.grad
            if g is None:
                continue
            if not frame.add(g):
                frame.clear()
                return None
            places.append((info, name, g.dtype))
        if not places:
            return None
        with torch.no_grad():
            launched = frame.launch_flagged()
        if launched is None:
            return None
        slots, flag = launched
        return LaunchedCheck(batch, places, slots, flag)

    @staticmethod
    def _all_finite(watched: Watched) -> bool:
        grads = [g for g in map(_grad_of, map(_first, watched)) if g is not None]
        return all_finite(grads, FUSED_DEVICES)

    @staticmethod
    def _locate(watched: Watched, batch: int) -> Record:
        return gradient_record(batch, [(info, name, measure(g), g.dtype)
                                       for p, info, name in watched if (g := p.grad) is not None])


def gradient_record(batch: int, rows: List[Tuple[ModuleInfo, str, Union[str, Tuple[Any, ...]], torch.dtype]]
                    ) -> Record:
    """The backward record of batch `batch`: a frame per gradient row (its module, its name
    "weight.grad", its (abs min, abs max) or note, its dtype), read back."""
    rec = Record(batch, phase="backward")
    for info, name, result, dtype in rows:
        d = FrameDraft()
        d.add(name, result, dtype)
        rec.add_frame(info, d)
    rec.readback()
    return rec


class LaunchedCheck:
    """A step guard's check launched on the device (StepGuard.launch) whose values a later
    read-back brings to the host. `flag`: a 0-d float32 tensor on the gradients' device, 1.0
    when any of them holds inf/nan (a fused optimizer's `found_inf`)."""

    __slots__ = ("batch", "places", "slots", "flag")

    def __init__(self, batch: int, places: List[Tuple[ModuleInfo, str, torch.dtype]], slots: List[SlotStat],
                 flag: torch.Tensor) -> None:
        self.batch = batch
        self.places = places  # per gradient: its module, its name ("weight.grad"), its dtype
        self.slots = slots
        self.flag = flag

    def verdict(self) -> Optional[Tuple[Record, int]]:
        """None when every gradient was finite; else the backward record of all of them, on the
        host, and the frame of the first bad one. Reads the buffer when no read-back has since
        the launch (one copy)."""
        slots = self.slots
        if not all(s.read for s in slots):
            slots[0].buffer.read()  # (one buffer: launch_flagged takes one device)
        if all(math.isfinite(s.hi) for s in slots):
            return None
        # (floats: its read-back is no transfer)
        rec = gradient_record(self.batch, [(info, name, (s.lo, s.hi), dtype)
                                           for (info, name, dtype), s in zip(self.places, slots)])
        fi = rec.first_nonfinite_frame(0)
        return None if fi is None else (rec, fi)
