"""Pictures of frames for `report --plot` and `diff --plot`: abs max and abs min of every float
tensor in call order on a log axis, the dtype limits, the first inf/nan or divergence marked.

matplotlib is an extra (`pip install tensorwatch-otel[plot]`), imported inside functions only,
always on the Agg canvas (no pyplot, no window). The functions return the Figure, so what was
drawn can be read back (lines carry gids: "abs_max", "abs_min", "limit:float16", "inf", ...).
"""

from __future__ import annotations

import html
import io
import math
import os
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..core.events import BatchTraceEvent, NonFiniteEvent
from ..core.frame_stats import Frame, TensorStat
from . import _plot_draw as d
from ._plot_draw import DTYPE_LIMIT, INSTALL_HINT, MissingExtra, require_matplotlib

__all__ = ["DTYPE_LIMIT", "FORMATS", "INSTALL_HINT", "MissingExtra", "require_matplotlib", "frame_points",
           "plot_event", "plot_frames", "plot_diff", "save"]

FORMATS = (".png", ".svg", ".html", ".htm")
_BLUE, _ORANGE, _PURPLE, _B_RED = "#1f77b4", "#ff7f0e", "#8e44ad", "#d62728"


@dataclass(frozen=True)
class Point:
    """One plotted tensor: x is its position on the axis, frame the index of its frame."""

    x: int
    frame: int
    module: str
    tensor: str
    dtype: str
    phase: str
    abs_min: float
    abs_max: float
    kind: str  # "" finite, "inf", "nan"
    underflow: Optional[dict] = None  # target_dtypes: dtype name -> share (TensorStat.underflow)
    overflow: Optional[dict] = None

    @property
    def parameter(self) -> bool:
        """A weight, bias, their gradient or optimizer state, rather than an input or output."""
        return not self.tensor.startswith(("input", "output", "grad_input", "grad_output"))


def plotted(t: Optional[TensorStat]) -> bool:
    """A tensor with statistics whose dtype can overflow (integer and bool tensors cannot)."""
    if t is None or t.abs_min is None or t.abs_max is None:
        return False
    return not t.dtype.startswith(("int", "uint", "bool"))


def frame_points(frames: Sequence[Frame]) -> List[Point]:
    """The points of plot_frames(), in call order: every plotted tensor of every frame."""
    points: List[Point] = []
    for i, f in enumerate(frames):
        for t in f.tensors:
            if plotted(t):
                points.append(Point(len(points), i, f.module, t.name, t.dtype, f.phase, t.abs_min, t.abs_max,
                                    t.kind, t.underflow, t.overflow))
    return points


def drawable(v: Optional[float]) -> float:
    """v where a log axis can draw it, else nan (a gap in the line): 0, inf and nan are drawn
    as edge markers instead."""
    return v if v is not None and math.isfinite(v) and v > 0 else math.nan


def _phases(frames: Sequence[Frame]) -> str:
    counts: dict = {}
    for f in frames:
        counts[f.phase] = counts.get(f.phase, 0) + 1
    if len(counts) <= 1:
        return f"{len(frames)} {next(iter(counts), 'forward')} frames"
    return f"{len(frames)} frames ({', '.join(f'{n} {p}' for p, n in counts.items())})"


