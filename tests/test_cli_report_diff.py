"""`report` and `diff` on event logs written by real watched training runs, the alignment and
change rules of `_diff`, and the commands' error paths."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from tensorwatch_otel import BatchTraceEvent, Frame, NonFiniteDetected, TensorStat, watch
from tensorwatch_otel.report.codec import from_dict, read_events
from tensorwatch_otel.report.diff import align, change, diff_frames
from tensorwatch_otel.report.text import render_detection, render_trace
from tensorwatch_otel.cli import main
from tensorwatch_otel.sinks import JsonlLog

TRACED = 3


class Net(nn.Module):
    def __init__(self, extra: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.hidden = nn.ModuleList(nn.Linear(16, 16) for _ in range(3 if extra else 2))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        x = self.act(self.inp(x))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


def train(path, *, scale_at=None, module="hidden.1", factor=100.0, extra=False, steps=5, dtype=torch.float32,
          on_detect="raise"):
    """A short real training run with the watcher tracing batch TRACED into `path`; optionally
    `module`'s weight is multiplied by `factor` just before batch `scale_at`. Same seed, same data."""
    torch.manual_seed(0)
    model = Net(extra).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(steps)]
    sink = JsonlLog(str(path))
    detected = None
    with watch(model, sinks=[sink], trace_batches=[TRACED], on_detect=on_detect) as w:
        for b, (x, y) in enumerate(data):
            if b == scale_at:
                with torch.no_grad():
                    model.get_submodule(module).weight.mul_(factor)
            try:
                loss = ((model(x.to(dtype)).float() - y) ** 2).mean()
            except NonFiniteDetected as exc:
                detected = exc.event
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert w.batch_number == (b + 1 if detected else steps)
    sink.close()
    return detected


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("logs")
    paths = {"good": d / "good.jsonl", "bad": d / "bad.jsonl", "extra": d / "extra.jsonl"}
    train(paths["good"])
    train(paths["bad"], scale_at=TRACED)  # diverges at hidden.1, in the traced batch
    train(paths["extra"], extra=True)
    return paths


