"""`tensorwatch-otel report`: renders a JSON lines event log as the text report (the same text
the TextReport sink prints while training)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Sequence

from ..report.codec import EVENT_TYPES
from . import events_per_batch, usage_error

HELP = "render a JSON lines event log as the text report"

DESCRIPTION = """\
Renders the events of a JSON lines log (written by the JsonlLog sink, TENSORWATCH_JSONL or
`tensorwatch-otel demo`) as the text report, in file order: each inf/nan detection as the
full report with its last frames, each traced batch as its frames, aborts,
detect_overflow() findings and ranks stopped by another rank's detection as one line each.
Lines that are no valid event (a line cut off when a process died mid-write, with or without a
restarted run appending after it) and events of types this version does not render are
skipped; stderr names each skipped line.

Exit status: 0 the file is an event log and every event that matched was rendered (also when
nothing matched, the file is empty or lines were skipped; notes go to stderr), 2 the file is
missing, unreadable, or none of its lines is an event (not an event log).

examples:
  tensorwatch-otel report tensorwatch-demo-events.jsonl
  tensorwatch-otel report events.jsonl --batch 150
  tensorwatch-otel report events.jsonl --event nonfinite_detected
  tensorwatch-otel report events.jsonl --batch 150 --plot overflow.png
"""

EXIT_OK = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("events", metavar="EVENTS.jsonl", help="the event log")
    parser.add_argument("--batch", type=int, action="append", metavar="N",
                        help="only events of batch N (repeat for several)")
    parser.add_argument("--event", choices=EVENT_TYPES, action="append", metavar="TYPE",
                        help=f"only events of this type (repeatable): {', '.join(EVENT_TYPES)}")
    parser.add_argument("--rank", type=int, action="append", metavar="R",
                        help="only events of global rank R (repeatable)")
    parser.add_argument("--plot", metavar="FILE", help=_plot_help())


def load_events(path: str, command: str = "report") -> list:
    """Every event of `path`, in file order. Lines that are no valid event (a line cut off by a
    crash, a run that appended after it) and well-formed events of types this version does not
    render are skipped, each named on stderr as `{command}: ...`. InputError (a one-line
    message) when the file cannot be read or none of its lines is an event.

    Every string of the events and of those notes is printable (report/_terminal.py): whatever
    the file holds, what the commands print from it is text, not terminal control sequences."""
    from ..report._terminal import printable, printable_event
    from ..report.codec import load_log

    try:
        log = load_log(path)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not an event log") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not log.is_event_log:
        n, why = log.invalid[0]
        more = f" (and {len(log.invalid) - 1} more lines like it)" if len(log.invalid) > 1 else ""
        raise InputError(printable(f"not a tensorwatch event log: {path}:{n}: {why}{more}"))
    for note in log.notes():
        print(f"{command}: {printable(note)}", file=sys.stderr)
    return [printable_event(e) for e in log.events]


def _plot_help() -> str:
    from ._plot import PLOT_HELP

    return PLOT_HELP + ". Draws the first inf/nan detection among the matching events, else the last traced batch."


class InputError(Exception):
    """A file or argument the command cannot use; the message is shown as is."""


def render_event(event) -> str:
    """The text for one event, as the TextReport sink and the peer print it ("" for a type
    without a text)."""
    render = _RENDER.get(event.event)
    return render(event) if render is not None else ""


def _detection(event) -> str:
    from ..report.text import render_detection
    return render_detection(event)


def _trace(event) -> str:
    from ..report.text import render_trace
    return render_trace(event)


def _stopped(event) -> str:
    from ..report.text import stopped_line
    return stopped_line(event)


def _skipped_nonfinite(event) -> str:
    from ..report.text import skipped_line
    return skipped_line(event)


def _abort(event) -> str:
    return f"aborting after batch_number={event.batch_number} (abort_after_batch)\n"


def _step_skipped(event) -> str:
    where = f": {event.kind} in {event.module or '(root)'} {event.tensor}" if event.tensor else ""
    scale = f", scale {event.scale:g}" if event.scale is not None else ""
    return (f"optimizer step skipped after batch_number={event.batch_number} "
            f"(rank {event.rank}, streak {event.streak}{scale}){where}\n")


def _sampling_rate(event) -> str:
    return (f"measuring one batch in {event.every_n_batches} from batch_number={event.batch_number} "
            f"(rank {event.rank}; the watcher's share of the step {event.overhead:.2%}, now about "
            f"{event.expected_overhead:.2%}; max_overhead {event.max_overhead:g})\n")


def _streak(event) -> str:
    scale = f", scale {event.scale:g}" if event.scale is not None else ""
    return (f"{event.streak} optimizer steps in a row skipped by batch_number={event.batch_number} "
            f"(rank {event.rank}{scale})\n")


def _overflow_check(event) -> str:
    lines = []
    if "nan" in event.kind:
        lines.append(f"{event.ctx} has nans")
    if "inf" in event.kind:
        lines.append(f"{event.ctx} has infs")
    if not lines:
        lines.append(f"{event.ctx}: finite")
    return "".join(f"{line} (batch_number={event.batch_number})\n" for line in lines)


#: event type (the JSON lines "event") -> its text
_RENDER = {
    "nonfinite_detected": _detection,
    "batch_trace": _trace,
    "stopped_by_rank": _stopped,
    "abort_after_batch": _abort,
    "optimizer_step_skipped": _step_skipped,
    "skipped_nonfinite_step": _skipped_nonfinite,
    "sampling_rate": _sampling_rate,
    "skipped_steps_streak": _streak,
    "overflow_check": _overflow_check,
}


def select(events: Sequence, batches=None, types=None, ranks=None) -> List:
    return [e for e in events
            if (not batches or e.batch_number in batches)
            and (not types or e.event in types)
            and (not ranks or e.rank in ranks)]


def run(args) -> int:
    try:
        events = load_events(args.events)
    except InputError as exc:
        return usage_error("report", str(exc))
    chosen = select(events, args.batch, args.event, args.rank)
    if args.plot:  # before any text: a missing plot extra exits 2 with its one line and nothing else
        from ._plot import plot_report

        code = plot_report(args.plot, args.events, events, chosen)
        if code:
            return code
    out = sys.stdout
    for e in chosen:
        out.write(render_event(e))
    out.flush()
    if not events:
        print(f"report: {args.events} holds no events to render (a run without inf/nan and without traced "
              "batches writes none)", file=sys.stderr)
    elif not chosen:
        print(f"report: no event matches; events per batch in {args.events}: {events_per_batch(events)}",
              file=sys.stderr)
    return EXIT_OK