# ------------------------------------------------------------------------------ one event
@d.styled
def plot_frames(frames: Sequence[Frame], title: str):
    """abs max and abs min of every float tensor of `frames`, in call order, on a log axis."""
    frames = tuple(frames)
    pts = frame_points(frames)
    targets = list(dict.fromkeys(k for p in pts for k in (p.underflow or ())))
    if targets:  # target_dtypes: a panel of the shares below
        fig, (ax, ax_prec) = d.figure(len(pts), rows=2)
    else:
        fig, (ax,) = d.figure(len(pts))
    xs = [p.x for p in pts]
    limits = d.limit_lines(ax, [p.dtype for p in pts])
    d.log_axis(ax, [p.abs_max for p in pts] + [p.abs_min for p in pts], limits)
    ax.plot(xs, [drawable(p.abs_max) for p in pts], color=_BLUE, lw=1.2, marker="o", ms=4, zorder=4,
            gid="abs_max", label="abs max")
    params = [p for p in pts if p.parameter and drawable(p.abs_max) == p.abs_max]
    if params:  # hollow markers: parameters sit apart from the activations they feed
        ax.plot([p.x for p in params], [p.abs_max for p in params], ls="none", marker="o", ms=4, mfc="white",
                mec=_BLUE, zorder=4.5, gid="abs_max_parameters", label="abs max of a parameter (hollow)")
    ax.plot(xs, [drawable(p.abs_min) for p in pts], color=_ORANGE, lw=0.8, alpha=0.7, marker=".", ms=3,
            zorder=3, gid="abs_min", label="abs min")
    d.edge_markers(ax, [(p.x, p.kind) for p in pts if p.kind], d.RED)
    d.zero_markers(ax, [p.x for p in pts if p.abs_min == 0 or p.abs_max == 0])
    bad = next((p for p in pts if p.kind), None)
    if bad is not None:
        d.mark(ax, bad.x, len(pts), f"first {bad.kind}: {bad.module or '(root)'} {bad.tensor}\n"
               f"frame {bad.frame + 1} of {len(frames)}, {bad.phase}, {bad.dtype or 'dtype unknown'}",
               d.RED, "first_nonfinite")
    starts, seen = [], set()
    for p in pts:
        if p.frame not in seen:
            seen.add(p.frame)
            f = frames[p.frame]
            starts.append((p.x, f.phase, f.batch_number, f.batch_start))
    d.frame_guides(ax, starts, len(pts))
    if targets:
        _precision_panel(ax_prec, pts, targets)
    d.xticks(ax_prec if targets else ax, [d.short_label(p.module, p.tensor) for p in pts], fig.get_figwidth(),
             keep=[bad.x] if bad else ())
    ax.set_ylabel("|value| (log scale)")
    ax.set_title(title, loc="left")
    if not pts:
        ax.text(0.5, 0.5, "no float tensor with statistics in these frames", ha="center", transform=ax.transAxes)
    fig.legend(loc="outside right upper")
    return fig


_TARGET_COLORS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def _precision_panel(ax, pts: Sequence[Point], targets: Sequence[str]) -> None:
    """Per target dtype, the share of each tensor's non-zero finite elements a cast flushes to
    zero (a line, gid "underflow:<dtype>") and, where not 0, the share beyond its largest value
    (triangles, gid "overflow:<dtype>"), in percent."""
    xs = [p.x for p in pts]
    for i, k in enumerate(targets):
        color = _TARGET_COLORS[i % len(_TARGET_COLORS)]
        ys = [100 * (p.underflow or {}).get(k, math.nan) for p in pts]
        ax.plot(xs, ys, color=color, lw=1.0, marker=".", ms=3, gid=f"underflow:{k}", label=f"underflow {k}")
        over = [(p.x, 100 * (p.overflow or {}).get(k, 0.0)) for p in pts]
        over = [(x, v) for x, v in over if v > 0]
        if over:
            ax.plot([x for x, _ in over], [v for _, v in over], ls="none", marker="^", ms=6, color=color,
                    gid=f"overflow:{k}", label=f"overflow {k}")
    ax.set_ylim(-3, 103)
    ax.set_ylabel("% of non-zero finite\nelements (cast)")
    ax.grid(True, axis="y", color="0.9", lw=0.6)


