"""What the watcher issues on the device path, counted at the dispatcher (tests/_op_counts.py)
with the path forced on the CPU under Triton's interpreter: per module call no aten op and no
allocation once warm, and, once the first batch has learnt which modules' outputs are written in
place later, no launch of its own either: the module calls' tensors wait in the buffer's table and
one table launch measures many calls' (at most one per 8 module calls a step); per training step
one read of the slot buffer (one copy, on CUDA one event wait) and no other copy. The step guard
keeps its own read (one sync) where it must stop a step before the weights change; with a fused
optimizer (its found_inf) or on_detect="report" its values travel in the next batch's read.

The CPU statistics kernel is switched off here (as in test_sync_count.py) so the step guard
measures with torch ops as on a GPU."""

from __future__ import annotations

import os
import sys

from _interpreted import INTERPRETED, REASON  # first: before Triton is imported
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the device path cannot be forced on the CPU")
pytestmark = pytest.mark.skipif(not INTERPRETED, reason=REASON)

from _collect import Collect  # noqa: E402
from _op_counts import OpCounts, counted_training, torch_ops_path  # noqa: E402
from tensorwatch_otel import watch  # noqa: E402
from tensorwatch_otel.core.measure import device_launch, device_path, slot_buffer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _prenorm import Stack  # noqa: E402



@pytest.fixture
def forced(monkeypatch):
    torch_ops_path(monkeypatch)
    device_path.force_on_cpu(True)
    yield
    device_path.force_on_cpu(False)


def _counted_training(monkeypatch, steps=4, **options):
    torch.manual_seed(0)
    model = Stack(n_blocks=2, d=16, heads=2)
    return counted_training(monkeypatch, model, torch.randn(2, 8, 16), steps, **options)


def test_few_launches_and_no_allocation_per_module_call_one_copy_per_step(forced, monkeypatch):
    counts, sink = _counted_training(monkeypatch)
    frames = len(sink.batches[-1].frames)
    assert frames == 2 * 10 + 3
    # the first batch learns: one launch per module call that measures anything (none for a call
    # whose tensors were all measured earlier in the batch: an attention block's input and output)
    first = [c[0] for c in counts.steps[0][4]]
    assert set(first) == {0, 1} and first.count(1) == frames - 5, first
    for (syncs, copies, reads, read_ops, calls), tables in zip(counts.steps[1:], counts.tables[1:]):  # warm
        assert len(calls) == frames
        # the calls' tensors wait for a table launch: here one, at the batch's read
        assert tables == 1 and tables <= frames // 8 and sum(c[0] for c in calls) == 0, [c[0] for c in calls]
        assert all(c[1:] == [0, 0] for c in calls), counts.aten_ops  # no aten op, no allocation
        assert (reads, copies) == (1, 0)  # the batch's one buffer read, no other copy to the host
        assert read_ops == 2  # that read: its copy and the reset of the slots
        assert syncs == 1  # the step guard's own read
    assert sink.batches[-1].frames[0].tensors[0].abs_max > 0


def test_a_warm_step_reads_each_distinct_tensor_once(forced, monkeypatch):
    """Bytes the watcher's table launches read in a warm training step against the bytes of the
    distinct tensors they measure (the issue's bound: at most 1.2x): an output passed on as the
    next module's input, and a weight used twice, are read once. Fewer tensors are read than the
    frames show, because the frames share them."""
    launched = []  # per table launch: its tensors' (address, elements, dtype code)
    real = slot_buffer.launch_table

    def spy(buf, entries, count, programs, block):
        launched.append([tuple(entries[4 * i:4 * i + 3]) for i in range(count)])
        return real(buf, entries, count, programs, block)

    monkeypatch.setattr(slot_buffer, "launch_table", spy)
    counts, sink = _counted_training(monkeypatch)
    assert counts.tables[-1] == 1  # a warm step: one table launch, at the batch's read
    rows = launched[-1]
    size = {code: 1 << shift for code, shift in enumerate(slot_buffer._SIZE_SHIFT)}
    read = sum(n * size[code] for _, n, code in rows)
    distinct = sum(n * size[code] for _, n, code in set(rows))
    assert read <= 1.2 * distinct, (read, distinct)
    shown = sum(1 for f in sink.batches[-1].frames for t in f.tensors if t.abs_max is not None)
    assert len(rows) < shown, (len(rows), shown)  # the frames share tensors; each is read once
    assert len(set(a for a, _, _ in rows)) == len(rows)  # no address twice


def test_without_the_step_guard_the_buffer_read_is_the_only_transfer(forced, monkeypatch):
    counts, _ = _counted_training(monkeypatch, steps=3, guard_steps=False)
    assert [row[:4] for row in counts.steps[1:]] == [[0, 0, 1, 2]] * 2


def _fused_adam(params):
    return torch.optim.Adam(params, lr=1e-3, fused=True)