def run_cli(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------ diff
def test_diff_names_the_module_that_diverged(logs, capsys):
    code, out, err = run_cli(capsys, "diff", f"{logs['good']}:{TRACED}", f"{logs['bad']}:{TRACED}")
    assert code == 1, err
    assert "first divergence: hidden.1 (Linear), frame 4 of 6: weight abs max" in out
    assert "(2.00 decades)" in out  # the weight is exactly 100x
    assert "structure: the same 6 module calls in the same order" in out
    # the frames before it are identical (same seed, same data): no change at all
    a = [e for e in read_events(str(logs["good"])) if isinstance(e, BatchTraceEvent)][0]
    b = [e for e in read_events(str(logs["bad"])) if isinstance(e, BatchTraceEvent)][0]
    result = diff_frames(a.frames, b.frames)
    first = result.pairs[result.first]
    assert (first.module, first.index_a) == ("hidden.1", 3)
    assert all(t.score == 0.0 for p in result.pairs[:result.first] for t in p.tensors)
    assert [t.name for t in first.over(result.threshold)][0] == "weight"
    # side by side: the context frames and the mark on the divergent one
    lines = out.splitlines()
    marked = [line for line in lines if line.startswith(">>")]
    assert len(marked) == 1 and marked[0].rstrip().endswith("hidden.1 Linear")
    for name in ("inp Linear", "act ReLU", "hidden.0 Linear", "out Linear"):
        assert any(line.rstrip().endswith(name) for line in lines), name


def test_diff_of_the_same_batch_and_of_consecutive_batches_is_clean(logs, capsys, tmp_path):
    code, out, _ = run_cli(capsys, "diff", f"{logs['good']}:{TRACED}", f"{logs['good']}:{TRACED}")
    assert code == 0
    assert "no divergence" in out and "the largest change is 0.00 decades" in out
    # ordinary training from one batch to the next moves values by far less than tenfold
    path = tmp_path / "two.jsonl"
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with watch(model, sinks=[JsonlLog(str(path))], trace_batches=[1, 2]):
        for _ in range(3):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    code, out, _ = run_cli(capsys, "diff", f"{path}:1", f"{path}:2")
    assert code == 0, out


def test_diff_threshold_and_stat_options(logs, capsys):
    a, b = f"{logs['good']}:{TRACED}", f"{logs['bad']}:{TRACED}"
    assert run_cli(capsys, "diff", a, b, "--threshold", "2.5")[0] == 0  # 100x is 2 decades
    code, out, _ = run_cli(capsys, "diff", a, b, "--threshold", "1.5", "--context", "0")
    assert code == 1
    table = out.split("metadata\n", 1)[1]
    assert table.splitlines()[0].startswith(">>") and "inp Linear" not in table  # no context frames


def test_diff_reports_structural_mismatch(logs, capsys):
    code, out, _ = run_cli(capsys, "diff", f"{logs['good']}:{TRACED}", f"{logs['extra']}:{TRACED}")
    assert code == 1
    assert "structure: 6 module calls aligned, 1 mismatched:" in out
    assert "B frame 5: hidden.2 Linear: no counterpart in A" in out


def test_diff_between_a_good_batch_and_an_overflowing_fp16_batch(tmp_path, capsys):
    path = tmp_path / "fp16.jsonl"
    # fp16 weights scaled 1e5x: hidden.0's output overflows to inf in the traced batch
    event = train(path, scale_at=TRACED, module="hidden.0", factor=1e5, dtype=torch.float16, steps=TRACED + 1)
    assert event is not None and (event.module, event.tensor, event.kind) == ("hidden.0", "output", "inf")
    # a clean run traced the same batch (the same model and data before the scale)
    good = tmp_path / "good16.jsonl"
    train(good, dtype=torch.float16, steps=TRACED + 1)
    code, out, _ = run_cli(capsys, "diff", f"{good}:{TRACED}", f"{path}:{TRACED}", "--stat", "both")
    assert code == 1
    assert "B holds inf from frame 3: hidden.0 Linear output" in out
    assert "first divergence: hidden.0 (Linear)" in out
    assert " inf! output" in out


def test_change_rules():
    assert change(1.0, 10.0) == pytest.approx(1.0)
    assert change(10.0, 1.0) == pytest.approx(1.0)
    assert change(0.0, 1e-9) == 0.0  # both under the floor
    assert change(0.0, 1e-3) == pytest.approx(3.0)
    assert change(math.inf, math.inf) == 0.0
    assert change(math.nan, math.nan) == 0.0
    assert change(5.0, math.inf) == math.inf
    assert change(math.nan, 5.0) == math.inf
    assert change(math.inf, math.nan) == math.inf
    assert change(None, 1.0) is None


def _f(module, *tensors, cls="Linear"):
    return Frame(module, cls, tuple(TensorStat(n, mn, mx, "float32") for n, mn, mx in tensors), 0)


def test_align_by_module_path_and_call_order():
    a = [_f("x", ("output", 0.1, 1.0)), _f("y", ("output", 0.1, 1.0)), _f("x", ("output", 0.1, 2.0))]
    b = [_f("x", ("output", 0.1, 1.0)), _f("z", ("output", 0.1, 1.0)), _f("y", ("output", 0.1, 1.0)),
         _f("x", ("output", 0.1, 20.0), ("bias", 0.0, 1.0))]
    pairs = align(a, b)
    assert [(p.index_a, p.index_b, p.module) for p in pairs] == [(0, 0, "x"), (None, 1, "z"), (1, 2, "y"), (2, 3, "x")]
    assert pairs[1].mismatch == "no counterpart in A"
    assert pairs[3].mismatch == "only in B: bias"
    result = diff_frames(a, b, threshold=0.5)
    assert result.first == 3 and result.pairs[3].tensors[0].score == pytest.approx(1.0)  # 2 -> 20
    assert result.diverged
    assert diff_frames(a, b, threshold=1.0).first is None  # not *more* than the threshold


# ------------------------------------------------------------------------------ report
def test_report_renders_a_real_detection_and_trace(tmp_path, capsys):
    path = tmp_path / "e.jsonl"
    event = train(path, scale_at=TRACED, module="hidden.0", factor=1e5, dtype=torch.float16, steps=TRACED + 1)
    trace = [e for e in read_events(str(path)) if isinstance(e, BatchTraceEvent)][0]
    code, out, err = run_cli(capsys, "report", str(path))
    assert code == 0, err
    assert out == render_trace(trace) + render_detection(event)
    assert "Detected inf/nan during batch_number=3" in out and "hidden.0 Linear" in out
    code, out, _ = run_cli(capsys, "report", str(path), "--event", "batch_trace")
    assert out == render_trace(trace)
    code, out, err = run_cli(capsys, "report", str(path), "--batch", "7")
    assert code == 0 and out == ""
    assert "no event matches; events per batch in" in err and "3 (batch_trace, nonfinite_detected)" in err


def test_report_skips_a_truncated_last_line(tmp_path, capsys):
    path = tmp_path / "e.jsonl"
    event = train(path, scale_at=TRACED, module="hidden.0", factor=1e5, dtype=torch.float16, steps=TRACED + 1)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][: len(lines[1]) // 2])  # died while writing the detection
    code, out, _ = run_cli(capsys, "report", str(path))
    assert code == 0
    assert "Detected inf/nan" not in out and out.startswith("\n\n                  *** Starting batch number=3")
    assert event.batch_number == 3


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json}\n{}\n", ":1: "),
    ('{"event": "batch_trace"}\n{}\n', "not a tensorwatch event"),
    ('{"time": "2024-01-01T00:00:00Z", "event": "batch_trace", "batch_number": 1, "frames": [{"tensors": [{}]}]}'
     '\n{}\n', "malformed frames"),
    (b"\xff\xfe\x00garbage", "not UTF-8"),
])
def test_report_input_errors_exit_2_without_traceback(tmp_path, capsys, content, message):
    path = tmp_path / "e.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    code, out, err = run_cli(capsys, "report", str(path))
    assert code == 2 and out == ""
    assert err.startswith("tensorwatch-otel report: error: ") and message in err
    assert "Traceback" not in err


