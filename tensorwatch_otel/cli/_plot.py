"""`--plot FILE` of `report` and `diff`: which event to draw, where the picture goes, and the
one-line errors (a missing matplotlib extra, a file name or path that cannot be written)."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from . import events_per_batch, usage_error

PLOT_HELP = ("also draw the frames to FILE: a PNG, an SVG, or a self-contained HTML page when FILE ends in "
             ".html (needs the plot extra: pip install 'tensorwatch-otel[plot]')")
PLOTTABLE = ("nonfinite_detected", "batch_trace")


_fail = usage_error


def check(command: str, path: str) -> Optional[int]:
    """EXIT_USAGE with one line on stderr when `path` cannot be drawn to, else None. Runs before
    anything is read or printed, so a missing extra changes nothing else."""
    from ..report.plot import FORMATS, MissingExtra, require_matplotlib

    if os.path.splitext(path)[1].lower() not in FORMATS:
        return _fail(command, f"--plot {path}: expected a file name ending in .png, .svg or .html")
    try:
        require_matplotlib()
    except MissingExtra as exc:
        return _fail(command, f"--plot: {exc}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return _fail(command, f"--plot {path}: no such directory {folder}")
    return None


def _write(command: str, fig, path: str) -> Optional[int]:
    from ..report.plot import save

    try:
        save(fig, path)
    except OSError as exc:
        return _fail(command, f"--plot {path}: cannot write: {exc.strerror or exc}")
    return None


def choose(chosen: Sequence):
    """The event to draw among those the filters kept: the first inf/nan detection, else the
    last traced batch; None when there is neither."""
    detections = [e for e in chosen if e.event == "nonfinite_detected"]
    if detections:
        return detections[0]
    traces = [e for e in chosen if e.event == "batch_trace"]
    return traces[-1] if traces else None


def plot_report(path: str, log: str, events: Sequence, chosen: Sequence) -> int:
    """report --plot: draws one event of `chosen` to `path`; 0, or EXIT_USAGE with one line."""
    from ..report.plot import plot_event

    failed = check("report", path)
    if failed:
        return failed
    event = choose(chosen)
    if event is None:
        return _fail("report", f"--plot: no inf/nan detection or traced batch matches in {log}"
                     + (f"; events per batch: {events_per_batch(events)}" if events else " (it holds no events)"))
    failed = _write("report", plot_event(event), path)
    if failed:
        return failed
    what = f"{'the inf/nan detection' if event.event == 'nonfinite_detected' else 'the traced batch'} " \
           f"of batch {event.batch_number} (rank {event.rank})"
    others = [e for e in chosen if e is not event and e.event in PLOTTABLE]
    note = ""
    if others:
        listed = ", ".join(f"{e.event} {e.batch_number}" for e in others[:6]) + (" ..." if len(others) > 6 else "")
        note = f"; also matched: {listed} (choose one with --batch N and --event TYPE)"
    print(f"report: drew {what} to {path}{note}", file=sys.stderr)
    return 0


def plot_diff(path: str, result, side_a, side_b) -> int:
    """diff --plot: the two batches and the first divergence to `path`; 0 or EXIT_USAGE."""
    from ..report.plot import plot_diff as draw

    failed = check("diff", path) or _write("diff", draw(result, side_a, side_b), path)
    if failed:
        return failed
    print(f"diff: drew batches {side_a[1].batch_number} and {side_b[1].batch_number} to {path}", file=sys.stderr)
    return 0
