"""JsonlLog: CONTRACT's JSON lines schema exactly, non-finite floats as strings, durability of
a detection when the process dies right after, an unwritable path, and the codec round trip."""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import tensorwatch_otel
from tensorwatch_otel import (
    AbortAfterBatch,
    AbortAfterBatchEvent,
    BatchTraceEvent,
    Frame,
    NonFiniteDetected,
    NonFiniteEvent,
    OverflowCheckEvent,
    TensorStat,
    watch,
)
from tensorwatch_otel.report import codec as _codec
from tensorwatch_otel.sinks import JsonlLog
from _collect import Collect

jsonschema = pytest.importorskip("jsonschema")

NUM = {"anyOf": [{"type": "number"}, {"type": "null"}, {"enum": ["inf", "-inf", "nan"]}]}
# The JSON lines event log as docs/reference/events.md documents it: the required fields and their types
SCHEMA = {
    "type": "object",
    "required": ["time", "event", "batch_number", "rank", "module", "module_class", "tensor", "kind", "frames"],
    "additionalProperties": False,
    "properties": {
        "time": {"type": "string"},
        "event": {"enum": ["nonfinite_detected", "batch_trace", "abort_after_batch", "overflow_check",
                           "stopped_by_rank", "optimizer_step_skipped", "skipped_steps_streak",
                           "skipped_nonfinite_step", "sampling_rate"]},
        "first_rank": {"type": "integer"},  # detections and stops (second wave)
        "stopped_at_batch": {"type": ["integer", "null"]},  # stopped_by_rank
        "trace_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},  # detections: the span's trace
        "phase": {"enum": ["forward", "backward", "optimizer"]},  # detections: where the frames come from
        "capture": {"type": "string"},  # detections with capture_dir: the captured batch's file
        "reproduced": {"type": "boolean"},  # detections with rerun_on_detect
        "host": {"type": "string"},
        "verdict": {"enum": ["model", "compiler", "transient"]},  # rerun_on_detect on a compiled model
        "uncertain": {"type": "string"},  # detections whose replay could not run the batch as it ran
        "streak": {"type": "integer"},  # skipped optimizer steps
        "scale": NUM,
        "every_n_batches": {"type": "integer", "minimum": 1},  # sampling_rate (max_overhead)
        "overhead": {"type": "number"},
        "expected_overhead": {"type": "number"},
        "max_overhead": {"type": "number"},
        "batch_number": {"type": "integer"},
        "rank": {"type": "integer"},
        "module": {"type": "string"},
        "module_class": {"type": "string"},
        "tensor": {"type": "string"},
        "kind": {"type": "string"},
        "frames": {"type": "array", "items": {
            "type": "object",
            "required": ["module", "module_class", "tensors"],
            "properties": {
                "module": {"type": "string"},
                "module_class": {"type": "string"},
                "tensors": {"type": "array", "items": {
                    "type": "object",
                    "required": ["name", "abs_min", "abs_max", "dtype"],
                    "properties": {"name": {"type": "string"}, "abs_min": NUM, "abs_max": NUM,
                                   "dtype": {"type": "string"}, "note": {"type": "string"}},
                }},
            },
        }},
    },
}
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def _strict_loads(line):
    """json.loads that refuses NaN/Infinity literals (they are not JSON)."""
    def bad(name):
        raise ValueError(f"non-JSON constant {name}")
    return json.loads(line, parse_constant=bad)


class Blow(nn.Module):
    def __init__(self):
        super().__init__()
        self.mode = ""

    def forward(self, x):
        if self.mode == "inf":
            return x * 1e30 * 1e30
        if self.mode == "nan":
            return torch.sqrt(x - 1e6)
        return x + 0.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bad = Blow()
        self.out = nn.Linear(3, 2)

    def forward(self, x, mask=None):
        return {"logits": self.out(self.bad(self.lin(x))), "none": None}


