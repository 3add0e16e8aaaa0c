"""A harness that counts what the watcher issues, at the dispatcher: per module call the kernel
launches (the fused Triton launches, and every aten op that is not a view) and the allocations
(aten ops whose output has a storage none of their inputs has), per training step the host
syncs (`_local_scalar_dense`: .item(), bool(), .tolist() of a device tensor), the copies to the
CPU (from a device, or any a record's read-back makes), and the device path's buffer reads
(each one copy of a buffer to the host and, on CUDA, one wait on its event). With
target_dtypes the second Triton launch of the 8-bit targets' counts (slot_buffer.launch_scaled)
counts as a launch too; a table launch of deferred frames (slot_buffer.launch_table) is one
launch (its staging copies are part of it), counted per step in `tables`.

Use it around a model watched after `OpCounts.install(monkeypatch)`: the per-call mode is
active only inside the recorder's frame() (the hooks' work), and aten ops Triton's
interpreter issues to run a kernel on CPU tensors are not counted (on CUDA a launch is one
launch and nothing else)."""

from __future__ import annotations

from typing import List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensorwatch_otel.core.measure import slot_buffer
from tensorwatch_otel.core.record import Record
from tensorwatch_otel.core.frames.recorder import FrameRecorder

aten = torch.ops.aten


def torch_ops_path(monkeypatch) -> None:
    """CPU statistics by torch ops (as on a device, with 0-d result tensors read back once)
    instead of the compiled kernel, for this test (undone with the monkeypatch)."""
    from tensorwatch_otel.core.measure import cpu_kernel

    cpu_kernel.KERNEL.wait()
    monkeypatch.setattr(cpu_kernel.KERNEL, "_kernel", None)
    monkeypatch.setattr(cpu_kernel.KERNEL, "_done", True)


class _Mode(TorchDispatchMode):
    def __init__(self, counts: "OpCounts", per_call: bool):
        super().__init__()
        self.counts = counts
        self.per_call = per_call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counts
        if c.paused:
            return out
        if self.per_call:
            c.note_call_op(func, args, out)
        else:
            c.note_step_op(func, args, kwargs)
        return out

    def __enter__(self):
        if not self.per_call:
            self.counts.in_step = True
        return super().__enter__()

    def __exit__(self, *exc):
        if not self.per_call:
            self.counts.in_step = False
        return super().__exit__(*exc)


def _storages(x) -> List[int]:
    flat = x if isinstance(x, (list, tuple)) else [x]
    out = []
    for t in flat:
        if isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta:
            try:
                out.append(t.untyped_storage().data_ptr())
            except RuntimeError:
                pass
    return out


