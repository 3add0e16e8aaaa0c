"""Events to and from the JSON lines schema of CONTRACT.md (one object per line)."""

from __future__ import annotations

import datetime as _dt
import json
import math
from typing import Any, Dict, List, Optional

from ..core.events import (
    AbortAfterBatchEvent,
    BatchTraceEvent,
    Event,
    Frame,
    NonFiniteEvent,
    OverflowCheckEvent,
    SkippedStepEvent,
    SkipStreakEvent,
    TensorStat,
)


def _num(v: Optional[float]):
    if v is None:
        return None
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def _unnum(v) -> Optional[float]:
    if v is None:
        return None
    if isinstance(v, str):
        return float(v)  # "inf", "-inf", "nan"
    return float(v)


def rfc3339(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat(timespec="microseconds").replace(
        "+00:00", "Z")


def _tensor(t: TensorStat) -> Dict[str, Any]:
    d: Dict[str, Any] = {"name": t.name, "abs_min": _num(t.abs_min), "abs_max": _num(t.abs_max), "dtype": t.dtype}
    if t.note:
        d["note"] = t.note
    return d


def _frame(f: Frame) -> Dict[str, Any]:
    d: Dict[str, Any] = {"module": f.module, "module_class": f.module_class,
                         "tensors": [_tensor(t) for t in f.tensors]}
    if f.batch_start:
        d["batch_start"] = True
    if f.phase != "forward":
        d["phase"] = f.phase
    d["batch_number"] = f.batch_number
    return d


def to_dict(event: Event) -> Dict[str, Any]:
    d: Dict[str, Any] = {"time": rfc3339(event.time), "event": event.event,
                         "batch_number": event.batch_number, "rank": event.rank,
                         "module": "", "module_class": "", "tensor": "", "kind": "", "frames": []}
    if isinstance(event, NonFiniteEvent):
        d.update(module=event.module, module_class=event.module_class, tensor=event.tensor, kind=event.kind,
                 frames=[_frame(f) for f in event.frames])
        d["first_rank"] = event.rank if event.first_rank is None else event.first_rank
        if event.trace_id:
            d["trace_id"] = event.trace_id
    elif isinstance(event, SkippedStepEvent):
        d.update(module=event.module, module_class=event.module_class, tensor=event.tensor, kind=event.kind,
                 streak=event.streak, scale=_num(event.scale))
    elif isinstance(event, SkipStreakEvent):
        d.update(streak=event.streak, scale=_num(event.scale))
    elif isinstance(event, BatchTraceEvent):
        d["frames"] = [_frame(f) for f in event.frames]
    elif isinstance(event, OverflowCheckEvent):
        d.update(tensor=event.ctx, kind=event.kind,
                 frames=[{"module": "", "module_class": "", "tensors": [_tensor(event.stat)]}])
    return d


def to_line(event: Event) -> str:
    return json.dumps(to_dict(event), allow_nan=False, separators=(",", ":")) + "\n"


def _frame_from(d: Dict[str, Any], batch_number: int) -> Frame:
    tensors = tuple(TensorStat(t["name"], _unnum(t.get("abs_min")), _unnum(t.get("abs_max")), t.get("dtype", ""),
                               t.get("note", ""), None) for t in d.get("tensors", []))
    return Frame(d.get("module", ""), d.get("module_class", ""), tensors, d.get("batch_number", batch_number),
                 batch_start=bool(d.get("batch_start", False)), phase=d.get("phase", "forward"))


def from_dict(d: Dict[str, Any]) -> Event:
    """An event from one parsed line; ValueError for anything that is not one."""
    try:
        kind = d["event"]
        b = int(d["batch_number"])
        rank = int(d.get("rank", 0))
        ts = _dt.datetime.fromisoformat(d["time"].replace("Z", "+00:00")).timestamp()
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a tensorwatch event: {exc}") from None
    try:
        frames = tuple(_frame_from(f, b) for f in d.get("frames", []))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a malformed frame or tensor
        raise ValueError(f"malformed frames: {type(exc).__name__}: {exc}") from None
    if kind == "nonfinite_detected":
        first = d.get("first_rank")
        try:
            first = None if first is None else int(first)
        except (TypeError, ValueError):
            raise ValueError(f"malformed first_rank {first!r}") from None
        return NonFiniteEvent(b, rank, d.get("module", ""), d.get("module_class", ""), d.get("tensor", ""),
                              d.get("kind", ""), frames, ts, first_rank=first,
                              trace_id=str(d.get("trace_id") or ""))  # "": none in the log
    if kind in ("optimizer_step_skipped", "skipped_steps_streak"):
        try:
            streak, scale = int(d.get("streak", 0)), _unnum(d.get("scale"))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed {kind}: {exc}") from None
        if kind == "skipped_steps_streak":
            return SkipStreakEvent(b, rank, streak, scale, ts)
        return SkippedStepEvent(b, rank, streak, scale, d.get("module", ""), d.get("module_class", ""),
                                d.get("tensor", ""), d.get("kind", ""), ts)
    if kind == "batch_trace":
        return BatchTraceEvent(b, rank, frames, ts)
    if kind == "abort_after_batch":
        return AbortAfterBatchEvent(b, rank, ts)
    if kind == "overflow_check":
        stat = frames[0].tensors[0] if frames and frames[0].tensors else TensorStat(d.get("tensor", ""), None, None)
        return OverflowCheckEvent(b, rank, d.get("tensor", ""), d.get("kind", ""), stat, ts)
    raise ValueError(f"unknown event type {kind!r}")


def read_events(path: str) -> List[Event]:
    """Every event of a JSON lines file; a truncated last line (a crash mid-write) is skipped."""
    events: List[Event] = []
    with open(path, "r", encoding="utf-8") as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(from_dict(json.loads(line)))
        except (json.JSONDecodeError, ValueError) as exc:
            if n == len(lines) or (n == len(lines) - 1 and not lines[-1]):
                break  # the writer died mid-line; everything before it is intact
            raise ValueError(f"{path}:{n}: {exc}") from None
    return events