def test_report_of_an_empty_log_and_a_directory(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, out, err = run_cli(capsys, "report", str(empty))
    assert code == 0 and out == "" and "holds no events" in err
    code, _, err = run_cli(capsys, "report", str(tmp_path))
    assert code == 2 and "is a directory" in err


# ------------------------------------------------------------------------------ diff errors
def test_diff_input_errors_exit_2(logs, capsys, tmp_path):
    good = logs["good"]
    code, _, err = run_cli(capsys, "diff", f"{good}:2", f"{good}:{TRACED}")
    assert code == 2 and f"batch 2 was not traced; traced batches: {TRACED}" in err
    code, _, err = run_cli(capsys, "diff", f"{tmp_path}/missing.jsonl:1", f"{good}:{TRACED}")
    assert code == 2 and "missing.jsonl: no such file" in err
    code, _, err = run_cli(capsys, "diff", f"{good}:{TRACED}", f"{good}:{TRACED}", "--threshold", "-1")
    assert code == 2 and "--threshold -1.0" in err
    # no batch given: fine when the log traced exactly one batch
    code, out, _ = run_cli(capsys, "diff", str(good), f"{good}:{TRACED}")
    assert code == 0 and f"batch {TRACED}" in out
    # a detection without a trace of its batch: the error says so
    det = tmp_path / "det.jsonl"
    train(det, scale_at=1, module="hidden.0", factor=1e5, dtype=torch.float16, steps=2)
    code, _, err = run_cli(capsys, "diff", f"{det}:1", f"{good}:{TRACED}")
    assert code == 2 and "holds the inf/nan detection of batch 1" in err and "traced batches: none" in err


# ------------------------------------------------------------------------------ damaged and foreign logs
@pytest.fixture(scope="module")
def real_log(tmp_path_factory):
    """The two lines of a real run: the trace of batch TRACED and the fp16 overflow detected in it."""
    path = tmp_path_factory.mktemp("real") / "e.jsonl"
    train(path, scale_at=TRACED, module="hidden.0", factor=1e5, dtype=torch.float16, steps=TRACED + 1)
    lines = path.read_text().splitlines(keepends=True)
    assert [line.split('"event":"')[1].split('"')[0] for line in lines] == ["batch_trace", "nonfinite_detected"]
    return lines


def _report(capsys, tmp_path, text, *argv):
    path = tmp_path / "e.jsonl"
    path.write_text(text)
    code, out, err = run_cli(capsys, "report", str(path), *argv)
    assert "Traceback" not in err
    return code, out, err


UNUSABLE_LINES = [
    ('{"hello":"world"}\n', "no 'event'"),
    ('{"time":"2026-01-01T00:00:00Z","event":"batch_trace","batch_number":1e999,"rank":0,"frames":[]}\n',
     "batch_number: expected an integer, got inf"),
    ('{"time":"2026-01-01T00:00:00Z","event":"batch_trace","batch_number":2,"rank":1e999,"frames":[]}\n',
     "rank: expected an integer"),
    ('{"time":"2026-01-01T00:00:00Z","event":"batch_trace","batch_number":true,"frames":[]}\n',
     "batch_number: expected an integer"),
    ('{"time":5,"event":"batch_trace","batch_number":2,"frames":[]}\n', "time: expected a string"),
    ('{"time":"2026-01-01T00:00:00Z","event":"batch_trace","batch_number":2,"frames":{"a":1}}\n',
     "malformed frames"),
    ('{"time":"2026-01-01T00:00:00Z","event":"batch_trace","batch_number":2,"frames":'
     '[{"module":"m","module_class":"M","tensors":[{"name":"w","abs_min":{},"abs_max":1}]}]}\n',
     "abs_min: expected a number"),
    ('{"time":"2026-01-01T00:00:00Z","event":"batch_trace","batch_number":2,"frames":'
     '[{"module":7,"module_class":"M","tensors":[]}]}\n', "module: expected a string"),
    ("[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    ('{"a":' * 50_000 + "1" + "}" * 50_000 + "\n", "nested too deeply"),
    ("[1, 2]\n", "a JSON list, not an object"),
    ('"just a string"\n', "a JSON str, not an object"),
]


UNUSABLE_IDS = ["hello-world", "batch-1e999", "rank-1e999", "batch-bool", "time-int", "frames-dict", "abs-min-dict",
                "module-int", "deep-list", "deep-dict", "list", "string"]


@pytest.mark.parametrize("line, why", UNUSABLE_LINES, ids=UNUSABLE_IDS)
def test_report_a_file_of_one_unusable_line_is_not_an_event_log(tmp_path, capsys, line, why):
    code, out, err = _report(capsys, tmp_path, line)
    assert code == 2 and out == ""
    assert err.startswith("tensorwatch-otel report: error: not a tensorwatch event log: ") and ":1: " in err
    assert why in err


@pytest.mark.parametrize("line, why", UNUSABLE_LINES, ids=UNUSABLE_IDS)
def test_report_an_unusable_line_among_events_is_skipped_and_named(tmp_path, capsys, real_log, line, why):
    trace, detection = real_log
    code, out, err = _report(capsys, tmp_path, trace + line + detection)
    whole_code, whole, _ = _report(capsys, tmp_path, trace + detection)
    assert code == 0 == whole_code and out == whole  # everything valid rendered
    assert "skipped 1 line that is not a valid event: line 2" in err
    assert [ln for ln in err.splitlines() if ln.startswith("report:   line 2: ") and why in ln]


# Event types no version writes (yet): how a log from a newer version looks to this one.
NEW_TYPE = '{"time":"2026-01-01T00:00:00Z","event":"weights_reloaded","batch_number":3,"rank":0,"frames":[]}\n'


def test_report_unknown_event_types_are_skipped_alike_mid_file_and_last(tmp_path, capsys, real_log):
    trace, detection = real_log
    _, whole, _ = _report(capsys, tmp_path, trace + detection)
    streak = NEW_TYPE.replace("weights_reloaded", "learning_rate_changed")
    for text, lines in [(trace + NEW_TYPE + detection, "line 2"), (trace + detection + NEW_TYPE, "line 3"),
                        (NEW_TYPE + trace + detection + NEW_TYPE + streak, "lines 1, 4")]:
        code, out, err = _report(capsys, tmp_path, text)
        assert code == 0 and out == whole
        assert f"of types this version does not render: weights_reloaded ({lines})" in err
    assert "learning_rate_changed (line 5)" in err
    # a log of new event types only is still an event log: nothing to render, exit 0
    code, out, err = _report(capsys, tmp_path, NEW_TYPE + streak)
    assert code == 0 and out == ""
    assert "skipped 2 events of types" in err and "holds no events to render" in err


def test_report_a_log_cut_off_and_then_appended_to(tmp_path, capsys, real_log):
    # run 1 died while writing its detection; run 2 (restarted, same log) appended its own lines
    trace, detection = real_log
    first_run = trace + detection[: len(detection) // 2]
    code, out, err = _report(capsys, tmp_path, first_run + trace + detection)
    assert code == 0
    _, whole, _ = _report(capsys, tmp_path, trace + detection)
    assert out == render_trace(read_events_of(trace)) + whole  # run 1's trace, then all of run 2
    assert "skipped 1 line that is not a valid event: line 2" in err and "line 2: not JSON" in err
    assert "the event a restarted run appended to it was read" in err
    # the cut-off line on a line of its own (the restarted run began with a newline)
    code, out, err = _report(capsys, tmp_path, first_run + "\n" + trace + detection)
    assert code == 0 and out == render_trace(read_events_of(trace)) + whole
    assert "line 2: not JSON" in err and "was read" not in err
    # cut off at the very end: the same note
    code, out, err = _report(capsys, tmp_path, first_run)
    assert code == 0 and "Detected" not in out and "line 2: not JSON" in err


def read_events_of(line):
    return from_dict(json.loads(line))


def test_report_too_many_bad_lines_are_counted_not_all_listed(tmp_path, capsys, real_log):
    trace, detection = real_log
    code, out, err = _report(capsys, tmp_path, trace + "garbage\n" * 30 + detection)
    assert code == 0 and "Detected inf/nan" in out
    assert "skipped 30 lines that are not a valid event: lines 2, 3," in err and "and 10 more" in err
    assert len(err.splitlines()) < 15


def test_diff_reads_logs_through_the_same_loader(logs, capsys, tmp_path):
    good = logs["good"]
    lines = good.read_text().splitlines(keepends=True)
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("garbage\n" + NEW_TYPE + "".join(lines))
    code, out, err = run_cli(capsys, "diff", f"{damaged}:{TRACED}", f"{good}:{TRACED}")
    assert code == 0 and "no divergence" in out and "Traceback" not in err
    assert "diff: " in err and "line 1: not JSON" in err and "weights_reloaded (line 2)" in err
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"hello":"world"}\n')
    code, _, err = run_cli(capsys, "diff", f"{foreign}:1", f"{good}:{TRACED}")
    assert code == 2 and "not a tensorwatch event log" in err and "Traceback" not in err


def test_report_prints_skipped_steps_and_streaks(tmp_path, capsys):
    from tensorwatch_otel.core.events import SkippedStepEvent, SkipStreakEvent
    from tensorwatch_otel.report.codec import to_line

    log = tmp_path / "skips.jsonl"
    log.write_text(to_line(SkippedStepEvent(3, 0, 1, 1024.0, "a", "Linear", "weight.grad", "inf", 1.0))
                   + to_line(SkipStreakEvent(9, 0, 20, 0.001, 2.0)))
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["optimizer step skipped after batch_number=3 (rank 0, streak 1, scale 1024): inf in a weight.grad",
                   "20 optimizer steps in a row skipped by batch_number=9 (rank 0, scale 0.001)"]


# ------------------------------------------------------------------------------ terminal safety
# A log file is data from wherever it came from: a string in it (module, class, tensor, dtype,
# event type) must reach the terminal as text, not as a control sequence.
ESC_NAME = "enc\x1b[2J\x07.blöck\rnächste\nzeile"  # clear screen, bell, carriage return, newline
ESC_CLASS = "Lin\x1b]0;pwned\x07ear"  # an OSC sequence (sets the terminal title)
ESC_TENSOR = "out\x9bput\u202e"  # a C1 CSI and a right-to-left override
SHOWN_NAME = r"enc\x1b[2J\x07.blöck\rnächste\nzeile"
SHOWN_CLASS = r"Lin\x1b]0;pwned\x07ear"
SHOWN_TENSOR = r"out\x9bput\u202e"


def _crafted_log(path, batch, abs_max):
    from tensorwatch_otel.core.events import NonFiniteEvent
    from tensorwatch_otel.report.codec import to_line

    frames = (Frame("inp", "Linear", (TensorStat("weight", 0.1, 1.0, "float32"),), batch, batch_start=True),
              Frame(ESC_NAME, ESC_CLASS, (TensorStat(ESC_TENSOR, 0.1, abs_max, "float\x1b[31m32"),), batch))
    trace = BatchTraceEvent(batch, 0, frames, 1.0)
    bad = (Frame(ESC_NAME, ESC_CLASS, (TensorStat(ESC_TENSOR, math.inf, math.inf, "float32"),), batch),)
    detection = NonFiniteEvent(batch, 0, ESC_NAME, ESC_CLASS, ESC_TENSOR, "inf", bad, 2.0)
    unknown = ('{"time":"2026-01-01T00:00:00Z","event":"x\\u001b[2Jy","batch_number":1,"rank":0,"frames":[]}\n')
    path.write_text(to_line(trace) + to_line(detection) + unknown, encoding="utf-8")
    return path


def _assert_printable(text, *shown):
    # only the report's own newlines; everything else a control character would be is escaped
    bad = sorted({hex(ord(c)) for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) <= 0x9f
                  or c in "\u202e\u2028\u2029"})
    assert not bad, (bad, text[-2000:])
    for s in shown:
        assert s in text, (s, text[-2000:])


