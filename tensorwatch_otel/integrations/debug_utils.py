"""Drop-in replacements for transformers.debug_utils: DebugUnderflowOverflow and detect_overflow.

Same arguments and report text as the peer, built on the watcher: statistics stay on the
device (one read-back per batch), hooks can be removed, the frame buffer stays bounded,
an inf seen while tracing does not abort the next batch, and the batch number is exact.
"""

from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional

import torch

from .._watch import env_sinks
from ..core import naming
from ..core.frames import offload, transforms
from ..core.batch.behaviour import Behaviour
from ..core.config import WatchConfig
from ..core.frames.copies import Copies, Hook
from ..core.events import BatchTraceEvent, NonFiniteEvent, OverflowCheckEvent
from ..core.frame_stats import NOTE_NONE, NOTE_NOT_TENSOR, TensorStat
from ..core.rank import current_rank
from ..core.frame_draft import FrameDraft, ModuleInfo
from ..core.record import Record
from ..core.frames.recorder import FrameRecorder
from ..core.measure.stats import dtype_name, measure
from ..core.watcher import ACTIVE, Watcher
from ..report.text import print_overflow_check, render_trace
from ..sinks.text import TextReport


class DebugUnderflowOverflow:
    """Detects the first inf/nan in weights, inputs and outputs of every module of `model`,
    printing the frames that led to it and raising a ValueError; or traces the abs min/max of
    the batches in `trace_batch_nums` (0-indexed, detection off in those batches), and stops
    with a ValueError once batch `abort_after_batch_num` has finished.

    Unlike the peer, it can be removed: `detach()` (or use it as a context manager).
    """

    def __init__(self, model: torch.nn.Module, max_frames_to_save: int = 21,
                 trace_batch_nums: Optional[Iterable[int]] = None,
                 abort_after_batch_num: Optional[int] = None):
        # The peer's options are its arguments alone: no TENSORWATCH_* option variable applies
        # (environ={}); the sinks the environment configures are added below. Like the peer it
        # checks forwards only (no optimizer-step guard: watch() has it).
        config = WatchConfig.build(max_frames=max_frames_to_save, trace_batches=trace_batch_nums or (),
                                   abort_after_batch=abort_after_batch_num, on_detect="raise",
                                   every_n_batches=1, guard_steps=False, environ={})
        self.model = model
        self.trace_batch_nums = list(trace_batch_nums or [])
        self.abort_after_batch_num = abort_after_batch_num
        self._flags = _TraceFlags(model, config.trace_batches) if config.trace_batches else None
        sinks = [_PeerTextReport(self._flags)] + env_sinks()
        self._watcher = Watcher(model, sinks, config, owned_sinks=sinks, behaviour=PeerBehaviour())
        if self._flags is not None:
            self._flags.watcher = self._watcher

    @property
    def batch_number(self) -> int:
        return self._watcher.batch_number

    def detach(self) -> None:
        """Remove every hook (idempotent)."""
        self._watcher.detach()
        if self._flags is not None:
            self._flags.detach()

    def __enter__(self) -> "DebugUnderflowOverflow":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()


class PeerBehaviour(Behaviour):
    """The peer's view and words: positional inputs only (non-tensors noted), outputs as a
    tensor, a tuple or one nested tuple level; traced batches are not checked, and a detection
    ring starts after the last traced batch (the peer's buffer restarts once it printed)."""

    detect_in_traced_batches = False
    outermost_call_ends_batch = False

    def record(self, recorder: FrameRecorder, rec: Record, info: ModuleInfo, args, kwargs, output) -> None:
        d = FrameDraft()
        recorder.params(rec, info, d)
        for i, a in enumerate(args):
            self._leaf(recorder, rec, a, naming.input_name(i), d)
        if isinstance(output, tuple):
            for i, x in enumerate(output):
                if isinstance(x, tuple):
                    for j, y in enumerate(x):
                        self._leaf(recorder, rec, y, naming.output_nested(i, j), d)
                else:
                    self._leaf(recorder, rec, x, naming.output_name(i), d)
        else:
            self._leaf(recorder, rec, output, "output", d)
        rec.add_frame(info, d)

    @staticmethod
    def _leaf(recorder: FrameRecorder, rec: Record, x, name: str, d: FrameDraft) -> None:
        if isinstance(x, torch.Tensor):
            recorder.tensor(rec, x, name, d)
        else:
            d.items.append((name, NOTE_NONE if x is None else NOTE_NOT_TENSOR))

    def ring_stops_at(self, rec: Record, trace_batches) -> bool:
        return rec.batch_number in trace_batches

    def detection_message(self, event: NonFiniteEvent) -> str:
        return ("DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running further. "
                "Please scroll up above this traceback to see the activation values prior to this event.")

    def abort_message(self, batches_done: int, abort_after_batch: int) -> str:
        return (f"DebugUnderflowOverflow: aborting after {batches_done} batches due to"
                f" `abort_after_batch_num={abort_after_batch}` arg")