def _run_all_events(path):
    """A run producing every event type; returns what an in-memory sink saw."""
    torch.manual_seed(0)
    model = Net()
    mem = Collect()
    log = JsonlLog(str(path))
    x = torch.randn(2, 3)
    with watch(model, sinks=[log, mem], trace_batches=[0], on_detect="report", abort_after_batch=3):
        model(x, mask=torch.ones(2))  # 0: traced
        model.bad.mode = "inf"
        model(x)  # 1: inf
        model.bad.mode = "nan"
        model(x)  # 2: nan
        tensorwatch_otel.detect_overflow(torch.tensor([1.0, float("inf")]), "attn scores")
        model.bad.mode = ""
        with pytest.raises(AbortAfterBatch):
            model(x)  # 3: abort after it
    log.close()
    return mem.events


def test_schema_exactly(tmp_path, capsys):
    path = tmp_path / "sub" / "events.jsonl"  # the folder is created
    events = _run_all_events(path)
    raw = path.read_text(encoding="utf-8")
    assert raw.endswith("\n")
    lines = raw.splitlines()
    assert len(lines) == len(events) == 5
    docs = [_strict_loads(line) for line in lines]
    for d in docs:
        jsonschema.validate(d, SCHEMA)
        assert RFC3339.match(d["time"]), d["time"]
        when = dt.datetime.fromisoformat(d["time"].replace("Z", "+00:00"))
        assert when.tzinfo is not None
        assert abs(when.timestamp() - dt.datetime.now(dt.timezone.utc).timestamp()) < 600
        assert d["rank"] == 0
    assert [(d["event"], d["batch_number"]) for d in docs] == [
        ("batch_trace", 0), ("nonfinite_detected", 1), ("nonfinite_detected", 2),
        ("overflow_check", 3), ("abort_after_batch", 3)]
    trace, inf, nan, ovf, abort = docs
    assert [f["module"] for f in trace["frames"]] == ["lin", "bad", "out", ""]
    assert [t["name"] for t in trace["frames"][-1]["tensors"]] == [
        "input[0]", "input.mask", "output.logits", "output.none"]
    none = trace["frames"][-1]["tensors"][-1]
    assert (none["abs_min"], none["abs_max"], none.get("note")) == (None, None, "None")
    # the JSON carries the same numbers as the events, to the last bit
    for fd, fe in zip(trace["frames"], events[0].frames):
        for td, te in zip(fd["tensors"], fe.tensors):
            assert (td["name"], td["abs_min"], td["abs_max"], td["dtype"]) == \
                (te.name, te.abs_min, te.abs_max, te.dtype)
    assert (inf["module"], inf["module_class"], inf["tensor"], inf["kind"]) == ("bad", "Blow", "output", "inf")
    assert inf["first_rank"] == 0 and inf["trace_id"] == events[1].trace_id
    assert nan["trace_id"] != inf["trace_id"]  # one trace per detection
    bad_out = inf["frames"][-1]["tensors"][-1]
    assert (bad_out["abs_min"], bad_out["abs_max"]) == ("inf", "inf")  # every element overflowed
    assert isinstance(inf["frames"][-1]["tensors"][0]["abs_min"], float)
    assert (nan["tensor"], nan["kind"]) == ("output", "nan")
    assert nan["frames"][-1]["tensors"][-1]["abs_min"] == "nan"
    assert (ovf["tensor"], ovf["kind"]) == ("attn scores", "inf")
    assert ovf["frames"][0]["tensors"][0]["abs_max"] == "inf"
    assert (abort["module"], abort["frames"], abort["kind"]) == ("", [], "")


def test_negative_infinity_and_nan_written_as_strings():
    stat = TensorStat("x", float("-inf"), float("nan"), "float32")
    ev = NonFiniteEvent(4, 0, "m", "M", "x", "inf,nan", (Frame("m", "M", (stat,), 4),), 0.0)
    line = _codec.to_line(ev)
    assert line.endswith("\n") and line.count("\n") == 1
    d = _strict_loads(line)
    assert d["frames"][0]["tensors"][0]["abs_min"] == "-inf"
    assert d["frames"][0]["tensors"][0]["abs_max"] == "nan"
    assert d["time"] == "1970-01-01T00:00:00.000000Z"