def event_title(event) -> str:
    """What the event is, where its first inf/nan is, and the phases of its frames."""
    frames = event.frames
    if isinstance(event, NonFiniteEvent):
        head = (f"{event.kind} detected during batch {event.batch_number} (rank {event.rank}, {event.phase} phase): "
                f"{event.module or '(root)'} ({event.module_class}) {event.tensor}")
        what = f"the last {_phases(frames)}"
    else:
        bad = next((f for f in frames if f.kind), None)
        head = f"traced batch {event.batch_number} (rank {event.rank}): " + (
            f"first {bad.kind} in {bad.module or '(root)'} ({bad.module_class}) {bad.first_nonfinite().name}, "
            f"{bad.phase} phase" if bad else "no inf/nan")
        what = _phases(frames)
    return f"{head}\n{what}: abs max and abs min of each float tensor, in call order"


def plot_event(event):
    """The picture of a detection (NonFiniteEvent) or a traced batch (BatchTraceEvent)."""
    if not isinstance(event, (NonFiniteEvent, BatchTraceEvent)):
        raise TypeError(f"cannot plot a {event.event} event: only detections and traced batches have frames")
    return plot_frames(event.frames, event_title(event))


# ------------------------------------------------------------------------------ two batches
@d.styled
def plot_diff(result, side_a: Tuple[str, BatchTraceEvent], side_b: Tuple[str, BatchTraceEvent]):
    """A and B overlaid on their aligned frames (A blue, B red) with the dtype limits; below, the
    change of each tensor in decades against the threshold; the first divergence marked.
    `result` is report.diff.diff_frames()'s; the sides are (path, trace event)."""
    rows = [(n, t) for n, pair in enumerate(result.pairs) for t in pair.tensors if plotted(t.a) or plotted(t.b)]
    fig, (ax, ax_chg) = d.figure(len(rows), rows=2)
    xs = list(range(len(rows)))
    stats = {"max": ("abs_max",), "min": ("abs_min",), "both": ("abs_max", "abs_min")}[result.stat]
    series = []
    for side, color in (("a", _BLUE), ("b", _B_RED)):
        for stat in stats:
            ys = [getattr(getattr(t, side), stat) if plotted(getattr(t, side)) else None for _, t in rows]
            series.append((side.upper(), stat, color, ys))
    dtypes = [s.dtype for _, t in rows for s in (t.a, t.b) if plotted(s)]
    limits = d.limit_lines(ax, dtypes)
    d.log_axis(ax, [v for *_, ys in series for v in ys], limits)
    for k, (name, stat, color, ys) in enumerate(series):
        main = stat == "abs_max"
        ax.plot(xs, [drawable(v) for v in ys], color=color, lw=1.2 if main else 0.8, ls="-" if main else "--",
                marker="o" if main else ".", ms=4 if name == "A" else 3, alpha=0.85, zorder=4,
                gid=f"{name}:{stat}", label=f"{name} {stat.replace('_', ' ')}")
        if k + 1 == len(series) or series[k + 1][0] != name:  # once per side: where the tensor is inf/nan
            side = [getattr(t, name.lower()) for _, t in rows]
            d.edge_markers(ax, [(x, s.kind) for x, s in zip(xs, side) if plotted(s) and s.kind], color,
                           prefix=f"{name} ", size=10 if name == "A" else 7)
    starts, label = [], "module call in one batch only, or other tensors"
    for x, (n, _) in enumerate(rows):
        if x == 0 or rows[x - 1][0] != n:
            starts.append(x)
            if result.pairs[n].mismatch:
                last = max(i for i, (m, _) in enumerate(rows) if m == n)
                ax.axvspan(x - 0.5, last + 0.5, color="0.82", zorder=0, lw=0, gid="mismatch", label=label)
                label = None
    for x in starts[1:]:
        ax.axvline(x - 0.5, color="0.9", lw=0.5, zorder=0)
    first_x = next((x for x, (n, t) in enumerate(rows) if n == result.first and t.score is not None
                    and t.score > result.threshold), None)
    _change_panel(ax_chg, rows, result)
    if first_x is not None:
        n, t = rows[first_x]
        pair = result.pairs[n]
        change = "an infinite change" if math.isinf(t.score) else f"{t.score:.2f} decades"
        d.mark(ax, first_x, len(rows), f"first divergence: {pair.module or '(root)'} ({pair.module_class}) {t.name}\n"
               f"{change}, frame {(pair.index_a if pair.index_a is not None else pair.index_b) + 1}", _PURPLE,
               "first_divergence")
        ax_chg.axvline(first_x, color=_PURPLE, lw=1.5, alpha=0.8, zorder=2)
    d.xticks(ax_chg, [d.short_label(result.pairs[n].module, t.name) for n, t in rows], fig.get_figwidth(),
             keep=[first_x])
    ax.set_ylabel("|value| (log scale)")
    ax.set_title(diff_title(result, side_a, side_b), loc="left")
    fig.legend(loc="outside right upper")
    return fig


