"""Optimizer steps as the watcher sees them: weights change at a step, a non-finite gradient
is a detection only when a step consumes it, and a step that does not happen while the
gradients hold inf/nan (a GradScaler skip, or gradients reset without a step) is a skipped
step: counted, reported, and an alert of its own when `max_skipped_steps` come in a row.

Without `gradients=True`, the StepGuard checks the gradients a step is about to consume in one
host read, before the step runs: an inf born in the loss or in the backward is named at the
parameter's gradient before the optimizer writes NaN into the weights. GradScaler's skipped
steps never reach the optimizer's step, so the guard never sees them (a fused optimizer that
takes the scaler's found_inf and skips itself: the guard reads that verdict instead). A step
given a closure is checked when the closure has run its forward and backward.

Steps are seen through torch's global optimizer step hooks (any optimizer, fused or not);
each watcher keeps the handles and removes them on detach.
"""

from __future__ import annotations

import logging
import math
import operator
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .events import SkippedNonFiniteStepEvent, SkippedStepEvent, SkipStreakEvent, merge_kinds
from .record import FrameDraft, ModuleInfo, Record
from .skip import is_stand_in
from .finite import all_finite
from .graph_stats import constant_result
from .process import said_once
from .stats import measure

if TYPE_CHECKING:
    from .device_stats import DeviceStats, SlotStat
    from .param_index import ParamIndex

StepArgs = Tuple[Tuple[Any, ...], Dict[str, Any]]  # an optimizer step's (args, kwargs)
SkipEvent = Union[SkippedStepEvent, SkipStreakEvent]

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


_compiling = torch.compiler.is_compiling