def test_read_events_round_trips(tmp_path, capsys):
    path = tmp_path / "events.jsonl"
    events = _run_all_events(path)
    back = _codec.read_events(str(path))
    assert [type(e) for e in back] == [BatchTraceEvent, NonFiniteEvent, NonFiniteEvent, OverflowCheckEvent,
                                       AbortAfterBatchEvent]

    def same(a, b):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

    for e, b in zip(events, back):
        assert (b.event, b.batch_number, b.rank) == (e.event, e.batch_number, e.rank)
        assert abs(b.time - e.time) < 1e-5
        if isinstance(e, NonFiniteEvent):
            assert (b.module, b.module_class, b.tensor, b.kind) == (e.module, e.module_class, e.tensor, e.kind)
            assert (b.first_rank, b.trace_id) == (e.first_rank, e.trace_id)
        if isinstance(e, OverflowCheckEvent):
            assert (b.ctx, b.kind, b.stat.abs_max) == (e.ctx, e.kind, e.stat.abs_max)
        for fb, fe in zip(getattr(b, "frames", ()), getattr(e, "frames", ())):
            assert (fb.module, fb.module_class, fb.batch_number, fb.batch_start, fb.phase) == \
                (fe.module, fe.module_class, fe.batch_number, fe.batch_start, fe.phase)
            for tb, te in zip(fb.tensors, fe.tensors, strict=True):
                assert (tb.name, tb.dtype, tb.note) == (te.name, te.dtype, te.note)
                assert same(tb.abs_min, te.abs_min) and same(tb.abs_max, te.abs_max)
    # a crash mid-write leaves a truncated last line: everything before it still reads
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"time": "2026-01-01T00:00:00Z", "event": "nonfin')
    assert len(_codec.read_events(str(path))) == 5


DIES_RIGHT_AFTER = textwrap.dedent("""
    import os, sys, torch, torch.nn as nn
    from tensorwatch_otel import watch, NonFiniteDetected
    from tensorwatch_otel.sinks import JsonlLog

    class Blow(nn.Module):
        def forward(self, x):
            return x * 1e30 * 1e30

    model = nn.Sequential(nn.Linear(3, 3), Blow(), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = watch(model, sinks=[JsonlLog(sys.argv[1])], trace_batches=[0])
    try:
        for step in range(3):
            loss = model(torch.randn(2, 3)).sum()
    except NonFiniteDetected:
        os._exit(1)  # dies at once: no atexit, no finalizers, no buffer flushing
    os._exit(0)
""")


