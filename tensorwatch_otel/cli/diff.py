"""`tensorwatch-otel diff`: compares two traced batches frame by frame and names the first
module whose values moved by more than a threshold, with the frames around it side by side."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Optional, Tuple

from . import usage_error

HELP = "align two traced batches frame by frame and name the first module whose values diverge"

DESCRIPTION = """\
Loads two traced batches (batch_trace events, written when a batch is in
watch(..., trace_batches=[...]) or `demo --trace`) from JSON lines event logs, aligns their
frames by module path and call order, and compares each tensor's abs max (or abs min, see
--stat) between A and B.

  change = |log10(max(B, floor) / max(A, floor))|   in decades: 1.0 is tenfold

inf against inf or nan against nan is no change; a finite value against inf or nan (or inf
against nan) is an infinite change. The first frame (in call order) with a tensor whose
change exceeds --threshold is named, with --context frames either side shown side by side
(changes over the threshold are marked with '!'). Module calls present in only one batch,
or with other tensors, are listed as structural mismatches.

Exit status: 0 no divergence, 1 divergence found (a value over the threshold or a
structural mismatch), 2 usage or input error (missing file, batch not traced, ...).

examples:
  tensorwatch-otel diff events.jsonl:149 events.jsonl:150
  tensorwatch-otel diff good-run.jsonl:150 bad-run.jsonl:150 --threshold 0.5 --context 5
  tensorwatch-otel diff tensorwatch-demo-events.jsonl:11 tensorwatch-demo-events.jsonl:12
  tensorwatch-otel diff events.jsonl:149 events.jsonl:150 --plot diff.html