def _may_break() -> bool:
    """At trace time: the step being compiled may be split around a hook (False under
    `fullgraph=True` or `error_on_graph_break`, where a split would fail the user's compile;
    said once, loudly, since the step guard and on_detect="skip" then cannot act)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx: Any = InstructionTranslator.current_tx()
        may = not (getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception as exc:  # an internal of torch's that moved: no split, and say so
        log.debug("tensorwatch_otel: cannot tell whether a compiled step may break: %s", exc)
        may = False
    if not may and said_once("compiled step in one graph"):
        log.error("tensorwatch_otel: an optimizer step is compiled into one graph (fullgraph=True): the "
                  "watcher's step hooks cannot run inside it, so this step's gradients are not checked "
                  "(guard_steps) and on_detect=\"skip\" cannot skip it; compile the step with "
                  "fullgraph=False (torch's own optimizers need it) to keep them; said once")
    return may


# called at trace time, its answer a constant of the graph being traced (marked for dynamo at
# the first watch(), with graph_stats' others: loading dynamo at import would cost a second, and
# import Triton before a test suite's device tests choose its interpreter)
_graph_may_break: Callable[[], bool] = constant_result(_may_break)


def outside_graphs(fn: Callable[..., Any], otherwise: Optional[Callable[..., Any]] = None) -> Callable[..., Any]:
    """`fn` (a global optimizer step hook, or a step's closure with its check) run at every
    step, compiled steps included.

    Dynamo would trace it into a compiled step (`torch.compile(lambda: opt.step())`): it would
    run once, at trace time, and never again, so a bad gradient would reach the weights
    unchecked. Disabled for dynamo, it splits the compiled step around it (torch's own optimizers
    split there anyway, around the update) and runs eagerly at every step. Where the step must be
    one graph, `otherwise` runs instead (None: nothing), said once (_graph_may_break)."""
    eager = torch._dynamo.disable(fn)

    def call(*args: Any, **kwargs: Any) -> Any:
        if _compiling() and not _graph_may_break():
            return otherwise(*args, **kwargs) if otherwise is not None else None
        return eager(*args, **kwargs)

    return call


class StepTracker:
    """Registers the global step hooks and tells the watcher which steps concern its model: an
    optimizer whose parameters include one the model holds (`index`, see core/attach.py).
    `refresh()` runs first at every step, so parameters replaced since the last batch are found
    before the step is judged (a replaced parameter's id is never trusted)."""

    def __init__(self, index: ParamIndex, refresh: Callable[[], None], on_pre_step: Callable[..., Any],
                 on_post_step: Callable[[torch.optim.Optimizer], None]):
        self._index = index
        self._refresh = refresh
        # optimizer -> (its group sizes, the index generation, concerns the model)
        self._mine: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Tuple[Tuple[int, ...], int, bool]]" = \
            weakref.WeakKeyDictionary()
        self._on_pre = on_pre_step
        self._on_post = on_post_step
        self.steps = 0
        self.handles = [register_optimizer_step_pre_hook(outside_graphs(self._pre)),
                        register_optimizer_step_post_hook(outside_graphs(self._post))]

    def _concerns(self, optimizer: torch.optim.Optimizer) -> bool:
        groups = optimizer.param_groups
        key = tuple(len(g["params"]) for g in groups)
        generation = self._index.generation
        seen = self._mine.get(optimizer)
        if seen is not None and seen[0] == key and seen[1] == generation:
            return seen[2]
        holds = self._index.holds
        mine = any(holds(p) for g in groups for p in g["params"])
        try:
            self._mine[optimizer] = (key, generation, mine)
        except TypeError:
            pass
        return mine

    def _pre(self, optimizer: torch.optim.Optimizer, args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Optional[StepArgs]:
        if is_stand_in(optimizer):  # a skipped step's own super().step(): not a step of its own
            return None
        self._refresh()
        if self._concerns(optimizer):
            closure = args[1] if len(args) > 1 else kwargs.get("closure")  # (args[0] is the optimizer)
            # with a closure the step computes its gradients itself: they are checked after it;
            # new (args, kwargs) come back for that, or to skip the step (on_detect="skip")
            result: Optional[StepArgs] = self._on_pre(optimizer, closure if callable(closure) else None, args, kwargs)
            return result
        return None

    def _post(self, optimizer: torch.optim.Optimizer, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if not is_stand_in(optimizer) and self._concerns(optimizer):
            self.steps += 1
            self._on_post(optimizer)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


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
    watched modules (`index.owners`, see core/attach.py) count; the list is made again when the
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


class ScaleReader:
    """The GradScaler's scale, read with the batch's statistics (no sync of its own). A drop
    of the scale between two batches is a skipped step when gradients are not watched."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        # the scaler makes its scale tensor at the first scale(): until then it is init_scale
        init = getattr(scaler, "_init_scale", None)
        self.last: Optional[float] = float(init) if getattr(scaler, "_scale", None) is None and init else None

    def tensor(self) -> Optional[torch.Tensor]:
        s = getattr(self.scaler, "_scale", None)
        if isinstance(s, torch.Tensor) and s.numel() == 1:
            return s.reshape(())
        return None

    def dropped_since_read(self) -> bool:
        """The scale is lower now than at the last batch read (one host read: call only when
        bad gradients are pending)."""
        t = self.tensor()
        if t is None or self.last is None:
            return False
        now = float(t)
        if now < self.last:
            self.last = now
            return True
        return False

    def update(self, value: Optional[float]) -> int:
        """Record the latest scale; the number of skips its drop says (0 or 1)."""
        prev, self.last = self.last, value
        if prev is not None and value is not None and value < prev:
            return 1
        return 0


class ScalerSkips:
    """A GradScaler's `step`, watched: a call that returns without the optimizer's step having
    run (the scaler found inf/nan in the scaled gradients and skipped it) is told to
    `on_skip(optimizer)` at once, while the batch's inputs are still held (the scale's drop is
    only seen at the next batch's read, after they have gone). The scaler's `step` is an
    instance attribute while watched (put back by `remove()`, as core/skip.py's gate)."""

    def __init__(self, scaler: Any, steps_begun: Callable[[], int], on_skip: Callable[[Any], None]) -> None:
        self._ref = weakref.ref(scaler)
        self._previous = scaler.__dict__.get("step")  # None: the class's
        inner = self._previous if self._previous is not None else type(scaler).step.__get__(scaler)

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = steps_begun()
            out = inner(optimizer, *args, **kwargs)
            if steps_begun() == before:  # the optimizer's step did not run: the scaler's skip
                on_skip(optimizer)
            return out

        self._step: Optional[Callable[..., Any]] = step
        try:
            vars(scaler)["step"] = step
        except Exception as exc:  # a scaler that takes no attribute: its skips are seen at the next read
            self._step = None
            log.debug("tensorwatch_otel: cannot watch %s.step: %s", type(scaler).__name__, exc)

    def remove(self) -> None:
        """The scaler's own `step` back (unless someone wrapped ours since: then it passes through)."""
        scaler = self._ref()
        if scaler is None or self._step is None or scaler.__dict__.get("step") is not self._step:
            return
        if self._previous is None:
            del scaler.step
        else:
            vars(scaler)["step"] = self._previous
        self._step = None


class SkipCounter:
    """Skipped steps: the total, the streak, and the events they make; apart from them the steps
    the watcher itself skipped (on_detect="skip"), with their own total and streak."""

    def __init__(self, max_streak: int) -> None:
        self.max_streak = max_streak
        self.total = 0
        self.streak = 0
        self.nonfinite_total = 0
        self.nonfinite_streak = 0

    def step_taken(self) -> None:
        self.streak = 0
        self.nonfinite_streak = 0

    def skipped_nonfinite(self, batch: int, rank: int, module: str, module_class: str, tensor: str, kind: str,
                          phase: str) -> SkippedNonFiniteStepEvent:
        """A step the watcher did not let run (on_detect="skip")."""
        self.nonfinite_total += 1
        self.nonfinite_streak += 1
        return SkippedNonFiniteStepEvent(batch, rank, module, module_class, tensor, kind, time.time(),
                                         self.nonfinite_streak, phase)

    def skipped(self, pending: Optional[PendingGradients], batch: int, rank: int,
                scale: Optional[float]) -> List[SkipEvent]:
        self.total += 1
        self.streak += 1
        module = module_class = tensor = kind = ""
        if pending is not None:
            frame = pending.record.materialize(pending.frame, pending.frame + 1)[0]
            first = frame.first_nonfinite()
            module, module_class, kind = frame.module, frame.module_class, merge_kinds(frame.kind)
            tensor = first.name if first else ""
            batch = pending.record.batch_number
        now = time.time()
        events: List[SkipEvent] = [
            SkippedStepEvent(batch, rank, self.streak, scale, module, module_class, tensor, kind, now)]
        if self.streak == self.max_streak:
            log.warning("tensorwatch_otel: %d optimizer steps in a row were skipped (non-finite gradients%s): "
                        "the loss scale is collapsing or every step overflows", self.streak,
                        f", loss scale {scale:g}" if scale is not None else "")
            events.append(SkipStreakEvent(batch, rank, self.streak, scale, now))
        return events
