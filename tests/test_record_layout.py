"""The batch record's layout (frames as (module, items, first tensor index), two statistics per
measured tensor) is written and read through core/record.py's Record only; the recorder's hot
path is its one inline twin. A scan of the package's source for the layout's marks."""

from __future__ import annotations

import pathlib
import re

import torch

import tensorwatch_otel
from tensorwatch_otel.core.record import ModuleInfo, Record

PACKAGE = pathlib.Path(tensorwatch_otel.__file__).parent
OWNERS = {"core/record.py", "core/recorder.py"}
MARKS = {
    "a frame tuple appended": re.compile(r"frames\.append\(\("),
    "statistics appended": re.compile(r"\bstats \+= "),
    "a tensor's dtype appended": re.compile(r"\brec\.dtypes\.append\("),
    "a frame tuple unpacked": re.compile(r"for \w+, \w+, \w+ in (rec\.|self\.)?frames|, \w+ = rec\.frames\["),
    "the stride of two": re.compile(r"\[0::2\]|\[1::2\]|stats\[2 \* "),
}


def test_only_the_record_and_its_hot_path_twin_know_the_layout():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in OWNERS:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for what, mark in MARKS.items():
                if mark.search(line):
                    found.append(f"{rel}:{n}: {what}: {line.strip()}")
    assert found == []


def test_frames_written_through_the_record_read_back_in_order():
    info = ModuleInfo("lin", torch.nn.Linear(2, 2), False, True)
    rec = Record(3)
    items: list = []
    first = rec.first_free()
    rec.add(items, "weight", (torch.tensor(0.5), torch.tensor(2.0)), torch.float32)
    rec.add(items, "input[0]", "not a tensor", torch.float32)
    rec.add(items, "output", (0.25, 8.0), torch.float16)
    rec.add_frame(info, items, first)
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
    assert list(rec.measured()) == []


def test_sinks_read_a_record_through_batch_stats_columns():
    from tensorwatch_otel.core.events import BatchStats

    info = ModuleInfo("lin", torch.nn.Linear(2, 2), False, True)
    rec = Record(3)
    items: list = []
    first = rec.first_free()
    rec.add(items, "weight", (0.5, 2.0), torch.float32)
    rec.add_frame(info, items, first)
    rec.readback()
    stats = BatchStats(3, 0, 0.0, rec)
    cols = stats.columns()
    assert cols is rec and [(i.path, n, k) for i, n, k, _ in cols.measured()] == [("lin", "weight", 0)]
    mins, maxs = cols.host_extremes()
    assert (mins.tolist(), maxs.tolist()) == ([0.5], [2.0])
    assert len(stats.frames) == 1 and stats.columns() is None  # frames built: read those
    assert BatchStats(3, 0, 0.0, ()).columns() is None