"""

EXIT_SAME = 0
EXIT_DIVERGED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..report.diff import DEFAULT_FLOOR, DEFAULT_THRESHOLD, STATS

    parser.add_argument("a", metavar="EVENTS_A.jsonl:BATCH", help="the reference batch (e.g. the last good one)")
    parser.add_argument("b", metavar="EVENTS_B.jsonl:BATCH", help="the batch to compare with it")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, metavar="X",
                        help=f"decades of change that count as divergence (default {DEFAULT_THRESHOLD:g}: tenfold)")
    parser.add_argument("--context", type=int, default=3, metavar="K",
                        help="frames shown either side of the first divergence (default 3)")
    parser.add_argument("--stat", choices=STATS, default="max",
                        help="statistic judged: abs max (default), abs min, or both. abs min of large "
                        "tensors jumps by decades from batch to batch, so it is a noisy signal")
    parser.add_argument("--floor", type=float, default=DEFAULT_FLOOR, metavar="F",
                        help=f"values below F count as F (default {DEFAULT_FLOOR:g})")
    parser.add_argument("--rank", type=int, default=None, metavar="R",
                        help="the rank to take when a log holds traces of several ranks")
    parser.add_argument("--plot", metavar="FILE", help=_plot_help())


def _plot_help() -> str:
    from ._plot import PLOT_HELP

    return PLOT_HELP + (". Draws both batches on their aligned frames and the change per tensor, the first "
                        "divergence marked.")


class _InputError(Exception):
    pass


def parse_spec(spec: str) -> Tuple[str, Optional[int]]:
    """'PATH:BATCH' -> (PATH, BATCH); 'PATH' -> (PATH, None)."""
    path, sep, batch = spec.rpartition(":")
    if sep and batch.strip().lstrip("-").isdigit() and path:
        n = int(batch)
        if n < 0:
            raise _InputError(f"{spec}: batch numbers start at 0")
        return path, n
    return spec, None


def load_trace(spec: str, rank: Optional[int]):
    """The BatchTraceEvent named by `spec` ('events.jsonl:150')."""
    from ..core.events import BatchTraceEvent
    from .report import InputError, load_events

    path, batch = parse_spec(spec)
    try:
        events = load_events(path, "diff")
    except InputError as exc:
        raise _InputError(str(exc)) from None
    traces = [e for e in events if isinstance(e, BatchTraceEvent) and (rank is None or e.rank == rank)]
    available = sorted({e.batch_number for e in traces})
    if batch is None:
        if len(available) == 1:
            batch = available[0]
        else:
            raise _InputError(f"{spec}: name the batch as {path}:BATCH; traced batches in it: "
                              f"{_listing(available)}")
    chosen = [e for e in traces if e.batch_number == batch]
    if not chosen:
        hint = ""
        if any(e.event == "nonfinite_detected" and e.batch_number == batch for e in events):
            hint = (f" (it holds the inf/nan detection of batch {batch}, whose report shows only the last "
                    "frames: `tensorwatch-otel report` renders it)")
        raise _InputError(f"{path}: batch {batch} was not traced{hint}; traced batches: {_listing(available)}. "
                          "Trace batches with watch(model, trace_batches=[...]) or `demo --trace`")
    ranks = sorted({e.rank for e in chosen})
    if len(ranks) > 1:
        raise _InputError(f"{path}: batch {batch} was traced on ranks {', '.join(map(str, ranks))}; "
                          "choose one with --rank")
    if len(chosen) > 1:
        print(f"diff: {path} holds {len(chosen)} traces of batch {batch} (the log was appended to by "
              "several runs); using the last", file=sys.stderr)
    return path, chosen[-1]


def _listing(batches) -> str:
    if not batches:
        return "none"
    shown = ", ".join(map(str, batches[:20]))
    return shown + (f" and {len(batches) - 20} more" if len(batches) > 20 else "")


def _fail(msg: str) -> int:
    return usage_error("diff", msg)


def run(args) -> int:
    from ..report.diff import diff_frames

    if not (args.threshold >= 0 and math.isfinite(args.threshold)):
        return _fail(f"--threshold {args.threshold}: expected a number of decades >= 0")
    if args.context < 0:
        return _fail(f"--context {args.context}: expected a number of frames >= 0")
    if not (args.floor > 0 and math.isfinite(args.floor)):
        return _fail(f"--floor {args.floor}: expected a positive number")
    try:
        path_a, ta = load_trace(args.a, args.rank)
        path_b, tb = load_trace(args.b, args.rank)
    except _InputError as exc:
        return _fail(str(exc))
    result = diff_frames(ta.frames, tb.frames, threshold=args.threshold, stat=args.stat, floor=args.floor)
    if args.plot:  # before any text: a missing plot extra exits 2 with its one line and nothing else
        from ._plot import plot_diff

        code = plot_diff(args.plot, result, (path_a, ta), (path_b, tb))
        if code:
            return code
    sys.stdout.write(render(result, (path_a, ta), (path_b, tb), args.context))
    sys.stdout.flush()
    return EXIT_DIVERGED if result.diverged else EXIT_SAME


def render(result, side_a, side_b, context: int) -> str:
    """The diff command's text output."""
    from ..report.diff import TABLE_HEADER, context_pairs, first_nonfinite, render_pair

    (path_a, ta), (path_b, tb) = side_a, side_b
    out = [f"A: {path_a} batch {ta.batch_number} (rank {ta.rank}): {len(ta.frames)} frames",
           f"B: {path_b} batch {tb.batch_number} (rank {tb.rank}): {len(tb.frames)} frames"]
    for name, trace in (("A", ta), ("B", tb)):
        bad = first_nonfinite(trace.frames)
        if bad is not None:
            f = trace.frames[bad]
            out.append(f"{name} holds {f.kind} from frame {bad + 1}: {f.module or '(root)'} {f.module_class} "
                       f"{f.first_nonfinite().name}")
    stat = {"max": "abs max", "min": "abs min", "both": "abs min and abs max"}[result.stat]
    out.append(f"change: |log10(B/A)| of {stat} in decades (values below {result.floor:g} count as "
               f"{result.floor:g}); threshold {result.threshold:g} (a factor of {10 ** result.threshold:.3g})")

    mism = result.mismatches
    if not mism:
        out.append(f"structure: the same {result.aligned} module calls in the same order")
    else:
        out.append(f"structure: {result.aligned} module calls aligned, {len(mism)} mismatched:")
        for p in mism[:10]:
            where = p.index_a + 1 if p.index_a is not None else p.index_b + 1
            side = "A" if p.index_a is not None else "B"
            out.append(f"  {side} frame {where}: {p.module or '(root)'} {p.module_class}: {p.mismatch}")
        if len(mism) > 10:
            out.append(f"  ... and {len(mism) - 10} more")

    pairs = result.pairs
    if result.first is None:
        best = result.largest()
        if best is None:
            out.append("\nno values to compare")
        else:
            p, t = best
            out.append(f"\nno divergence: no value moved by more than {result.threshold:g} decades; the largest "
                       f"change is {_fmt_change(t.score)} in {p.module or '(root)'} {p.module_class} {t.name}")
        center = None if not mism else pairs.index(mism[0])
    else:
        p = pairs[result.first]
        over = p.over(result.threshold)
        t = over[0]
        nth = (p.index_a if p.index_a is not None else p.index_b) + 1
        n_over = sum(1 for q in pairs if q.over(result.threshold))
        out.append(f"\nfirst divergence: {p.module or '(root)'} ({p.module_class}), frame {nth} of {len(ta.frames)}: "
                   f"{t.name} {_fmt_move(t, result.stat)} ({_fmt_change(t.score)})")
        if len(over) > 1:
            out.append(f"  also over the threshold in this frame: {', '.join(x.name for x in over[1:])}")
        out.append(f"  {n_over} of {len(pairs)} frames exceed the threshold")
        center = result.first
    if center is not None:
        lo, hi = context_pairs(result, center, context)
        out.append("")
        out.append(TABLE_HEADER)
        for n in range(lo, hi):
            out.extend(render_pair(pairs[n], result.threshold, mark=(n == center)))
    return "\n".join(out) + "\n"


def _fmt_change(v) -> str:
    if v is None:
        return "not comparable"
    return "an infinite change" if math.isinf(v) else f"{v:.2f} decades"


def _fmt_move(t, stat: str) -> str:
    from ..report.diff import number_text

    def pick(s):
        if stat == "min" or (stat == "both" and (t.min_change or 0) > (t.max_change or 0)):
            return "abs min", s.abs_min
        return "abs max", s.abs_max

    label, va = pick(t.a)
    _, vb = pick(t.b)
    return f"{label} {number_text(va)} -> {number_text(vb)}"
