"""Events to and from the JSON lines event log (one object per line; fields: docs/reference/events.md)."""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..core.events import (
    AbortAfterBatchEvent,
    BatchTraceEvent,
    Event,
    Placed,
    NonFiniteEvent,
    OverflowCheckEvent,
    SamplingRateEvent,
    SkippedNonFiniteStepEvent,
    SkippedStepEvent,
    SkipStreakEvent,
    StoppedByRankEvent,
)
from ..core.frame_stats import (
    Frame,
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


def rfc3339(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).isoformat(timespec="microseconds").replace(
        "+00:00", "Z")


def _tensor(t: TensorStat) -> Dict[str, Any]:
    d: Dict[str, Any] = {"name": t.name, "abs_min": _num(t.abs_min), "abs_max": _num(t.abs_max), "dtype": t.dtype}
    if t.note:
        d["note"] = t.note
    if t.underflow is not None:  # target_dtypes: dtype name -> share
        d["underflow"] = {k: _num(v) for k, v in t.underflow.items()}
    if t.overflow is not None:
        d["overflow"] = {k: _num(v) for k, v in t.overflow.items()}
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
    if isinstance(event, Placed):  # where the inf/nan is: the same four fields for every such event
        place = event.place
        d.update(module=place.module, module_class=place.module_class, tensor=place.tensor, kind=place.kind)
    if isinstance(event, NonFiniteEvent):
        d.update(frames=[_frame(f) for f in event.frames], first_rank=event.first_rank)
        if event.trace_id:
            d["trace_id"] = event.trace_id
        d["phase"] = event.phase
        if event.capture:
            d["capture"] = event.capture
        if event.reproduced is not None:
            d.update(reproduced=event.reproduced, host=event.host)
        if event.verdict is not None:
            d["verdict"] = event.verdict
        if event.uncertain is not None:
            d["uncertain"] = event.uncertain
    elif isinstance(event, StoppedByRankEvent):
        d.update(first_rank=event.first_rank, stopped_at_batch=event.stopped_at_batch)
    elif isinstance(event, SkippedStepEvent):
        d.update(streak=event.streak, scale=_num(event.scale))
    elif isinstance(event, SkipStreakEvent):
        d.update(streak=event.streak, scale=_num(event.scale))
    elif isinstance(event, SkippedNonFiniteStepEvent):
        d.update(streak=event.streak, phase=event.phase)
    elif isinstance(event, SamplingRateEvent):
        d.update(every_n_batches=event.every_n_batches, overhead=_num(event.overhead),
                 expected_overhead=_num(event.expected_overhead), max_overhead=event.max_overhead)
    elif isinstance(event, BatchTraceEvent):
        d["frames"] = [_frame(f) for f in event.frames]
    elif isinstance(event, OverflowCheckEvent):
        d.update(tensor=event.ctx, kind=event.kind,
                 frames=[{"module": "", "module_class": "", "tensors": [_tensor(event.stat)]}])
    return d


def to_line(event: Event) -> str:
    return json.dumps(to_dict(event), allow_nan=False, separators=(",", ":")) + "\n"


class LineError(ValueError):
    """One line of an event log that is no tensorwatch event (the message says why)."""


def _str(d: Dict[str, Any], key: str, default: str = "") -> str:
    v = d.get(key, default)
    if not isinstance(v, str):
        raise LineError(f"{key}: expected a string, got {v!r:.40}")
    return v


def _int(d: Dict[str, Any], key: str, default: Optional[int] = None) -> int:
    v = d.get(key, default)
    if v is None and default is None:
        raise LineError(f"no {key!r}")
    if isinstance(v, bool) or not isinstance(v, int):  # 1e999 reads as inf, 1.5 as a float
        raise LineError(f"{key}: expected an integer, got {v!r:.40}")
    return v


def _value(t: Dict[str, Any], key: str) -> Optional[float]:
    v = t.get(key)
    if v is None:
        return None
    if isinstance(v, str) and v in ("inf", "-inf", "nan"):
        return float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise LineError(f"{key}: expected a number, null, \"inf\", \"-inf\" or \"nan\", got {v!r:.40}")
    return float(v)


def _shares(t: Dict[str, Any], key: str) -> Optional[Dict[str, float]]:
    """A tensor's underflow/overflow object (dtype name -> share), or None when absent."""
    v = t.get(key)
    if v is None:
        return None
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise LineError(f"{key}: expected an object of dtype names to shares, got {v!r:.40}")
    return {k: _value(v, k) for k in v}


def _frame_from(d: Dict[str, Any], batch_number: int) -> Frame:
    if not isinstance(d, dict):
        raise LineError(f"malformed frames: a frame is not an object: {d!r:.40}")
    tensors = d.get("tensors", [])
    if not isinstance(tensors, list):
        raise LineError("malformed frames: tensors is not a list")
    stats = []
    for t in tensors:
        if not isinstance(t, dict) or "name" not in t:
            raise LineError(f"malformed frames: a tensor without a name: {t!r:.40}")
        stats.append(TensorStat(_str(t, "name"), _value(t, "abs_min"), _value(t, "abs_max"), _str(t, "dtype"),
                                _str(t, "note"), None, _shares(t, "underflow"), _shares(t, "overflow")))
    return Frame(_str(d, "module"), _str(d, "module_class"), tuple(stats), _int(d, "batch_number", batch_number),
                 batch_start=bool(d.get("batch_start", False)), phase=_str(d, "phase", "forward"))


#: The event types this version reads; a well-formed line of another type (written by a newer
#: version) is an UnknownEvent line, skipped with a note rather than an error.
EVENT_TYPES = ("nonfinite_detected", "batch_trace", "abort_after_batch", "overflow_check", "stopped_by_rank",
               "optimizer_step_skipped", "skipped_steps_streak", "skipped_nonfinite_step", "sampling_rate")


class UnknownEvent(ValueError):
    """A well-formed event line of a type this version does not read."""

    def __init__(self, kind: str):
        super().__init__(f"event type {kind!r} is not one this version reads")
        self.kind = kind


def from_dict(d: Dict[str, Any]) -> Event:
    """An event from one parsed line; LineError for anything that is not one, UnknownEvent
    (also a ValueError) for a well-formed line of a type this version does not read."""
    if not isinstance(d, dict):
        raise LineError(f"not a tensorwatch event: a JSON {type(d).__name__}, not an object")
    if "event" not in d:
        raise LineError("not a tensorwatch event: no 'event'")
    try:
        kind = _str(d, "event")
        b = _int(d, "batch_number")
        rank = _int(d, "rank", 0)
        ts = _dt.datetime.fromisoformat(_str(d, "time").replace("Z", "+00:00")).timestamp()
    except (LineError, ValueError, OverflowError, OSError) as exc:
        raise LineError(f"not a tensorwatch event: {exc}") from None
    if kind not in EVENT_TYPES:
        raise UnknownEvent(kind)
    frames_in = d.get("frames", [])
    if not isinstance(frames_in, list):
        raise LineError("malformed frames: not a list")
    frames = tuple(_frame_from(f, b) for f in frames_in)
    if kind == "nonfinite_detected":
        return NonFiniteEvent(b, rank, _str(d, "module"), _str(d, "module_class"), _str(d, "tensor"),
                              _str(d, "kind"), frames, ts, first_rank=_opt_int(d.get("first_rank")),
                              trace_id=_str(d, "trace_id"),  # "": none in the log
                              phase=_str(d, "phase", "forward"), capture=_str(d, "capture") or None,
                              reproduced=_opt_bool(d.get("reproduced")), host=_str(d, "host") or None,
                              verdict=_str(d, "verdict") or None, uncertain=_str(d, "uncertain") or None)
    if kind == "stopped_by_rank":
        try:
            first = int(d["first_rank"])
        except (KeyError, TypeError, ValueError):
            raise LineError("stopped_by_rank without an integer first_rank") from None
        return StoppedByRankEvent(b, rank, first, _str(d, "module"), _str(d, "module_class"),
                                  _str(d, "tensor"), _str(d, "kind"), ts, _opt_int(d.get("stopped_at_batch")))
    if kind in ("optimizer_step_skipped", "skipped_steps_streak"):
        streak, scale = _int(d, "streak", 0), _value(d, "scale")
        if kind == "skipped_steps_streak":
            return SkipStreakEvent(b, rank, streak, scale, ts)
        return SkippedStepEvent(b, rank, streak, scale, _str(d, "module"), _str(d, "module_class"),
                                _str(d, "tensor"), _str(d, "kind"), ts)
    if kind == "skipped_nonfinite_step":
        return SkippedNonFiniteStepEvent(b, rank, _str(d, "module"), _str(d, "module_class"), _str(d, "tensor"),
                                         _str(d, "kind"), ts, _int(d, "streak", 1), _str(d, "phase", "backward"))
    if kind == "sampling_rate":
        return SamplingRateEvent(b, rank, _int(d, "every_n_batches"), _share(d, "overhead"),
                                 _share(d, "expected_overhead"), _share(d, "max_overhead"), ts)
    if kind == "batch_trace":
        return BatchTraceEvent(b, rank, frames, ts)
    if kind == "abort_after_batch":
        return AbortAfterBatchEvent(b, rank, ts)
    stat = frames[0].tensors[0] if frames and frames[0].tensors else TensorStat(_str(d, "tensor"), None, None)
    return OverflowCheckEvent(b, rank, _str(d, "tensor"), _str(d, "kind"), stat, ts)


def _share(d: Dict[str, Any], key: str) -> float:
    v = _value(d, key)
    if v is None:
        raise LineError(f"no {key!r}")
    return v


def _opt_bool(v) -> Optional[bool]:
    if v is None or isinstance(v, bool):
        return v
    raise LineError(f"not true/false: {v!r}")


def _opt_int(v) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise LineError(f"not an integer: {v!r}")
    return v


@dataclass
class EventLog:
    """What a JSON lines file holds: its events in file order, the well-formed lines of types
    this version does not read, and the lines that are no event at all (1-based numbers)."""

    path: str
    events: List[Event] = field(default_factory=list)
    unknown: List[Tuple[int, str]] = field(default_factory=list)  # (line, event type)
    invalid: List[Tuple[int, str]] = field(default_factory=list)  # (line, why)

    @property
    def is_event_log(self) -> bool:
        """False when the file has lines and none of them is a tensorwatch event."""
        return bool(self.events or self.unknown or not self.invalid)

    def notes(self, limit: int = 10) -> List[str]:
        """One line per problem for the user (stderr), at most `limit` invalid lines named."""
        out = []
        if self.invalid:
            n = len(self.invalid)
            nums = ", ".join(str(i) for i, _ in self.invalid[:20]) + (f" and {n - 20} more" if n > 20 else "")
            out.append(f"{self.path}: skipped {n} line{'s' if n > 1 else ''} that {'are' if n > 1 else 'is'} "
                       f"not a valid event: line{'s' if n > 1 else ''} {nums}")
            out.extend(f"  line {i}: {why}" for i, why in self.invalid[:limit])
        if self.unknown:
            by_kind: Dict[str, List[int]] = {}
            for i, kind in self.unknown:
                by_kind.setdefault(kind, []).append(i)
            kinds = "; ".join(f"{k} (line{'s' if len(v) > 1 else ''} {_numbers(v)})" for k, v in by_kind.items())
            out.append(f"{self.path}: skipped {len(self.unknown)} event{'s' if len(self.unknown) > 1 else ''} "
                       f"of types this version does not render: {kinds}")
        return out


def _numbers(nums: List[int]) -> str:
    return ", ".join(map(str, nums[:10])) + (f" and {len(nums) - 10} more" if len(nums) > 10 else "")


def _why(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply"
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON ({exc.msg} at column {exc.colno}; a line cut off when a run died?)"
    return str(exc)


def load_log(path: str) -> EventLog:
    """Every line of a JSON lines file, sorted into events, lines of unknown event types and
    invalid lines (a line cut off by a crash, a run that appended after it, anything else).
    OSError when the file cannot be read."""
    log = EventLog(path)
    with open(path, "rb") as f:
        raw = f.read()
    for n, bline in enumerate(raw.split(b"\n"), 1):
        try:
            line = bline.decode("utf-8")
        except UnicodeDecodeError:
            log.invalid.append((n, "not UTF-8 text"))
            continue
        if not line.strip():
            continue
        try:
            log.events.append(from_dict(json.loads(line)))
        except UnknownEvent as exc:
            log.unknown.append((n, exc.kind))
        except (ValueError, RecursionError) as exc:  # LineError, JSONDecodeError, deep nesting
            why = _why(exc)
            if _recover(log, n, line):
                why += "; the event a restarted run appended to it was read"
            log.invalid.append((n, why))
    return log


_LINE_START = '{"time":'  # every line to_line writes starts so


def _recover(log: EventLog, n: int, line: str) -> bool:
    """A line cut off by a crash runs into the first line a restarted run appended: read that
    one from where it starts. True when it was an event (of any type)."""
    start = line.find(_LINE_START, 1)
    if start < 0:
        return False
    try:
        log.events.append(from_dict(json.loads(line[start:])))
    except UnknownEvent as exc:
        log.unknown.append((n, exc.kind))
    except (ValueError, RecursionError):
        return False
    return True


def read_events(path: str) -> List[Event]:
    """The events of a JSON lines file, in order; lines that are not events of this version are
    left out (load_log says which). ValueError when the file has lines and none is an event."""
    log = load_log(path)
    if not log.is_event_log:
        n, why = log.invalid[0]
        raise ValueError(f"{path}:{n}: {why}")
    return log.events
