"""`report --plot` and `diff --plot`: what the pictures draw (read back from the figure's lines),
the files written (PNG, self-contained HTML, byte for byte deterministic), and the command line
without the plot extra."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from tensorwatch_otel import BatchTraceEvent, Frame, NonFiniteEvent, TensorStat
from tensorwatch_otel.cli import main
from tensorwatch_otel.cli.diff import load_trace
from tensorwatch_otel.report.codec import read_events
from tensorwatch_otel.report.diff import diff_frames
from tensorwatch_otel.report._plot_draw import segments
from tensorwatch_otel.report.plot import DTYPE_LIMIT, frame_points, plot_diff, plot_event, plot_frames, save

OVERFLOW_AT = 5
BAD = "blocks.1.mlp.fc1"  # the demo's overflowing layer
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
ENV.update(PYTHONUNBUFFERED="1", TENSORWATCH_PROMETHEUS_LINGER_SECONDS="0",
           PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                       ENV.get("PYTHONPATH", "")]))


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command line in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "tensorwatch_otel", *args], capture_output=True, text=True, env=ENV,
                          timeout=120)


@pytest.fixture(scope="module")
def demo_log(tmp_path_factory):
    """A real fp16 overflow: the demo's log with traced batches OVERFLOW_AT-1, OVERFLOW_AT and the detection."""
    log = tmp_path_factory.mktemp("demo") / "events.jsonl"
    r = cli("demo", "--steps", str(OVERFLOW_AT + 1), "--overflow-at-batch", str(OVERFLOW_AT), "--jsonl", str(log),
            "--quiet")
    assert r.returncode == 3, r.stderr
    return log


def _line(ax, gid):
    found = [a for a in ax.lines if a.get_gid() == gid]
    assert len(found) == 1, f"{gid}: {[a.get_gid() for a in ax.lines]}"
    return found[0]


def _has(ax, gid) -> bool:
    return any(a.get_gid() == gid for a in list(ax.lines) + list(ax.patches) + list(ax.collections))


def _float_stats(frames):
    return [(f.module, t) for f in frames for t in f.tensors
            if t.abs_max is not None and not t.dtype.startswith(("int", "bool"))]


def _same(ys, expected):
    """Line data equal to the expected values, nan where a log axis cannot draw (0, inf, nan)."""
    assert len(ys) == len(expected)
    for y, e in zip(ys, expected):
        if e is not None and math.isfinite(e) and e > 0:
            assert y == e
        else:
            assert math.isnan(y)


def _title(fig) -> str:
    return fig.axes[0].get_title(loc="left")


# ------------------------------------------------------------------------------ what is drawn
@pytest.mark.slow
def test_detection_picture_draws_every_float_tensor_the_limit_and_the_first_inf(demo_log):
    event = next(e for e in read_events(str(demo_log)) if isinstance(e, NonFiniteEvent))
    fig = plot_event(event)
    ax = fig.axes[0]
    stats = _float_stats(event.frames)
    n = len(stats)
    # the embedding's int64 token ids are left out: an integer cannot overflow to inf
    assert any(t.dtype == "int64" for f in event.frames for t in f.tensors)
    assert n == len(frame_points(event.frames)) and n > 3 * len(event.frames)

    abs_max, abs_min = _line(ax, "abs_max"), _line(ax, "abs_min")
    assert list(abs_max.get_xdata()) == list(range(n))  # call order along x
    _same(abs_max.get_ydata(), [t.abs_max for _, t in stats])
    _same(abs_min.get_ydata(), [t.abs_min for _, t in stats])
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == [f"{m or '(root)'} {t.name}" for m, t in stats]  # few enough to label each

    # the float16 limit, and float32's for the fp32 master weights
    assert list(_line(ax, "limit:float16").get_ydata()) == [65504.0, 65504.0]
    assert list(_line(ax, "limit:float32").get_ydata()) == [DTYPE_LIMIT["float32"]] * 2
    lo, hi = ax.get_ylim()
    finite = [v for _, t in stats for v in (t.abs_min, t.abs_max) if math.isfinite(v) and v > 0]
    assert lo <= min(finite) and hi >= DTYPE_LIMIT["float32"] > max(finite)
    assert _has(ax, "axis_cut")  # the empty decades between 1e5 and 3.4e38 are cut

    # the first inf: the overflowing layer's output, at the top edge, with a line and a red label
    bad = next(i for i, (_, t) in enumerate(stats) if t.kind)
    assert stats[bad][0] == BAD and stats[bad][1].name == "output" and bad == n - 1
    inf = _line(ax, "inf")
    assert list(inf.get_xdata()) == [bad] and list(inf.get_ydata()) == [1.0]
    assert inf.get_transform() == ax.get_xaxis_transform()  # y in axes fraction: the top edge
    assert list(_line(ax, "first_nonfinite").get_xdata()) == [bad, bad]
    tick = ax.get_xticklabels()[bad]
    assert tick.get_text() == f"{BAD} output" and tick.get_color() == "#c0392b"
    assert f"inf detected during batch {OVERFLOW_AT}" in _title(fig)
    assert "forward" in _title(fig) and f"{BAD} (Linear) output" in _title(fig)