def diff_title(result, side_a, side_b) -> str:
    (path_a, ta), (path_b, tb) = side_a, side_b
    stat = {"max": "abs max", "min": "abs min", "both": "abs max and abs min"}[result.stat]
    verdict = ("no value moved by more than the threshold" if result.first is None else
               f"first divergence in {result.pairs[result.first].module or '(root)'}")
    phases = sorted({(p.a or p.b).phase for p in result.pairs}) or ["forward"]
    return (f"A: {os.path.basename(path_a)} batch {ta.batch_number} (rank {ta.rank})  vs  "
            f"B: {os.path.basename(path_b)} batch {tb.batch_number} (rank {tb.rank}): {verdict}\n"
            f"{stat} of each float tensor on {result.aligned} aligned module calls ({', '.join(phases)} phase), "
            f"{len(result.mismatches)} mismatched")


def _change_panel(ax, rows, result):
    scores = [t.score for _, t in rows]
    bars = [s if s is not None and math.isfinite(s) else 0.0 for s in scores]
    over = [s is not None and s > result.threshold for s in scores]
    ax.bar(range(len(rows)), bars, width=0.8, color=[_PURPLE if o else "0.6" for o in over], gid="change")
    ax.set_ylim(0, max([result.threshold * 1.5, 1.0] + bars) * 1.15)
    inf_x = [x for x, s in enumerate(scores) if s is not None and math.isinf(s)]
    if inf_x:
        ax.plot(inf_x, [1.0] * len(inf_x), ls="none", marker="^", ms=7, color=_PURPLE,
                transform=ax.get_xaxis_transform(), clip_on=False, gid="change_inf",
                label="infinite change (finite against inf/nan)")
    ax.axhline(result.threshold, color="0.2", lw=1, ls="--", gid="threshold",
               label=f"threshold: a change of {result.threshold:g} (x{10 ** result.threshold:.3g})")
    ax.set_ylabel("change |log10(B/A)|\nin decades")
    ax.grid(True, axis="y", color="0.9", lw=0.6)


# ------------------------------------------------------------------------------ files
def save(fig, path: str) -> None:
    """Writes `fig` as PNG, SVG, or a self-contained HTML page (the SVG inline), by the suffix."""
    require_matplotlib()
    import matplotlib.style

    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"{path}: expected a file name ending in {', '.join(FORMATS)}")
    with matplotlib.style.context(d.STYLE):
        if ext == ".png":
            fig.savefig(path, format="png", metadata={"Software": None})
            return
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", buf.getvalue(), flags=re.S)  # RDF boilerplate
    if ext in (".html", ".htm"):
        svg = _page("; ".join(fig.axes[0].get_title(loc="left").split("\n")), svg[svg.index("<svg"):])
    with open(path, "w", encoding="utf-8") as f:
        f.write(svg)


def _page(title: str, svg: str) -> str:
    """A page with nothing to fetch: the SVG is inline, its text drawn as paths."""
    title = html.escape(title or "tensorwatch_otel")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{title}</title>\n<style>body{{font-family:sans-serif;margin:1em}}"
            "svg{max-width:100%;height:auto}</style>\n</head>\n<body>\n"
            f"<h1 style=\"font-size:1.1em;font-weight:normal\">{title}</h1>\n{svg}\n</body>\n</html>\n")
