"""Drawing pieces shared by the pictures of plot.py: the fixed style, the log axis with cut gaps,
dtype limit lines, markers for values a log axis cannot draw, thinned tick labels.

Everything here imports matplotlib inside functions: the module itself loads without it.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List, Optional, Sequence, Tuple

#: largest finite value per floating dtype (torch.finfo(dtype).max), the limit lines drawn
DTYPE_LIMIT: Dict[str, float] = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
    "float8_e4m3fn": 448.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2": 57344.0,
    "float8_e5m2fnuz": 57344.0,
    "float8_e8m0fnu": 1.7014118346046923e38,
}
INSTALL_HINT = "pip install 'tensorwatch-otel[plot]'"
DPI = 100
LABEL_CHARS = 48  # longer tick labels keep their tail (the leaf module and the tensor)
RED = "#c0392b"
KIND_MARKER = {"inf": "^", "nan": "X"}
_PHASE_SHADE = {"backward": "#dbe9f6", "optimizer": "#e5f2dc"}
# A user's matplotlibrc must not change the picture, and SVG ids must not be random.
STYLE = ["default", {"svg.hashsalt": "tensorwatch_otel", "svg.fonttype": "path", "font.size": 9,
                     "axes.titlesize": 10, "legend.fontsize": 8, "figure.dpi": DPI, "savefig.dpi": DPI}]
_MIN_GAP = 5  # decades of empty axis between data and a limit line before the gap is cut
_CUT_W = 1.0  # decades of height a cut gap keeps


class MissingExtra(ImportError):
    """matplotlib is not installed; the message says how to install the extra."""


def require_matplotlib():
    """The matplotlib module, or MissingExtra with the install line."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra(f"drawing needs matplotlib: {INSTALL_HINT}") from None
    return matplotlib