@pytest.mark.slow
def test_traced_batch_picture_marks_the_first_inf_and_the_nans_after_it(demo_log):
    trace = next(e for e in read_events(str(demo_log)) if e.event == "batch_trace" and e.batch_number == OVERFLOW_AT)
    fig = plot_event(trace)
    ax = fig.axes[0]
    stats = _float_stats(trace.frames)
    kinds = [t.kind for _, t in stats]
    first = kinds.index("inf")
    assert stats[first][0] == BAD and stats[first][1].name == "output"
    assert first < len(stats) - 1  # the trace goes on after the overflow: the GELU turns inf into nan
    assert list(_line(ax, "first_nonfinite").get_xdata()) == [first, first]
    assert list(_line(ax, "inf").get_xdata()) == [i for i, k in enumerate(kinds) if k == "inf"]
    assert list(_line(ax, "nan").get_xdata()) == [i for i, k in enumerate(kinds) if k == "nan"]
    assert f"traced batch {OVERFLOW_AT} (rank 0): first inf in {BAD} (Linear) output" in _title(fig)


@pytest.mark.slow
def test_diff_picture_overlays_both_batches_and_marks_the_first_divergence(demo_log):
    side_a = load_trace(f"{demo_log}:{OVERFLOW_AT - 1}", None)
    side_b = load_trace(f"{demo_log}:{OVERFLOW_AT}", None)
    result = diff_frames(side_a[1].frames, side_b[1].frames)
    fig = plot_diff(result, side_a, side_b)
    ax, ax_chg = fig.axes[:2]
    rows = [(p, t) for p in result.pairs for t in p.tensors
            if t.a is not None and t.a.abs_max is not None and not t.a.dtype.startswith("int")]
    _same(_line(ax, "A:abs_max").get_ydata(), [t.a.abs_max for _, t in rows])
    _same(_line(ax, "B:abs_max").get_ydata(), [t.b.abs_max for _, t in rows])
    assert list(_line(ax, "limit:float16").get_ydata()) == [65504.0, 65504.0]
    first = next(i for i, (p, t) in enumerate(rows) if p is result.pairs[result.first] and t.score > 1.0)
    assert (rows[first][0].module, rows[first][1].name) == (BAD, "weight")  # scaled 1e5x before the batch
    assert list(_line(ax, "first_divergence").get_xdata()) == [first, first]
    # the change panel: a bar per tensor (infinite changes drawn at the top edge), the threshold
    heights = [b.get_height() for b in ax_chg.patches]
    assert heights == pytest.approx([t.score if math.isfinite(t.score) else 0.0 for _, t in rows])
    assert list(_line(ax_chg, "change_inf").get_xdata()) == [i for i, (_, t) in enumerate(rows)
                                                            if math.isinf(t.score)]
    assert list(_line(ax_chg, "threshold").get_ydata()) == [1.0, 1.0]
    assert list(_line(ax, "B inf").get_xdata())[0] == first + 3  # fc1 weight, bias, input[0], output
    assert f"first divergence in {BAD}" in _title(fig)


def test_diff_picture_shades_a_module_call_of_one_side_and_draws_each_sides_inf_once():
    def frame(module, out):
        return Frame(module, "Linear", (TensorStat("weight", 1e-3, 0.5, "float16"),
                                        TensorStat("output", 1e-3, out, "float16")), 3)

    a = (frame("l0", 2.0), frame("l1", 3.0), frame("l2", 4.0))
    b = (frame("l0", 2.0), frame("l1", 3.0), frame("extra", 5.0), frame("l2", math.inf))
    result = diff_frames(a, b, stat="both")
    fig = plot_diff(result, ("a.jsonl", BatchTraceEvent(3, 0, a, 0.0)), ("b.jsonl", BatchTraceEvent(3, 0, b, 0.0)))
    ax = fig.axes[0]
    assert [p.get_x() + 0.5 for p in ax.patches if p.get_gid() == "mismatch"] == [4]  # the extra call's 2 tensors
    assert list(_line(ax, "B inf").get_xdata()) == [7]  # once, though abs min and abs max are both drawn
    _same(_line(ax, "A:abs_min").get_ydata(), [1e-3] * 4 + [None] * 2 + [1e-3] * 2)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(legend) == len(set(legend)) and "module call in one batch only, or other tensors" in legend
    assert "1 mismatched" in _title(fig)