def _cli(*argv):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "tensorwatch_otel", *argv], capture_output=True, timeout=120,
                          encoding="utf-8", errors="surrogateescape")


def test_report_prints_control_characters_from_the_log_escaped(tmp_path):
    log = _crafted_log(tmp_path / "crafted.jsonl", 7, 2.0)
    proc = _cli("report", str(log))
    assert proc.returncode == 0, proc.stderr
    _assert_printable(proc.stdout, SHOWN_NAME, SHOWN_CLASS, SHOWN_TENSOR)
    _assert_printable(proc.stderr, r"x\x1b[2Jy")  # the skipped event type, named on stderr
    # the newline in the module name does not start a line of its own
    assert any(line.endswith(f" {SHOWN_NAME} {SHOWN_CLASS}") for line in proc.stdout.splitlines())
    assert f"{SHOWN_TENSOR} has infs" in proc.stdout


def test_diff_prints_control_characters_from_the_logs_escaped(tmp_path):
    a = _crafted_log(tmp_path / "a.jsonl", 7, 2.0)
    b = _crafted_log(tmp_path / "b.jsonl", 7, 2000.0)  # the crafted module diverges
    proc = _cli("diff", f"{a}:7", f"{b}:7")
    assert proc.returncode == 1, proc.stderr
    _assert_printable(proc.stdout, SHOWN_NAME, SHOWN_CLASS, SHOWN_TENSOR)
    _assert_printable(proc.stderr, r"x\x1b[2Jy")
    assert f"first divergence: {SHOWN_NAME} ({SHOWN_CLASS}), frame 2 of 2: {SHOWN_TENSOR}" in proc.stdout


def test_printable_keeps_ordinary_text_and_escapes_controls():
    from tensorwatch_otel.report._terminal import printable

    assert printable("blocks.0.ff → Ünïcödé 名前 🙂 a\\b") == "blocks.0.ff → Ünïcödé 名前 🙂 a\\b"
    assert printable("a\tb\x00c\x7fd\x85e\u2028f\ud800") == r"a\tb\x00c\x7fd\x85e\u2028f\ud800"