class _TraceFlags:
    """Exact has-nan/has-inf flags of every tensor of the traced batches, for the peer's
    `{ctx} has nans` / `{ctx} has infs` lines: abs min/max alone cannot show an inf beside a NaN.

    Traced batches print every frame anyway, so the flags are taken there only (on the device,
    read back once when the trace is printed); other batches cost one early return per module.
    Hooks run before the watcher's (prepend) so the root frame's flags exist when it reports.
    """

    def __init__(self, model: torch.nn.Module, traced):
        self.traced = frozenset(traced)
        self.watcher: Optional[Watcher] = None
        self.batches: Dict[int, List[Optional[list]]] = {}
        self._handles = []
        self._copies = Copies()  # a copy of the model holds no-ops in their place (core/frames/copies.py)
        seen = set()
        for _, module in model.named_modules():
            if id(module) not in seen:
                seen.add(id(module))
                hook = Hook(self._hook).place(module, self._copies)
                self._handles.append(module.register_forward_hook(hook, prepend=True, always_call=True))

    def detach(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        self._copies.take_off()
        self.batches.clear()

    def _hook(self, module, args, output) -> None:
        w = self.watcher
        if w is None or w.batch_number not in self.traced or torch._C._current_graph_task_id() != -1 \
                or transforms.tracing() is not None:
            return
        frames = self.batches.setdefault(w.batch_number, [])
        if transforms.active():  # torch.func's wrappers: the abs min/max lines stand in
            frames.append(None)
            return
        try:
            with torch.no_grad():
                frames.append(self._frame(module, args, output))
        except Exception:  # odd tensors: fall back to what abs min/max say
            frames.append(None)

    @staticmethod
    def _frame(module, args, output) -> list:
        # (under accelerate's offload, the weights the module held in this call: core/frames/offload.py)
        named = [(n, p) for n, p in offload.lent_params(module).items() if p is not None]
        named += [(f"input[{i}]", a) for i, a in enumerate(args)]
        if isinstance(output, tuple):
            for i, x in enumerate(output):
                if isinstance(x, tuple):
                    named += [(f"output[{i}][{j}]", y) for j, y in enumerate(x)]
                else:
                    named.append((f"output[{i}]", x))
        else:
            named.append(("output", output))
        out = []
        for name, t in named:
            if isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta \
                    and (t.is_floating_point() or t.is_complex()) and t.numel():
                out.append((name, torch.stack([torch.isnan(t).any(), torch.isinf(t).any()])))
        return out

    def lines(self, batch: int) -> Optional[List[List[str]]]:
        """Per frame of `batch`, the lines the peer prints while checking it (None: unknown)."""
        frames = self.batches.pop(batch, None)
        if not frames or any(f is None for f in frames):
            return None
        flat = [flag for f in frames for _, flag in f]
        host = torch.stack(flat).to("cpu").tolist() if flat else []
        out, k = [], 0
        for f in frames:
            lines = []
            for name, _ in f:
                has_nan, has_inf = host[k]
                k += 1
                if has_nan:
                    lines.append(f"{name} has nans")
                if has_inf:
                    lines.append(f"{name} has infs")
            out.append(lines)
        return out


class _PeerTextReport(TextReport):
    """TextReport whose traces carry the exact `has nans` / `has infs` lines."""

    def __init__(self, flags: Optional[_TraceFlags]):
        super().__init__()
        self._flags = flags

    def on_event(self, event) -> None:
        if isinstance(event, BatchTraceEvent) and self._flags is not None:
            overflow = self._flags.lines(event.batch_number)
            if self.all_ranks or event.rank == 0:
                self._write(render_trace(event, overflow))
        else:
            super().on_event(event)


def detect_overflow(var: torch.Tensor, ctx: str) -> bool:
    """Print `{ctx} has nans` / `{ctx} has infs` and return True when `var` holds any.

    An explicit check of an intermediate tensor: it reads the answer back at once. Detections
    also go to the sinks of every active watcher (JSON lines, spans, metrics).
    """
    if not isinstance(var, torch.Tensor):
        raise ValueError(f"detect_overflow: expected a tensor for {ctx!r}, got {type(var).__name__}")
    has_nan = has_inf = False
    if var.is_floating_point() or var.is_complex():
        with torch.no_grad():
            flags = torch.stack([torch.isnan(var).any(), torch.isinf(var).any()]).tolist()
        has_nan, has_inf = bool(flags[0]), bool(flags[1])
    print_overflow_check(ctx, has_nan, has_inf)
    detected = has_nan or has_inf
    if detected and len(ACTIVE):
        kind = ",".join(k for k, on in (("inf", has_inf), ("nan", has_nan)) if on)
        with torch.no_grad():
            r = measure(var)
        if isinstance(r, str):
            stat = TensorStat(ctx, None, None, dtype_name(var.dtype), r)
        else:
            mn, mx = torch.stack(list(r)).tolist()
            stat = TensorStat(ctx, mn, mx, dtype_name(var.dtype))
        for w in list(ACTIVE):
            event = OverflowCheckEvent(w.batch_number, current_rank(), ctx, kind, stat, time.time())
            w.overflow_check(event)
    return detected