def _frames_with_phases():
    fwd = [Frame(f"layers.{i}", "Linear", (TensorStat("weight", 1e-4, 0.2, "float32"),
                                           TensorStat("bias", 0.0, 0.05, "float32"),
                                           TensorStat("input[0]", 1e-3, 3.0 * (i + 1), "bfloat16"),
                                           TensorStat("output", 1e-3, 4.0 * (i + 1), "bfloat16")), 7,
                 batch_start=(i == 0)) for i in range(3)]
    bwd = [Frame(f"layers.{i}", "Linear", (TensorStat("grad_output[0]", 1e-6, 10.0 ** (3 * i) if i else math.nan,
                                                      "bfloat16"),), 7, phase="backward") for i in (2, 1, 0)]
    opt = [Frame("layers.0", "Linear", (TensorStat("weight.exp_avg_sq", 0.0, 1e-3, "float32"),), 7, phase="optimizer")]
    return tuple(fwd + bwd + opt)


def test_phases_zeros_and_a_nan_in_the_backward():
    frames = _frames_with_phases()
    event = NonFiniteEvent(7, 0, "layers.0", "Linear", "grad_output[0]", "nan", frames, 0.0, phase="backward")
    fig = plot_event(event)
    ax = fig.axes[0]
    assert _has(ax, "phase:backward") and _has(ax, "phase:optimizer")
    assert "backward phase" in _title(fig) and "7 frames (3 forward, 3 backward, 1 optimizer)" in _title(fig)
    # 0 cannot be drawn on a log axis: the zero biases and the optimizer state's abs min are on the bottom edge
    assert list(_line(ax, "zero").get_xdata()) == [1, 5, 9, 15]
    assert list(_line(ax, "nan").get_xdata()) == [14] and list(_line(ax, "first_nonfinite").get_xdata()) == [14, 14]
    assert list(_line(ax, "limit:bfloat16").get_ydata()) == [DTYPE_LIMIT["bfloat16"]] * 2
    assert "first nan: layers.0 grad_output[0]" in "".join(t.get_text() for t in ax.texts)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "backward frames" in legend and "optimizer frames" in legend


def test_two_hundred_modules_thin_the_labels_but_keep_the_bad_one():
    frames = [Frame(f"model.layers.{i}.mlp.down_proj", "Linear",
                    (TensorStat("weight", 1e-5, 0.1, "float16"), TensorStat("output", 1e-4, 1.05 ** i, "float16")), 0)
              for i in range(200)]
    frames[150] = Frame(frames[150].module, "Linear", (frames[150].tensors[0], TensorStat("output", 1.0, math.inf,
                                                                                           "float16")), 0)
    fig = plot_frames(frames, "200 modules")
    ax = fig.axes[0]
    ticks = [int(x) for x in ax.get_xticks()]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert fig.get_figwidth() <= 24 and len(ticks) < 400 / 2  # thinned, not 400 overlapping labels
    assert 301 in ticks and labels[ticks.index(301)] == "model.layers.150.mlp.down_proj output"
    assert min(abs(t - 301) for t in ticks if t != 301) >= 2  # no neighbour crowding the bad one
    assert len(_line(ax, "abs_max").get_xdata()) == 400


def test_dtype_limits_are_torchs_and_the_axis_cuts_empty_decades():
    for name, value in DTYPE_LIMIT.items():
        if hasattr(torch, name):
            assert value == float(torch.finfo(getattr(torch, name)).max)
    assert segments([1e-3, 10.0], [65504.0]) == [(-4, 6)]  # data and fp16 limit: one stretch
    assert segments([1e-3, 10.0], [65504.0, DTYPE_LIMIT["float32"]]) == [(-4, 6), (37, 40)]
    assert segments([], []) == [(-7, 1)]


