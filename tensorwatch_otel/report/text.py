"""The text report: the peer's (transformers.debug_utils) format, line for line.

Pure functions from events to text, shared by the TextReport sink, the span attribute and
the `report` command.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

from ..core.events import BatchTraceEvent, NonFiniteEvent, SkippedNonFiniteStepEvent, StoppedByRankEvent
from ..core.frame_stats import Frame, TensorStat

PREFIX = " " * 17
HEADER = f"{'abs min':8} {'abs max':8} metadata"


def batch_header(batch_number: int) -> str:
    return f"\n\n{PREFIX} *** Starting batch number={batch_number} ***\n{HEADER}"


def tensor_line(t: TensorStat) -> str:
    if t.note:
        return f"{t.note:>17} {t.name}"
    line = f"{t.abs_min:8.2e} {t.abs_max:8.2e} {t.name}"
    if t.underflow:  # target_dtypes
        line += precision_text(t)
    return line


def _share(v: Optional[float]) -> str:
    if v is None or v != v:
        return "n/a"
    return "0%" if v == 0 else f"{v * 100:.3g}%"


def precision_text(t: TensorStat) -> str:
    """`  underflow float16 25% float8_e4m3fn 33.3%  overflow float16 16.7%`: every target's
    underflow share, the overflow shares that are not 0."""
    under = " ".join(f"{k} {_share(v)}" for k, v in (t.underflow or {}).items())
    over = " ".join(f"{k} {_share(v)}" for k, v in (t.overflow or {}).items() if v != 0)
    return f"  underflow {under}" + (f"  overflow {over}" if over else "")


def frame_text(frame: Frame) -> str:
    lines: List[str] = []
    if frame.batch_start:
        lines.append(batch_header(frame.batch_number))
    lines.append(f"{PREFIX} {frame.module} {frame.module_class}")
    lines.extend(tensor_line(t) for t in frame.tensors)
    return "\n".join(lines)


def overflow_lines(frame: Frame) -> List[str]:
    """What the peer prints while analysing the frame that overflowed: `{ctx} has nans/infs`."""
    out = []
    for t in frame.tensors:
        kind = t.kind
        if "nan" in kind:
            out.append(f"{t.name} has nans")
        if "inf" in kind:
            out.append(f"{t.name} has infs")
    return out


def render_detection(event: NonFiniteEvent) -> str:
    """The detection report exactly as the peer prints it (each print() ends with a newline)."""
    return _detection_text(event, "\n".join(frame_text(f) for f in event.frames), len(event.frames), 0)


def render_detection_within(event: NonFiniteEvent, max_bytes: int) -> Tuple[str, int]:
    """The detection report in at most `max_bytes` (UTF-8): the frames nearest the detection
    that fit, and a line saying how many earlier ones were left out. (The text, the frames left
    out.) Where even the detection's own frame does not fit, its last `max_bytes`."""
    frames = event.frames
    used = _size(_detection_text(event, "", len(frames), len(frames)))  # the lines around the frames
    kept: List[str] = []
    for f in reversed(frames):
        text = frame_text(f)
        used += _size(text) + 1
        if used > max_bytes and kept:
            break
        kept.append(text)
    kept.reverse()
    left_out = len(frames) - len(kept)
    report = _detection_text(event, "\n".join(kept), len(kept), left_out)
    if _size(report) > max_bytes:
        report = report.encode("utf-8", "replace")[-max_bytes:].decode("utf-8", "ignore")
    return report, left_out


def _size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "replace"))


def _detection_text(event: NonFiniteEvent, frames_text: str, shown: int, left_out: int) -> str:
    parts = overflow_lines(event.frames[-1]) if event.frames else []
    parts.append(f"\nDetected inf/nan during batch_number={event.batch_number}")
    if left_out:
        parts.append(f"({left_out} earlier frames left out here to bound this report's size; the JSON lines "
                     "event log holds every frame)")
    parts += [
        f"Last {shown} {getattr(event, 'phase', 'forward') or 'forward'} frames:",
        HEADER,
        frames_text,
        "\n\n",
    ]
    return "".join(p + "\n" for p in parts)


def render_frames(frames: Iterable[Frame], overflow: Optional[Sequence[Sequence[str]]] = None) -> str:
    """Frames as the peer's trace mode prints them: per frame, the `{ctx} has nans/infs` lines its
    checks printed while the frame was built, then the frame (one print() each).

    `overflow` gives those lines per frame when the caller knows them exactly; by default they
    come from abs min/max, where a tensor holding NaN shows as `nan nan` and so only `has nans`
    (an inf beside the NaN cannot be seen in the two statistics).
    """
    frames = tuple(frames)
    if overflow is None or len(overflow) != len(frames):
        overflow = [overflow_lines(f) for f in frames]
    return "".join("".join(line + "\n" for line in lines) + frame_text(f) + "\n"
                   for f, lines in zip(frames, overflow))


def render_trace(event: BatchTraceEvent, overflow: Optional[Sequence[Sequence[str]]] = None) -> str:
    return render_frames(event.frames, overflow)


def summary_line(event: NonFiniteEvent) -> str:
    """One line for repeated detections after the first full report."""
    where = event.module or "(root)"
    return (f"tensorwatch_otel: {event.kind} in {where} {event.module_class} {event.tensor} "
            f"during batch_number={event.batch_number} (rank {event.rank})\n")


def stopped_line(event: StoppedByRankEvent) -> str:
    """One line for a rank stopped by another rank's detection (its report is on that rank)."""
    where = event.module or "(root)"
    at = "" if event.stopped_at_batch is None else f" at batch_number={event.stopped_at_batch}"
    return (f"tensorwatch_otel: rank {event.rank} stopped{at}: rank {event.first_rank} detected {event.kind} "
            f"in {where} {event.module_class} {event.tensor} during batch_number={event.batch_number}\n")


def skipped_line(event: SkippedNonFiniteStepEvent) -> str:
    """One line for an optimizer step on_detect="skip" did not let run."""
    if event.tensor or event.module:
        where = f"{event.kind} in {event.module or '(root)'} {event.module_class} {event.tensor}"
        where += " (the batch's forward)" if event.phase == "forward" else ""
    else:
        where = "inf/nan in another rank's shard of the gradients"
    return (f"tensorwatch_otel: optimizer step skipped for batch_number={event.batch_number} on rank "
            f"{event.rank}: {where} ({event.streak} in a row); weights and optimizer state unchanged\n")


def print_overflow_check(ctx: str, has_nan: bool, has_inf: bool) -> None:
    """detect_overflow's output, as the peer prints it (stdout, one line per kind)."""
    if has_nan:
        print(f"{ctx} has nans")
    if has_inf:
        print(f"{ctx} has infs")