def test_detection_line_is_durable_when_process_dies_right_after(tmp_path):
    path = tmp_path / "events.jsonl"
    proc = subprocess.run([sys.executable, "-c", DIES_RIGHT_AFTER, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = path.read_text(encoding="utf-8").splitlines()
    docs = [_strict_loads(line) for line in lines]
    assert [d["event"] for d in docs] == ["batch_trace", "nonfinite_detected"]
    det = docs[-1]
    jsonschema.validate(det, SCHEMA)
    assert (det["module"], det["module_class"], det["tensor"], det["kind"], det["batch_number"]) == (
        "1", "Blow", "output", "inf", 0)
    assert [f["module"] for f in det["frames"]] == ["0", "1"]


def test_unwritable_path_logged_once_and_training_goes_on(tmp_path, caplog):
    # the path was fine when the sink was built; its folder is a file by the first event
    blocker = tmp_path / "a_file"
    log_sink = JsonlLog(str(blocker / "events.jsonl"))
    blocker.write_text("not a folder")
    mem = Collect()
    model = Net()
    x = torch.randn(2, 3)
    with caplog.at_level(logging.WARNING, logger="tensorwatch_otel"):
        with watch(model, sinks=[log_sink, mem], trace_batches=range(5), on_detect="report") as w:
            for b in range(4):
                model.bad.mode = "inf" if b == 2 else ""
                model(x)
            assert w.batch_number == 4
            assert w.sink_failures["JsonlLog.on_event"] == 5
        # on_detect="raise" still raises the detection itself
        model.bad.mode = "inf"
        with watch(model, sinks=[log_sink, mem]):
            with pytest.raises(NonFiniteDetected):
                model(x)
    msgs = [r.getMessage() for r in caplog.records if "JsonlLog.on_event" in r.getMessage()]
    assert len(msgs) == 2  # once per watcher that owns the failing sink, not once per event
    assert len([e for e in mem.events if isinstance(e, BatchTraceEvent)]) == 4


def test_bad_path_argument():
    with pytest.raises(ValueError, match="path"):
        JsonlLog("")
    with pytest.raises(ValueError, match="path"):
        JsonlLog(None)


def test_rank_placeholder(tmp_path):
    sink = JsonlLog(str(tmp_path / "ev-{rank}.jsonl"), rank=3)
    ev = AbortAfterBatchEvent(0, 3, 0.0)
    sink.on_event(ev)
    sink.close()
    sink.close()  # idempotent
    assert _strict_loads((tmp_path / "ev-3.jsonl").read_text())["event"] == "abort_after_batch"
    assert os.listdir(tmp_path) == ["ev-3.jsonl"]


def test_directory_path_rejected_at_construction(tmp_path):
    (tmp_path / "3").mkdir()
    for bad in (tmp_path, str(tmp_path) + os.sep, tmp_path / "{rank}"):
        with pytest.raises(ValueError, match=r"^JsonlLog path=.*is a directory"):
            JsonlLog(bad, rank=3)
    assert os.listdir(tmp_path) == ["3"]


def test_unusable_parent_rejected_at_construction(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match=r"^JsonlLog path=.*is a file, not a folder"):
        JsonlLog(tmp_path / "a_file" / "deeper" / "events.jsonl")
    # a folder that takes no new file, even for root
    with pytest.raises(ValueError, match=r"^JsonlLog path=.*cannot create files in '/proc'"):
        JsonlLog("/proc/tensorwatch-test/events.jsonl")
    assert os.listdir(tmp_path) == ["a_file"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_folder_rejected_at_construction(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match=r"^JsonlLog path=.*cannot create files"):
            JsonlLog(ro / "events.jsonl")
    finally:
        ro.chmod(0o700)


def test_valid_path_creates_nothing_until_the_first_event(tmp_path):
    sink = JsonlLog(tmp_path / "run" / "events.jsonl")
    assert os.listdir(tmp_path) == []
    sink.on_event(AbortAfterBatchEvent(0, 0, 0.0))
    sink.close()
    assert _strict_loads((tmp_path / "run" / "events.jsonl").read_text())["event"] == "abort_after_batch"


# ---------------------------------------------------------------- second wave fields and events
def test_first_rank_and_trace_id_round_trip():
    fr = (Frame("m", "M", (TensorStat("x", 0.0, math.inf, "float16"),), 7),)
    ev = NonFiniteEvent(7, 3, "m", "M", "x", "inf", fr, 1.0, first_rank=1)
    assert len(ev.trace_id) == 32 and int(ev.trace_id, 16)  # made by the core, nonzero
    d = _strict_loads(_codec.to_line(ev))
    jsonschema.validate(d, SCHEMA)
    assert (d["rank"], d["first_rank"], d["trace_id"]) == (3, 1, ev.trace_id)
    back = _codec.from_dict(d)
    assert (back.rank, back.first_rank, back.trace_id) == (3, 1, ev.trace_id)
    # a line written before these fields existed: first_rank is the event's rank, no trace id
    del d["first_rank"], d["trace_id"]
    old = _codec.from_dict(d)
    assert (old.first_rank, old.trace_id) == (3, "")
    assert "trace_id" not in _strict_loads(_codec.to_line(old))
    with pytest.raises(ValueError, match="integer"):
        _codec.from_dict(dict(d, first_rank="two"))


def test_sampling_rate_event_written_and_read_back(tmp_path):
    from tensorwatch_otel.core.events import SamplingRateEvent

    path = tmp_path / "events.jsonl"
    log = JsonlLog(str(path))
    ev = SamplingRateEvent(40, 0, 12, 0.031, 0.018, 0.02, 5.0)
    log.on_event(ev)
    log.close()
    d = _strict_loads(path.read_text(encoding="utf-8"))
    jsonschema.validate(d, SCHEMA)
    assert (d["event"], d["batch_number"], d["every_n_batches"], d["overhead"], d["expected_overhead"],
            d["max_overhead"]) == ("sampling_rate", 40, 12, 0.031, 0.018, 0.02)
    assert _codec.from_dict(d) == ev
    with pytest.raises(ValueError, match="every_n_batches"):
        _codec.from_dict(dict(d, every_n_batches="12"))


def test_skipped_step_events_written_and_read_back(tmp_path):
    from tensorwatch_otel.core.events import SkippedStepEvent, SkipStreakEvent

    path = tmp_path / "events.jsonl"
    log = JsonlLog(str(path))
    skip = SkippedStepEvent(10, 1, 1, 32768.0, "fc", "Linear", "weight.grad", "inf", 5.0)
    skip2 = SkippedStepEvent(11, 1, 2, None, "", "", "", "nan", 6.0)
    streak = SkipStreakEvent(11, 1, 2, 16384.0, 6.5)
    for ev in (skip, skip2, streak):
        log.on_event(ev)
    log.close()
    docs = [_strict_loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for d in docs:
        jsonschema.validate(d, SCHEMA)
    assert [d["event"] for d in docs] == ["optimizer_step_skipped", "optimizer_step_skipped",
                                          "skipped_steps_streak"]
    assert (docs[0]["streak"], docs[0]["scale"], docs[0]["module"], docs[0]["tensor"], docs[0]["kind"]) == \
        (1, 32768.0, "fc", "weight.grad", "inf")
    assert docs[1]["scale"] is None
    assert (docs[2]["streak"], docs[2]["scale"], docs[2]["frames"]) == (2, 16384.0, [])
    back = _codec.read_events(str(path))
    assert back[0] == dataclasses_replace_time(skip, back[0].time)
    assert back[1] == dataclasses_replace_time(skip2, back[1].time)
    assert back[2] == dataclasses_replace_time(streak, back[2].time)
    assert [abs(b.time - e.time) < 1e-5 for b, e in zip(back, (skip, skip2, streak))] == [True] * 3


def test_skipped_nonfinite_step_written_as_documented(tmp_path):
    from tensorwatch_otel.core.events import SkippedNonFiniteStepEvent

    path = tmp_path / "events.jsonl"
    log = JsonlLog(str(path))
    ev = SkippedNonFiniteStepEvent(7, 1, "a", "Linear", "input[0]", "inf", 5.0, 2, "forward")
    log.on_event(ev)
    log.close()
    (d,) = [_strict_loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    jsonschema.validate(d, SCHEMA)
    assert {k: d[k] for k in ("event", "batch_number", "rank", "module", "module_class", "tensor", "kind", "streak",
                              "phase", "frames")} == \
        {"event": "skipped_nonfinite_step", "batch_number": 7, "rank": 1, "module": "a", "module_class": "Linear",
         "tensor": "input[0]", "kind": "inf", "streak": 2, "phase": "forward", "frames": []}
    (back,) = _codec.read_events(str(path))
    assert back == dataclasses_replace_time(ev, back.time) and abs(back.time - ev.time) < 1e-5


def dataclasses_replace_time(ev, t):
    import dataclasses

    return dataclasses.replace(ev, time=t)