def styled(fn):
    """Runs a drawing function under STYLE: text sizes are fixed when artists are created."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        require_matplotlib()
        import matplotlib.style

        with matplotlib.style.context(STYLE):
            return fn(*args, **kwargs)
    return wrapper


def figure(n: int, rows: int = 1):
    """A Figure on the Agg canvas (no pyplot, no window), as wide as n points need."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = min(24.0, max(11.0, 4.0 + 0.13 * n))
    fig = Figure(figsize=(width, 6.5 if rows == 1 else 9.0), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    if rows == 1:
        return fig, [fig.add_subplot()]
    return fig, list(fig.subplots(rows, 1, sharex=True, height_ratios=[3, 1.2]))


def short_label(module: str, tensor: str) -> str:
    text = f"{module or '(root)'} {tensor}"
    return text if len(text) <= LABEL_CHARS else "…" + text[-(LABEL_CHARS - 1):]


# ------------------------------------------------------------------------------ the y axis
def segments(values: Sequence[Optional[float]], limits: Sequence[float]) -> List[Tuple[int, int]]:
    """Decade ranges the axis shows: the data's and each limit's, a decade of margin each;
    ranges closer than _MIN_GAP decades merge, the gaps between the others are cut."""
    finite = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    spans = []
    if finite:
        spans.append((math.floor(math.log10(min(finite))) - 1, math.ceil(math.log10(max(finite))) + 1))
    spans += [(math.floor(math.log10(v)) - 1, math.ceil(math.log10(v)) + 1) for v in limits]
    if not spans:
        spans = [(-7, 1)]
    spans.sort()
    merged = [list(spans[0])]
    for lo, hi in spans[1:]:
        if lo - merged[-1][1] < _MIN_GAP:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _knots(segs: Sequence[Tuple[int, int]]):
    us, vs, v = [], [], 0.0
    for k, (lo, hi) in enumerate(segs):
        if k:
            v += _CUT_W
        us += [lo, hi]
        vs += [v, v + hi - lo]
        v += hi - lo
    return us, vs


def _piecewise(x, xs, ys):
    import numpy as np

    x = np.asarray(x, dtype=float)
    y = np.interp(x, xs, ys)
    return np.where(x < xs[0], ys[0] + x - xs[0], np.where(x > xs[-1], ys[-1] + x - xs[-1], y))


def log_axis(ax, values: Sequence[Optional[float]], limits: Sequence[float]) -> List[Tuple[int, int]]:
    """A log y axis over `values` and `limits`; empty stretches of many decades (between the data
    and float32's 3.4e38, say) are cut to one decade and hatched. Returns the shown segments."""
    import numpy as np
    from matplotlib.ticker import FixedLocator, NullLocator

    segs = segments(values, limits)
    ax.grid(True, axis="y", which="major", color="0.9", lw=0.6)
    if len(segs) == 1:
        ax.set_yscale("log")
        ax.set_ylim(10.0 ** segs[0][0], 10.0 ** segs[0][1])
        return segs
    us, vs = _knots(segs)

    def forward(y):
        with np.errstate(divide="ignore", invalid="ignore"):
            return _piecewise(np.log10(np.where(np.asarray(y, float) > 0, y, np.nan)), us, vs)

    def inverse(v):
        return 10.0 ** _piecewise(v, vs, us)

    ax.set_yscale("function", functions=(forward, inverse))
    ax.set_ylim(10.0 ** segs[0][0], 10.0 ** segs[-1][1])
    total = sum(hi - lo for lo, hi in segs)
    step = max(1, math.ceil(total / 14))
    ticks = [d for lo, hi in segs for d in range(lo, hi + 1) if d % step == 0 or d in (lo, hi)]
    ax.yaxis.set_major_locator(FixedLocator([10.0 ** d for d in ticks]))
    ax.yaxis.set_major_formatter(_DecadeFormatter())
    ax.yaxis.set_minor_locator(NullLocator())
    for (_, hi), (lo, _) in zip(segs, segs[1:]):
        ax.axhspan(10.0 ** hi, 10.0 ** lo, facecolor="white", edgecolor="0.75", hatch="//", lw=0, zorder=0.5,
                   gid="axis_cut")
        ax.annotate(f"axis cut: {lo - hi} decades not shown", xy=(0.005, math.sqrt(10.0 ** hi * 10.0 ** lo)),
                    xycoords=("axes fraction", "data"), va="center", fontsize=7, color="0.35",
                    bbox={"boxstyle": "square,pad=0.15", "fc": "white", "ec": "none"}, zorder=0.6)
    return segs


def _DecadeFormatter():
    from matplotlib.ticker import Formatter

    class DecadeFormatter(Formatter):
        def __call__(self, x, pos=None):
            return f"$10^{{{round(math.log10(x))}}}$" if x > 0 else ""

    return DecadeFormatter()


# ------------------------------------------------------------------------------ lines and markers
def limit_lines(ax, dtypes: Sequence[str]) -> List[float]:
    """One dashed horizontal line per floating dtype present: its largest finite value."""
    limits: List[float] = []
    notes: List[List] = []  # [value, text]: limits less than half a decade apart share one note
    for d in sorted({d for d in dtypes if d in DTYPE_LIMIT}, key=DTYPE_LIMIT.get):
        v = DTYPE_LIMIT[d]
        limits.append(v)
        ax.axhline(v, color=RED if v < 1e6 else "0.45", lw=1.2, ls="--", zorder=1, gid=f"limit:{d}",
                   label=f"{d} largest finite ({v:.5g})")
        if notes and math.log10(v / notes[-1][0]) < 0.5:
            notes[-1][1] += f", {d} {v:.5g}"
        else:
            notes.append([v, f"largest finite: {d} {v:.5g}"])
    for v, text in notes:
        ax.annotate(text, xy=(0.005, v), xycoords=("axes fraction", "data"), xytext=(0, 2),
                    textcoords="offset points", ha="left", va="bottom", fontsize=7,
                    color=RED if v < 1e6 else "0.35")
    return limits


def edge_markers(ax, points: Sequence[Tuple[int, str]], color: str, prefix: str = "", size: float = 8):
    """Values a log axis cannot draw, (x, kind) with kind 'inf' or 'nan', as markers on the top
    edge, one marker shape per kind."""
    trans = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for kind, marker in KIND_MARKER.items():
        xs = [x for x, k in points if kind in k]
        if xs:
            ax.plot(xs, [1.0] * len(xs), ls="none", marker=marker, ms=size, color=color, mec="white", mew=0.5,
                    transform=trans, clip_on=False, zorder=6, gid=f"{prefix}{kind}",
                    label=f"{prefix}{kind} (drawn at the top edge)")


def zero_markers(ax, xs: Sequence[int], color: str = "0.45", gid: str = "zero"):
    """Zeros (an all-zero bias, a ReLU output's abs min) on the bottom edge."""
    if xs:
        ax.plot(list(xs), [0.0] * len(xs), ls="none", marker="v", ms=5, color=color,
                transform=ax.get_xaxis_transform(), clip_on=False, zorder=5, gid=gid,
                label="0 (drawn at the bottom edge)")


def mark(ax, x: int, n: int, text: str, color: str, gid: str):
    """A vertical line through x with a boxed note beside it, on the side with more room (n
    points in all): the first inf/nan, the first divergence."""
    ax.axvline(x, color=color, lw=1.5, alpha=0.8, zorder=2, gid=gid)
    left = x > n / 2
    ax.annotate(text, xy=(x, 0.9), xycoords=("data", "axes fraction"), xytext=(-6 if left else 6, 0),
                textcoords="offset points", ha="right" if left else "left", va="top", color=color, fontsize=9,
                fontweight="bold",
                bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": color, "alpha": 0.95}, zorder=7)


def xticks(ax, labels: Sequence[str], width_in: float, keep: Sequence[Optional[int]] = ()) -> List[int]:
    """Every label when they fit, else every k-th one; `keep` (shown in bold red) always.
    Returns the labelled positions. (No ticks for the others: hundreds of Tick artists cost
    seconds.)"""
    n = len(labels)
    fit = max(1, int(width_in * 72 / 10))  # rotated 7pt labels need about 10pt each
    step = max(1, math.ceil(n / fit))
    shown = set(range(0, n, step))
    keep = [k for k in keep if k is not None and 0 <= k < n]
    for k in keep:
        shown = {j for j in shown if abs(j - k) >= step or j == k} | {k}
    major = sorted(shown)
    ax.set_xticks(major, [labels[i] for i in major], rotation=90, fontsize=7)
    for tick, i in zip(ax.get_xticklabels(), major):
        if i in keep:
            tick.set_color(RED)
            tick.set_fontweight("bold")
    ax.set_xlim(-0.7, max(n, 1) - 0.3)
    return major


def frame_guides(ax, starts: Sequence[Tuple[int, str, int, bool]], n: int):
    """Per frame (first x, phase, batch number, batch_start): light separators, shaded phases
    other than forward, a dotted line and the batch number where a new batch starts."""
    seen = set()
    for k, (x0, phase, batch, batch_start) in enumerate(starts):
        x1 = (starts[k + 1][0] if k + 1 < len(starts) else n) - 0.5
        if x0 > 0:
            ax.axvline(x0 - 0.5, color="0.9", lw=0.5, zorder=0)
        if phase in _PHASE_SHADE:
            ax.axvspan(x0 - 0.5, x1, color=_PHASE_SHADE[phase], zorder=0, lw=0, gid=f"phase:{phase}",
                       label=None if phase in seen else f"{phase} frames")
            seen.add(phase)
        if (batch_start and x0 > 0) or (k == 0 and any(s[3] for s in starts[1:])):
            if x0 > 0:
                ax.axvline(x0 - 0.5, color="0.3", lw=1, ls=":", zorder=1, gid="batch_start")
            ax.annotate(f"batch {batch}", xy=(x0 - 0.5, 0.015), xycoords=("data", "axes fraction"),
                        xytext=(3, 0), textcoords="offset points", fontsize=8, color="0.3")