# ------------------------------------------------------------------------------ files and commands
@pytest.mark.slow
def test_report_plot_writes_png_and_self_contained_html_deterministically(demo_log, tmp_path, capsys):
    capsys.readouterr()
    assert main(["report", str(demo_log)]) == 0
    text = capsys.readouterr().out
    png, html = tmp_path / "a.png", tmp_path / "a.html"
    assert main(["report", str(demo_log), "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    assert out == text  # the text report is unchanged
    assert err.strip().splitlines() == [
        f"report: drew the inf/nan detection of batch {OVERFLOW_AT} (rank 0) to {png}; also matched: "
        f"batch_trace {OVERFLOW_AT - 1}, batch_trace {OVERFLOW_AT} (choose one with --batch N and --event TYPE)"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first = png.read_bytes()
    assert main(["report", str(demo_log), "--plot", str(png)]) == 0
    assert png.read_bytes() == first  # deterministic

    assert main(["report", str(demo_log), "--batch", str(OVERFLOW_AT - 1), "--plot", str(html)]) == 0
    assert f"drew the traced batch of batch {OVERFLOW_AT - 1}" in capsys.readouterr().err
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 1 and "</svg>" in page
    assert f"<title>traced batch {OVERFLOW_AT - 1} (rank 0): no inf/nan; " in page
    for fetch in ("<script", "<link", "<img", "src=", 'href="http', "url(http", "@import"):
        assert fetch not in page  # nothing to load: the page works offline
    assert main(["report", str(demo_log), "--batch", str(OVERFLOW_AT - 1), "--plot", str(html)]) == 0
    assert html.read_text() == page


@pytest.mark.slow
def test_diff_plot_keeps_the_text_and_exit_status(demo_log, tmp_path, capsys):
    specs = [f"{demo_log}:{OVERFLOW_AT - 1}", f"{demo_log}:{OVERFLOW_AT}"]
    capsys.readouterr()
    assert main(["diff", *specs]) == 1
    text = capsys.readouterr().out
    png = tmp_path / "d.png"
    assert main(["diff", *specs, "--plot", str(png)]) == 1
    out, err = capsys.readouterr()
    assert out == text and err == f"diff: drew batches {OVERFLOW_AT - 1} and {OVERFLOW_AT} to {png}\n"
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["--plot", "x.pdf"], "--plot x.pdf: expected a file name ending in .png, .svg or .html"),
    (["--plot", "no/such/dir/x.png"], "--plot no/such/dir/x.png: no such directory"),
    (["--batch", "0", "--plot", "x.png"], "--plot: no inf/nan detection or traced batch matches"),
])
def test_report_plot_errors_exit_2_with_one_line(demo_log, tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["report", str(demo_log), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and message in err
    assert os.listdir(tmp_path) == []


# One fresh interpreter: runs the commands with matplotlib importable (recording whether they
# imported it), then hidden as if the plot extra were not installed; prints what each run gave.
WITHOUT_MATPLOTLIB = """
import contextlib, io, json, sys
from tensorwatch_otel.cli import main

def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return [code, out.getvalue(), err.getvalue()]

runs = json.loads(sys.argv[1])
results = {"plain": [run(argv) for argv in runs], "imported": "matplotlib" in sys.modules}
sys.modules["matplotlib"] = None
results["hidden"] = [run(argv) for argv in runs]
results["hidden_plot"] = [run(argv + ["--plot", sys.argv[2]]) for argv in runs]
print(json.dumps(results))
"""


@pytest.mark.slow
def test_without_matplotlib_plot_exits_2_with_the_install_line_and_nothing_else_changes(demo_log, tmp_path):
    import json

    png = tmp_path / "x.png"
    runs = [["report", str(demo_log)], ["diff", f"{demo_log}:{OVERFLOW_AT - 1}", f"{demo_log}:{OVERFLOW_AT}"]]
    r = subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB, json.dumps(runs), str(png)], capture_output=True,
                       text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["imported"] is False  # the commands never import matplotlib unless asked to draw
    assert [code for code, _, _ in got["plain"]] == [0, 1]
    assert got["hidden"] == got["plain"]  # without the extra, nothing else changes
    for (argv, (code, out, err)) in zip(runs, got["hidden_plot"]):
        assert (code, out) == (2, "")
        assert err == (f"tensorwatch-otel {argv[0]}: error: --plot: drawing needs matplotlib: "
                       "pip install 'tensorwatch-otel[plot]'\n")
    assert not png.exists()


def test_save_refuses_other_formats(tmp_path):
    fig = plot_frames(_frames_with_phases(), "t")
    with pytest.raises(ValueError, match="expected a file name ending in"):
        save(fig, str(tmp_path / "x.pdf"))
    save(fig, str(tmp_path / "x.svg"))
    assert (tmp_path / "x.svg").read_text().lstrip().startswith("<?xml")
