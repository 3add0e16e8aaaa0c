"""The batch record's layout (frames as columns: module, items, first tensor index; two statistics per
measured tensor) is core/record.py's Record's and private: a frame is built in a FrameDraft and
handed over whole (`Record.add_frame`), and read through the record's accessors and the
columnar view the sinks take (BatchStats.columns()). That no core module writes the record's
private lists is tests/test_hookset.py's check (no module writes another object's private
state). A recorded batch keeps a frame per module call until its end: a frame adds no object
of its own for the garbage collector to track and promote."""

from __future__ import annotations

import collections
import gc

import pytest
import torch

from tensorwatch_otel.core.frame_draft import FrameDraft, ModuleInfo
from tensorwatch_otel.core.record import Record
from tensorwatch_otel.core.frames.recorder import FrameRecorder


def test_frames_written_through_a_draft_read_back_in_order():
    info = ModuleInfo("lin", torch.nn.Linear(2, 2), False, True)
    rec = Record(3)
    d = FrameDraft()
    assert d.add("weight", (torch.tensor(0.5), torch.tensor(2.0)), torch.float32)
    assert not d.add("input[0]", "not a tensor", torch.float32)
    assert d.add("output", (0.25, 8.0), torch.float16)
    assert rec.frame_count == 0 and rec.stat_count == 0  # nothing until the frame is handed over
    rec.add_frame(info, d)
    assert (rec.frame_count, rec.stat_count) == (1, 4)
    assert rec.frame_info(0) is info and rec.frame_items(0) == ["weight", ("input[0]", "not a tensor"), "output"]
    rec.readback()
    assert [(i.path, name, k, dt) for i, name, k, dt in rec.measured()] == \
        [("lin", "weight", 0, torch.float32), ("lin", "output", 1, torch.float16)]
    mins, maxs = rec.host_extremes()
    assert mins.tolist() == [0.5, 0.25] and maxs.tolist() == [2.0, 8.0]
    assert rec.abs_min_entry(0, "output") == 0.25 and rec.abs_min_entry(0, "input[0]") is None
    (frame,) = rec.materialize()
    assert [(t.name, t.abs_min, t.abs_max, t.note) for t in frame.tensors] == \
        [("weight", 0.5, 2.0, ""), ("input[0]", None, None, "not a tensor"), ("output", 0.25, 8.0, "")]
    rec.drop_frame(0)
    assert list(rec.measured()) == [] and rec.frame_count == 0


def test_a_second_frame_starts_where_the_first_ended():
    a, b = (ModuleInfo(p, torch.nn.Identity(), False, True) for p in ("a", "b"))
    rec = Record(0)
    for info, vals in ((a, (1.0, 2.0)), (b, (3.0, float("inf")))):
        d = FrameDraft()
        d.add("input[0]", vals, torch.float32)
        d.add("output", vals, torch.float32)
        rec.add_frame(info, d)
    rec.readback()
    assert [(i.path, k) for i, _, k, _ in rec.measured()] == [("a", 0), ("a", 1), ("b", 2), ("b", 3)]
    assert rec.first_nonfinite_frame(0) == 1 and rec.first_nonfinite_frame(1) == 1
    assert [f.module for f in rec.materialize(1)] == ["b"]


def test_a_frame_that_fails_leaves_nothing_in_the_record(monkeypatch):
    model = torch.nn.Linear(2, 2)
    info = ModuleInfo("", model, True, True)
    recorder = FrameRecorder(model)
    rec = Record(0)
    x = torch.ones(1, 2)
    recorder.frame(rec, info, (x,), None, model(x))
    assert (rec.frame_count, rec.stat_count) == (1, 8)  # weight, bias, input, output

    def fail(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(FrameRecorder, "value", fail)
    y = torch.full((1, 2), 3.0)
    with pytest.raises(RuntimeError):
        recorder.frame(rec, info, (y,), {"k": 1}, model(y))  # the weights were measured: dropped too
    assert (rec.frame_count, rec.stat_count) == (1, 8)
    rec.readback()
    assert len(rec.materialize()) == 1


def test_sinks_read_a_record_through_batch_stats_columns():
    from tensorwatch_otel.core.frame_stats import BatchStats

    info = ModuleInfo("lin", torch.nn.Linear(2, 2), False, True)
    rec = Record(3)
    d = FrameDraft()
    d.add("weight", (0.5, 2.0), torch.float32)
    rec.add_frame(info, d)
    rec.readback()
    stats = BatchStats(3, 0, 0.0, rec)
    cols = stats.columns()
    assert cols is rec and [(i.path, n, k) for i, n, k, _ in cols.measured()] == [("lin", "weight", 0)]
    mins, maxs = cols.host_extremes()
    assert (mins.tolist(), maxs.tolist()) == ([0.5], [2.0])
    assert len(stats.frames) == 1 and stats.columns() is None  # frames built: read those
    assert BatchStats(3, 0, 0.0, ()).columns() is None


def _promoted_during(fn):
    """Objects by type that the collector tracks, made while `fn` ran and alive when it
    returned (what a collection of the young generations moves to the oldest one)."""
    gc.collect()
    gc.freeze()  # (everything older is out of the count)
    try:
        keep = fn()
        gc.collect(1)  # the young generations' survivors move to the oldest
        promoted = collections.Counter(type(o).__name__ for o in gc.get_objects(generation=2))
        del keep
        return promoted
    finally:
        gc.unfreeze()


def test_a_recorded_batch_promotes_no_object_per_frame_of_its_own():
    """The many-small-modules shape (one tensor in, one out, small weights: the C kernel's
    one-in-one-out route). Each module call leaves its output's entry in the batch's cache (a
    weak reference and a tuple: an output passed on as the next input is read once) and the
    output's Python object, which the weak reference keeps; the frame itself (its module, its
    items, its first index) is columns of the record and an items list shared with the
    module's frame of the batch before, so a batch of N calls promotes about 3N objects, not
    5N: full collections, whose frequency grows with what each batch promotes, come less often."""
    from tensorwatch_otel import watch
    from tensorwatch_otel.core.measure.cpu_kernel import KERNEL

    if KERNEL.wait(300) is None:
        pytest.skip("the CPU kernel did not build here (the route this test is about)")
    torch.manual_seed(0)
    n = 300
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n)])
    x = torch.randn(4, 8)
    with watch(model, sinks=[]):
        for _ in range(3):  # (the weight table and the shared items lists are filled)
            model(x)
        promoted = _promoted_during(lambda: model(x))  # a batch, still open when the count is taken
    assert promoted["ReferenceType"] >= n, promoted  # every call was measured, its output cached
    assert promoted["list"] < 20, promoted  # no items list of a frame's own (N before)
    assert promoted["tuple"] <= n + 20, promoted  # the cache entries only (2N before: a tuple per frame)
    assert sum(promoted.values()) <= 3 * n + 60, promoted