class OpCounts:
    """Counts (see the module docstring); `calls` is the list of per-call (triton launches,
    aten launches, allocations), `steps` the list of per-step (syncs, device-to-CPU copies,
    buffer reads, aten launches at the buffer reads)."""

    def __init__(self) -> None:
        self.paused = False
        self.calls: List[List[int]] = []
        self.steps: List[List[int]] = []
        self.aten_ops: List[str] = []  # names of the aten ops counted as per-call launches
        self.in_readback = False
        self.in_launch = False  # inside a counted launch: its own ops are not counted
        self.in_frame = False
        self.in_step = False  # inside step(): reads and launches outside it (at detach) are not a step's
        self.outside: List[int] = []  # per step: the Triton launches outside a module call (the step guard's)
        # per step: the table launches of deferred frames (slot_buffer.launch_table), wherever they ran
        # (in a module call's frame, also counted there, or at the batch's read)
        self.tables: List[int] = []

    # -- per call
    def note_call_op(self, func, args, out) -> None:
        row = self.calls[-1]
        if func.is_view or func in (aten.detach.default, aten._local_scalar_dense.default):
            return
        row[1] += 1
        self.aten_ops.append(str(func))
        new = set(_storages(out)) - set(_storages(list(args)))
        if new:
            row[2] += 1

    # -- per step
    def note_step_op(self, func, args, kwargs) -> None:
        if not self.steps:
            return
        row = self.steps[-1]
        if func is aten._local_scalar_dense.default:
            row[0] += 1
        elif func is aten._to_copy.default:
            # a copy to the host from a device, or any copy to the CPU a record's read-back makes
            # (on a CPU run the copy a GPU run makes there is a CPU-to-CPU one)
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cpu" and (
                    args[0].device.type != "cpu" or self.in_readback):
                row[1] += 1
        elif func is aten.copy_.default:
            if args[0].device.type == "cpu" and args[1].device.type != "cpu":
                row[1] += 1

    def step(self) -> TorchDispatchMode:
        """A mode to hold over one training step (counts its syncs and copies)."""
        self.steps.append([0, 0, 0, 0])
        self.outside.append(0)
        self.tables.append(0)
        return _Mode(self, per_call=False)

    def install(self, monkeypatch) -> "OpCounts":
        counts = self
        real_frame = FrameRecorder.frame
        real_launch = slot_buffer.launch
        real_scaled = slot_buffer.launch_scaled
        real_read = slot_buffer.SlotBuffer.read

        def frame(recorder, *args, **kwargs):
            counts.calls.append([0, 0, 0])
            was, counts.in_frame = counts.in_frame, True
            try:
                with _Mode(counts, per_call=True):
                    return real_frame(recorder, *args, **kwargs)
            finally:
                counts.in_frame = was

        def counted(real, table=False):
            def launch(*args):
                if table and counts.in_step and counts.tables:
                    counts.tables[-1] += 1
                if counts.in_frame and counts.calls:
                    counts.calls[-1][0] += 1
                elif not counts.in_frame and counts.in_step and counts.outside and not table:
                    counts.outside[-1] += 1
                # (a table launch's staging copies are its own, at a buffer read too)
                was, counts.paused, counts.in_launch = counts.paused, True, True
                try:
                    return real(*args)
                finally:
                    counts.paused, counts.in_launch = was, False
            return launch

        def read(buf, extra=None):
            if not ((buf.used or extra is not None) and counts.steps and counts.in_step):
                return real_read(buf, extra)
            counts.steps[-1][2] += 1
            was, counts.paused = counts.paused, True  # its copy is counted as a buffer read
            try:
                with _Mode(_AtBufferRead(counts), per_call=False):
                    return real_read(buf, extra)
            finally:
                counts.paused = was

        real_readback = Record.readback

        def readback(rec, *args, **kwargs):
            was, counts.in_readback = counts.in_readback, True
            try:
                return real_readback(rec, *args, **kwargs)
            finally:
                counts.in_readback = was

        monkeypatch.setattr(Record, "readback", readback)
        monkeypatch.setattr(FrameRecorder, "frame", frame)
        monkeypatch.setattr(slot_buffer, "launch", counted(real_launch))
        monkeypatch.setattr(slot_buffer, "launch_scaled", counted(real_scaled))
        monkeypatch.setattr(slot_buffer, "launch_table", counted(slot_buffer.launch_table, table=True))
        real_decode = slot_buffer.decode_words

        def decode_words(words):  # the read's decoding on the host (CPU ops on a CUDA run): not a launch
            was, counts.in_launch = counts.in_launch, True
            try:
                return real_decode(words)
            finally:
                counts.in_launch = was

        monkeypatch.setattr(slot_buffer, "decode_words", decode_words)
        monkeypatch.setattr(slot_buffer.SlotBuffer, "read", read)
        return self


def counted_training(monkeypatch, model, x, steps=4, optimizer=None, **options):
    """`steps` watched training steps of `model` on `x` (forward, a square-mean loss, backward, an
    optimizer step: SGD, or `optimizer(parameters)`) with the counts installed: (the counts,
    each step's row ending with its per-call rows; the sink's Collect)."""
    from _collect import Collect
    from tensorwatch_otel import watch

    opt = torch.optim.SGD(model.parameters(), lr=0.01) if optimizer is None else optimizer(model.parameters())
    counts = OpCounts().install(monkeypatch)
    sink = Collect()
    with watch(model, sinks=[sink], **options):
        for _ in range(steps):
            start = len(counts.calls)
            with counts.step():
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            counts.steps[-1].append(counts.calls[start:])
    return counts, sink


class _AtBufferRead:
    """Counts the aten launches of a buffer read (its copy and its reset) into the step's row."""

    def __init__(self, counts: OpCounts) -> None:
        self.counts = counts
        self.in_step = False

    @property
    def paused(self) -> bool:  # a launch made by the read (the deferred frames' table) is counted as a launch
        return self.counts.in_launch

    def note_step_op(self, func, args, kwargs) -> None:
        if not func.is_view:
            self.counts.steps[-1][3] += 1