@pytest.mark.parametrize("optimizer,options", [(_fused_adam, {}), (None, {"on_detect": "report"})],
                         ids=["fused-adam-raise", "sgd-report"])
def test_a_step_the_guard_need_not_stop_first_costs_no_sync(forced, monkeypatch, optimizer, options):
    """Where the step may run before the guard's verdict is known (a fused optimizer takes the
    guard's device flag as its found_inf and skips itself; on_detect="report" lets any step
    run), the guard measures the gradients into the slot buffer and the next batch's one read
    brings them back with its statistics: per warm step one copy and no sync at all."""
    counts, sink = _counted_training(monkeypatch, steps=4, optimizer=optimizer, **options)
    frames = len(sink.batches[-1].frames)
    for (syncs, copies, reads, read_ops, calls), tables in zip(counts.steps[1:], counts.tables[1:]):
        assert tables == 1 and sum(c[0] for c in calls) == 0 and all(c[1:] == [0, 0] for c in calls)
        assert len(calls) == frames
        assert (reads, copies, syncs) == (1, 0, 0)
        assert read_ops == 2  # the gradients' slots travel in the batch's copy: still one copy and one reset
    # the guard's launches: its gradients (2 blocks' and the stack's own parameters), 16 to a launch
    n_grads = sum(1 for _ in Stack(n_blocks=2, d=16, heads=2).parameters())
    assert counts.outside[1:] == [-(-n_grads // device_launch.MAX_TENSORS)] * 3


@pytest.mark.parametrize("targets,most", [(("float16", "bfloat16"), 1), (("float16", "float8_e4m3fn"), 2)],
                         ids=["direct", "with-8-bit"])
def test_target_dtypes_counted_in_the_fused_launch_no_aten_op_no_allocation(forced, monkeypatch, targets, most):
    """With target_dtypes the counts come from the same fused launch (a second one, over the
    same tensors, when an 8-bit target's threshold needs the abs max): per warm module call
    no aten op and no allocation, and per step still the one buffer read. Step 1 is a
    histogram batch (the first watched one: its rows are torch ops) and step 2 the first
    counted one (the thresholds are found, with torch's casts, and put on the device once):
    not warm."""
    counts, sink = _counted_training(monkeypatch, steps=5, target_dtypes=targets)
    frames = len(sink.batches[-1].frames)
    for syncs, copies, reads, read_ops, calls in counts.steps[2:]:
        assert len(calls) == frames
        launches = [c[0] for c in calls]
        assert set(launches) == {0, most} and launches.count(most) == frames - 5, launches
        assert all(c[1:] == [0, 0] for c in calls), counts.aten_ops
        assert (reads, copies, syncs) == (1, 0, 1)
        assert read_ops == 2  # the copy and the reset
    t = sink.batches[-1].frames[0].tensors[0]
    assert set(t.underflow) == set(targets) and t.abs_max > 0


def test_the_harness_sees_the_torch_ops_route(monkeypatch):
    """Without the device path (and without the CPU kernel) each tensor costs aten ops: the
    harness counts them, so the zeros above are measured, not blind."""
    torch_ops_path(monkeypatch)
    counts, _ = _counted_training(monkeypatch, steps=2)
    calls = counts.steps[-1][4]
    assert all(c[0] == 0 for c in calls)
    assert sum(c[1] for c in calls) >= 2 * len(calls) and sum(c[2] for c in calls) >= len(calls)
    assert counts.steps[-1][:3] == [1, 1, 0]  # the guard's sync; the batch's stack copied to the host


def test_a_gpt2_with_integer_inputs_still_reads_back_once_per_step(forced, monkeypatch):
    """Integer tensors (token ids, labels) keep the measure route (exact float64 statistics as
    0-d tensors): their few aten ops per call are the only ones, and their values travel in the
    slot buffer's one copy (no second copy for them)."""
    from _models import batches, build

    model = build("gpt2", torch.bfloat16).train()
    kw = batches("gpt2", 1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    counts = OpCounts().install(monkeypatch)
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report"):
        for _ in range(3):
            start = len(counts.calls)
            with counts.step():
                model(**kw, labels=kw["input_ids"]).loss.backward()
                opt.step()
                opt.zero_grad()
            counts.steps[-1].append(counts.calls[start:])
    frames = sink.batches[-1].frames
    for (syncs, copies, reads, read_ops, calls), tables in zip(counts.steps[1:], counts.tables[1:]):
        assert len(calls) == len(frames) and tables <= max(1, len(frames) // 8)
        with_ops = {f.module for f, c in zip(frames, calls) if c[1]}
        ints = {f.module for f in frames if any(t.dtype == "int64" for t in f.tensors)}
        # (an integer tensor seen again later in the batch is not measured again)
        assert with_ops and with_ops <= ints, (with_ops, ints)
        # (on_detect="report": the step guard's check waits for this read, no sync of its own)
        assert (reads, copies, syncs) == (1, 0, 0)
        assert read_ops == 3  # the packing of the 0-d statistics with the slots, the copy, the reset
