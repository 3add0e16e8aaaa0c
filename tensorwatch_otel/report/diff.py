"""Aligns two traced batches frame by frame and finds the first module whose values moved.

Pure functions over Frames (no torch, no I/O); the `diff` command prints what they return.

The change of one statistic (abs min or abs max) from A to B is measured in decades,
``|log10(max(b, floor) / max(a, floor))|`` (1.0 = tenfold), with explicit rules for values
that are not finite: the same non-finite state on both sides (inf and inf, nan and nan) is no
change; a finite value on one side and inf or nan on the other (or inf against nan) is an
infinite change, so it always exceeds the threshold.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..core.frame_stats import Frame, TensorStat

STATS = ("max", "min", "both")
DEFAULT_THRESHOLD = 1.0  # decades: a tenfold change
DEFAULT_FLOOR = 1e-6  # values below it count as equal: abs min of 0 vs 1e-9 is no change


def _state(v: float) -> str:
    if v != v:
        return "nan"
    return "inf" if math.isinf(v) else ""


def change(a: Optional[float], b: Optional[float], floor: float = DEFAULT_FLOOR) -> Optional[float]:
    """Decades between a and b (see the module docstring); None when either is missing."""
    if a is None or b is None:
        return None
    sa, sb = _state(a), _state(b)
    if sa or sb:
        return 0.0 if sa == sb else math.inf
    a, b = abs(a), abs(b)
    return abs(math.log10(max(b, floor) / max(a, floor)))


@dataclass(frozen=True)
class TensorChange:
    """One tensor present in A, B or both, with the change of its abs min and abs max."""

    name: str
    a: Optional[TensorStat]
    b: Optional[TensorStat]
    min_change: Optional[float]
    max_change: Optional[float]
    score: Optional[float]  # the change judged against the threshold (per `stat`)


@dataclass(frozen=True)
class FramePair:
    """A frame of A and its counterpart in B; one side is None when the other has no match."""

    index_a: Optional[int]
    index_b: Optional[int]
    a: Optional[Frame]
    b: Optional[Frame]
    tensors: Tuple[TensorChange, ...]
    mismatch: str  # "" when both frames have the same module, class and tensors

    @property
    def module(self) -> str:
        return (self.a or self.b).module  # type: ignore[union-attr]

    @property
    def module_class(self) -> str:
        return (self.a or self.b).module_class  # type: ignore[union-attr]

    @property
    def score(self) -> Optional[float]:
        scores = [t.score for t in self.tensors if t.score is not None]
        return max(scores) if scores else None

    def over(self, threshold: float) -> List[TensorChange]:
        return [t for t in self.tensors if t.score is not None and t.score > threshold]


@dataclass(frozen=True)
class DiffResult:
    pairs: Tuple[FramePair, ...]  # in call order: A's frames, with B-only frames where they fall
    first: Optional[int]  # index in pairs of the first frame over the threshold
    threshold: float
    stat: str
    floor: float

    @property
    def mismatches(self) -> List[FramePair]:
        return [p for p in self.pairs if p.mismatch]

    @property
    def aligned(self) -> int:
        return sum(1 for p in self.pairs if p.a is not None and p.b is not None)

    def largest(self) -> Optional[Tuple[FramePair, TensorChange]]:
        """The pair and tensor with the largest change (the first of equals)."""
        best = None
        for p in self.pairs:
            for t in p.tensors:
                if t.score is not None and (best is None or t.score > best[1].score):
                    best = (p, t)
        return best

    @property
    def diverged(self) -> bool:
        return self.first is not None or bool(self.mismatches)


def _key(f: Frame) -> Tuple[str, str]:
    return (f.phase, f.module)


def _score(mn: Optional[float], mx: Optional[float], stat: str) -> Optional[float]:
    if stat == "max":
        return mx
    if stat == "min":
        return mn
    both = [c for c in (mn, mx) if c is not None]
    return max(both) if both else None


def _tensor_change(name: str, a: Optional[TensorStat], b: Optional[TensorStat], stat: str,
                   floor: float) -> TensorChange:
    if a is None or b is None:
        return TensorChange(name, a, b, None, None, None)
    mn = change(a.abs_min, b.abs_min, floor)
    mx = change(a.abs_max, b.abs_max, floor)
    return TensorChange(name, a, b, mn, mx, _score(mn, mx, stat))


def _named(tensors: Sequence[TensorStat]) -> Dict[Tuple[str, int], TensorStat]:
    seen: Dict[str, int] = {}
    out = {}
    for t in tensors:
        n = seen.get(t.name, 0)
        seen[t.name] = n + 1
        out[(t.name, n)] = t
    return out


def compare_frames(a: Frame, b: Frame, stat: str = "max", floor: float = DEFAULT_FLOOR,
                   index_a: Optional[int] = None, index_b: Optional[int] = None) -> FramePair:
    """Tensors matched by name (in A's order, then B's extra ones) and their changes."""
    ta, tb = _named(a.tensors), _named(b.tensors)
    keys = list(ta) + [k for k in tb if k not in ta]
    tensors = tuple(_tensor_change(k[0], ta.get(k), tb.get(k), stat, floor) for k in keys)
    problems = []
    if a.module_class != b.module_class:
        problems.append(f"class {a.module_class} in A, {b.module_class} in B")
    only_a = [k[0] for k in ta if k not in tb]
    only_b = [k[0] for k in tb if k not in ta]
    if only_a:
        problems.append(f"only in A: {', '.join(only_a)}")
    if only_b:
        problems.append(f"only in B: {', '.join(only_b)}")
    noted = [t.name for t in tensors if t.a is not None and t.b is not None
             and (t.a.abs_max is None) != (t.b.abs_max is None)]
    if noted:
        problems.append(f"statistics on one side only: {', '.join(noted)}")
    return FramePair(index_a, index_b, a, b, tensors, "; ".join(problems))


def _unmatched(frame: Frame, index: int, side: str) -> FramePair:
    tensors = tuple(TensorChange(t.name, t if side == "a" else None, t if side == "b" else None, None, None, None)
                    for t in frame.tensors)
    other = "B" if side == "a" else "A"
    if side == "a":
        return FramePair(index, None, frame, None, tensors, f"no counterpart in {other}")
    return FramePair(None, index, None, frame, tensors, f"no counterpart in {other}")


def align(frames_a: Sequence[Frame], frames_b: Sequence[Frame], stat: str = "max",
          floor: float = DEFAULT_FLOOR) -> List[FramePair]:
    """Pairs frames by module path and call order (the longest common sequence of module
    calls); calls present on one side only become unmatched pairs at their place."""
    ka = [_key(f) for f in frames_a]
    kb = [_key(f) for f in frames_b]
    pairs: List[FramePair] = []
    matcher = difflib.SequenceMatcher(None, ka, kb, autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "equal":
            for i, j in zip(range(a0, a1), range(b0, b1)):
                pairs.append(compare_frames(frames_a[i], frames_b[j], stat, floor, i, j))
            continue
        pairs.extend(_unmatched(frames_a[i], i, "a") for i in range(a0, a1))
        pairs.extend(_unmatched(frames_b[j], j, "b") for j in range(b0, b1))
    return pairs


def diff_frames(frames_a: Sequence[Frame], frames_b: Sequence[Frame], threshold: float = DEFAULT_THRESHOLD,
                stat: str = "max", floor: float = DEFAULT_FLOOR) -> DiffResult:
    """Aligns the two frame lists and finds the first frame with a change above `threshold`."""
    if stat not in STATS:
        raise ValueError(f"stat={stat!r}: expected one of {', '.join(STATS)}")
    if not threshold >= 0:
        raise ValueError(f"threshold={threshold!r}: expected a number of decades >= 0")
    if not floor > 0:
        raise ValueError(f"floor={floor!r}: expected a number > 0")
    pairs = align(frames_a, frames_b, stat, floor)
    first = next((n for n, p in enumerate(pairs) if p.over(threshold)), None)
    return DiffResult(tuple(pairs), first, threshold, stat, floor)


def first_nonfinite(frames: Sequence[Frame]) -> Optional[int]:
    """Index of the first frame holding inf/nan, or None."""
    return next((i for i, f in enumerate(frames) if f.kind), None)


# ------------------------------------------------------------------------------ rendering
_NUM_W = 9


def number_text(v: Optional[float]) -> str:
    if v is None:
        return ""
    return f"{v:.2e}" if math.isfinite(v) else str(v)


def _chg(v: Optional[float]) -> str:
    if v is None:
        return ""
    return "inf" if math.isinf(v) else f"{v:.2f}"


def _side(t: Optional[TensorStat]) -> str:
    if t is None:
        return f"{'-':>{_NUM_W}} {'-':>{_NUM_W}}"
    if t.abs_min is None or t.abs_max is None:
        return f"{t.note or 'no data':>{2 * _NUM_W + 1}}"
    return f"{number_text(t.abs_min):>{_NUM_W}} {number_text(t.abs_max):>{_NUM_W}}"


TABLE_HEADER = (f"{'frame':>7}  {'A abs min':>{_NUM_W}} {'A abs max':>{_NUM_W}}  {'B abs min':>{_NUM_W}} "
                f"{'B abs max':>{_NUM_W}}  {'change':>6}  metadata")


def render_pair(pair: FramePair, threshold: float, mark: bool = False) -> List[str]:
    """A frame of A and B side by side: a header line, then one line per tensor."""
    if pair.a is not None and pair.b is not None:
        where = f"{pair.index_a + 1}" if pair.index_a == pair.index_b else f"{pair.index_a + 1}|{pair.index_b + 1}"
    elif pair.a is not None:
        where = f"{pair.index_a + 1}|-"
    else:
        where = f"-|{pair.index_b + 1}"
    head = f"{'>> ' if mark else ''}{where:>{7 - (3 if mark else 0)}}"
    blank = " " * (4 * _NUM_W + 12)
    lines = [f"{head}  {blank}  {pair.module} {pair.module_class}".rstrip()]
    if pair.mismatch:
        lines.append(f"{'':7}  {'':{4 * _NUM_W + 12}}  ({pair.mismatch})")
    for t in pair.tensors:
        flag = "!" if t.score is not None and t.score > threshold else " "
        lines.append(f"{'':7}  {_side(t.a)}  {_side(t.b)}  {_chg(t.score):>6}{flag} {t.name}")
    return lines


def context_pairs(result: DiffResult, center: int, k: int) -> Tuple[int, int]:
    """The slice [lo, hi) of result.pairs showing k frames either side of `center`."""
    return max(0, center - k), min(len(result.pairs), center + k + 1)
