"""Precision headroom (target_dtypes): per measured tensor, exact counts of the elements a cast to
each target dtype would flush to zero or push past its range, taken in the call that gives the
tensor's abs min/max; and, on a cadence of watched batches, a power-of-two histogram of |x|.

Shares, for each target dtype T (largest finite value `fmax`), as fractions of the tensor's
non-zero finite elements (0.0 when it has none), from exact counts:
- 8-bit (and smaller) floats are cast with per-tensor current scaling: y = float32(|x| * (fmax /
  amax)), the product in float64 (amax: this batch's abs max of the tensor). underflow: y <= Y_T,
  Y_T the largest float32 torch's cast to T makes 0 (half T's smallest subnormal: round to
  nearest even sends it to 0). overflow: 0 by construction (the scaled abs max is fmax, up to
  rounding, which a cast rounds back to fmax). Both NaN when amax is inf/nan (no scale).
- wider floats are cast directly. underflow: the elements whose cast to T is 0 (|x| <= tiny/2);
  overflow: |x| > fmax.
Every threshold is a bit pattern of the input dtype D (Plan): with the sign bit cleared, integer
order is magnitude order, so each count is a range compare on the patterns (inf/nan, above the
inf pattern, and zeros, below 1, fall outside every range). A direct threshold is found once per
(D, T) by bisection over D's patterns with torch's own cast; a scaled one needs the abs max, so
the kernel bisects it after the read (the same float64 product and float32 rounding as above),
and the torch ops compare the scaled values themselves. The counts are exact for every element:
a share equals the share of elements `x.to(T)` (direct) or `(x.double() * (fmax / amax)).float()
.to(T)` (scaled) makes 0, resp. with |x| > fmax.

The histogram (a "row") of a tensor of dtype D has `row_width(D)` counters (core/measure/histogram_layout.py): row[0]
counts exact zeros; row[s], 1 <= s <= NB, counts finite |x| in (2**(s - 1 + OFF), 2**(s + OFF)] (upper-inclusive:
the OpenTelemetry exponential histogram's scale-0 bucket s - 1 + OFF, OFF = `histogram_layout.row_offset(D)`, the
bucket of D's smallest subnormal); row[NB + 1] counts inf/nan. It is taken only on the first
watched batch and every HISTOGRAM_EVERY-th after (counting it costs many times the abs min/max: one
increment per element; docs/performance.md); the shares never come from it. The CPU kernel
(core/measure/cpu_kernel.py) does both; elsewhere the torch ops below, with no host sync.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union, cast

import torch

from . import stats
from .cpu_kernel import KERNEL, MAX_RANGES
from .device_path import KERNEL_DTYPES
from .slot_words import CountLayout
from ..env import ConfigError
from .histogram_layout import FLOATS as _FLOATS, GEOMETRY as _GEOMETRY
from .histogram_layout import row_width as row_width  # a measured row's width, for callers
from ..frame_stats import Magnitude


def histogram_torch(v: torch.Tensor) -> torch.Tensor:
    """The row of a float tensor (float32/16, bfloat16, float64) with torch ops on its device:
    no host sync (scatter_add into a fixed range, no bincount). frexp gives |x| = m * 2**e with
    0.5 <= m < 1, so |x| lies in (2**(e-1), 2**e] unless m == 0.5 (|x| = 2**(e-1), the bucket
    below)."""
    dt = v.dtype
    _, nb, off = _GEOMETRY[dt]
    w = v.detach()
    if dt in (torch.float16, torch.bfloat16):
        w = w.float()  # exact, and frexp of every value of these (subnormals included) is right
    w = w.reshape(-1)
    m, e = torch.frexp(w)
    slot = e.to(torch.int64) - (m.abs() == 0.5).to(torch.int64) - off
    slot = torch.where(w == 0, 0, slot)
    slot = torch.where(torch.isfinite(w), slot, nb + 1)
    hist = torch.zeros(nb + 2, dtype=torch.int64, device=w.device)
    return hist.scatter_add_(0, slot, torch.ones(1, dtype=torch.int64, device=w.device).expand(slot.numel()))


# ---------------------------------------------------------------------------- target dtypes
def _parse_one(option: str, name: object) -> str:
    dt: object
    if isinstance(name, torch.dtype):
        dt = name
    elif isinstance(name, str):
        raw = name.strip()
        dt = getattr(torch, raw[len("torch."):] if raw.startswith("torch.") else raw, None)
    else:
        raise ConfigError(f"{option}: {name!r} is not a dtype name")
    valid = ", ".join(valid_targets())
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ConfigError(f"{option}: {name!r} is not a torch floating dtype name; expected one of {valid}")
    if _target(dt) is None:
        raise ConfigError(f"{option}: {name!r} has no zero or no finite range to cast to; expected one of {valid}")
    return str(dt).replace("torch.", "")


def parse_targets(option: str, value: Union[None, str, torch.dtype, Iterable[object]]) -> Tuple[str, ...]:
    """Normalized dtype names (`torch.half` -> "float16"), in order, without repeats; a
    ConfigError naming `option` (the argument or the variable) for a name that is not a torch
    floating dtype torch can describe (torch.finfo) with a zero to flush to."""
    if value is None:
        return ()
    items: List[object]
    if isinstance(value, (str, torch.dtype)):
        items = [value] if isinstance(value, torch.dtype) else [p for p in value.split(",") if p.strip()]
    else:
        try:
            items = list(value)
        except TypeError:
            raise ConfigError(f"{option}={value!r}: expected a list of torch dtype names") from None
    out: List[str] = []
    for n in items:
        name = _parse_one(option, n)
        if name not in out:
            out.append(name)
    return tuple(out)


def _target(dt: torch.dtype) -> Optional[Tuple[float, float, bool]]:
    """(log2 of half the smallest subnormal, fmax, scaled) of a target dtype, or None."""
    try:
        fi = torch.finfo(dt)
        tiny = float(fi.smallest_normal) * float(fi.eps)
        fmax = float(fi.max)
    except (TypeError, RuntimeError):
        return None
    if fi.eps >= 1 or not (0 < tiny < fmax < math.inf):  # float8_e8m0fnu: a scale format, no zero
        return None
    return math.log2(tiny) - 1, fmax, dt.itemsize <= 1


def valid_targets() -> List[str]:
    names = []
    for n in dir(torch):
        d = getattr(torch, n, None)
        if isinstance(d, torch.dtype) and d.is_floating_point and str(d) == f"torch.{n}" and _target(d):
            names.append(n)
    return sorted(names)


def target_params(names: Sequence[str]) -> List[Tuple[float, float, bool]]:
    return [_target_of(n) for n in names]


@functools.lru_cache(maxsize=None)
def _target_of(name: str) -> Tuple[float, float, bool]:
    # a valid target (parse_targets): not None
    return cast(Tuple[float, float, bool], _target(getattr(torch, name)))


# ---------------------------------------------------------------------------- thresholds
HISTOGRAM_EVERY = 16  # the Magnitude histogram on the first watched batch and every 16th after

_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
        torch.float64: torch.int64}
_INF_BITS = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80,
             torch.float64: 0x7FF0000000000000}


def _value(bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The one-element tensor of `dtype` whose bit pattern is `bits`."""
    return torch.tensor([bits], dtype=_INT[dtype]).view(dtype)


def _last(pred: Callable[[int], bool], hi: int) -> int:
    """The largest pattern u in [0, hi] with pred(u), pred monotone (true, then false) and
    pred(0) true."""
    lo = 0
    if pred(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


@functools.lru_cache(maxsize=None)
def flush_bits(src: torch.dtype, dst: torch.dtype) -> int:
    """The largest sign-cleared pattern of `src` whose value torch's cast to `dst` makes zero:
    found with torch's own casts (round to nearest even, whatever path the cast takes), so the
    count below it is exactly the elements that cast flushes."""
    return _last(lambda b: bool(_value(b, src).to(dst)[0] == 0), _INF_BITS[src] - 1)


def _float32_bits(bits: int, src: torch.dtype) -> int:
    """The float32 pattern of the value whose `src` pattern is `bits` (sign cleared)."""
    return int(_value(bits, src).float().view(torch.int32)[0])


@functools.lru_cache(maxsize=None)
def _rounds_to_at_most(y: float) -> float:
    """The largest float64 that torch's cast to float32 makes at most `y` (a float32 value >= 0)."""
    bits = _last(lambda b: float(_value(b, torch.float64).float()[0]) <= y, _INF_BITS[torch.float64] - 1)
    return float(_value(bits, torch.float64)[0])


@functools.lru_cache(maxsize=None)
def _at_most_bits(src: torch.dtype, limit: float) -> int:
    """The largest finite sign-cleared pattern of `src` whose value is <= `limit`."""
    return _last(lambda b: float(_value(b, src).double()[0]) <= limit, _INF_BITS[src] - 1)


class Plan:
    """The exact counts one measured tensor gives for a tuple of target dtypes: a row of int64
    counters, the same layout for every input dtype. Column 0: the non-zero finite elements;
    then per direct-cast target its underflow and overflow; then per scaled (8-bit) target its
    underflow. Per input dtype D the direct ones are ranges of D's sign-cleared bit patterns
    (a, w): a <= m < a + w (underflow: 1 <= m <= flush_bits(D, T); overflow: |x| > fmax up to
    inf); a scaled target's range needs this tensor's abs max: (Y, fmax), Y the largest float32
    a cast to T makes zero (the bound on x * fmax / amax, as float32)."""

    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)
        params = target_params(self.names)
        self.direct = [j for j, p in enumerate(params) if not p[2]]
        self.scaled = [j for j, p in enumerate(params) if p[2]]
        assert 1 + 2 * len(self.direct) <= MAX_RANGES and len(self.scaled) <= MAX_RANGES  # 8 valid targets
        self.width = 1 + 2 * len(self.direct) + len(self.scaled)
        self.under_col = [0] * len(params)
        self.over_col: List[Optional[int]] = [None] * len(params)
        for i, j in enumerate(self.direct):
            self.under_col[j], self.over_col[j] = 1 + 2 * i, 2 + 2 * i
        for i, j in enumerate(self.scaled):
            self.under_col[j] = 1 + 2 * len(self.direct) + i
        self.is_scaled = [p[2] for p in params]
        self.fmax = [p[1] for p in params]
        self.flush_y = [float(_value(flush_bits(torch.float32, getattr(torch, self.names[j])), torch.float32)[0])
                        for j in self.scaled]
        # scaled: (Y, fmax) pairs, float64, for the kernel
        self.scaled_args = torch.tensor([v for j, y in zip(self.scaled, self.flush_y) for v in (y, params[j][1])]
                                        or [0.0], dtype=torch.float64)
        self._ranges: Dict[torch.dtype, Tuple[List[Tuple[int, int]], torch.Tensor]] = {}
        self.kernel_args: Dict[torch.dtype, Tuple[int, int, int, int, int]] = {}
        self._device_layout: Optional[CountLayout] = None

    def device_layout(self) -> CountLayout:
        """The same counts for the device path's kernels (core/measure/slot_words.py's CountLayout), made once: each
        direct range of each kernel dtype D moved to the float32 patterns of the same values (the
        kernel widens D to float32 exactly, and the move keeps the order), and per scaled target
        (fmax, the largest float64 whose float32 rounding is at most Y) so that the kernel's
        float64 compare `|x| * r <= bound` is `float32(|x| * r) <= Y` exactly."""
        layout = self._device_layout
        if layout is None:
            ranges = {}
            for dt in KERNEL_DTYPES:
                pairs, _ = self.ranges(dt)
                ranges[dt] = [(_float32_bits(a, dt), _float32_bits(a + w - 1, dt)) if w > 0 else (1, 0)
                              for a, w in pairs]
            scaled = [(self.fmax[j], _rounds_to_at_most(y)) for j, y in zip(self.scaled, self.flush_y)]
            layout = self._device_layout = CountLayout(ranges, scaled)
        return layout

    def args(self, dtype: torch.dtype) -> Tuple[int, int, int, int, int]:
        """The counts kernel's arguments after the tensor for `dtype` (cached in kernel_args)."""
        _, rg = self.ranges(dtype)
        a = self.kernel_args[dtype] = (rg.data_ptr(), rg.numel() // 2, self.scaled_args.data_ptr(),
                                       len(self.scaled), self.width)
        return a

    def ranges(self, dtype: torch.dtype) -> Tuple[List[Tuple[int, int]], torch.Tensor]:
        """(the (a, w) ranges of `dtype`, the same as a flat tensor of its pattern width)."""
        r = self._ranges.get(dtype)
        if r is None:
            inf = _INF_BITS[dtype]
            pairs = [(1, inf - 1)]
            for j in self.direct:
                target = getattr(torch, self.names[j])
                u = flush_bits(dtype, target)
                o = _at_most_bits(dtype, self.fmax[j])
                pairs += [(1, u), (o + 1, inf - 1 - o)]
            flat = torch.tensor([v for p in pairs for v in p], dtype=_INT[dtype])
            r = self._ranges[dtype] = (pairs, flat)
        return r


@functools.lru_cache(maxsize=None)
def plan_for(names: Tuple[str, ...]) -> Plan:
    return Plan(names)


# ---------------------------------------------------------------------------- measuring
def counts_torch(v: torch.Tensor, amax: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The counts row of a float tensor (float32/16, bfloat16, float64) with torch ops on its
    device, no host sync: compares on its sign-cleared bit patterns (direct targets) and on
    float32(|x| * (fmax / amax)) (scaled targets: the same float64 product as the kernel's)."""
    dt = v.dtype
    w = v.detach().reshape(-1)
    bits = w.view(_INT[dt]) & (_INF_BITS[dt] | (_INF_BITS[dt] - 1))
    pairs, _ = plan.ranges(dt)
    ok = (bits >= 1) & (bits < _INF_BITS[dt])
    cols = [ok.sum()]
    for a, n in pairs[1:]:
        cols.append(((bits >= a) & (bits < a + n)).sum() if n > 0 else ok.new_zeros((), dtype=torch.int64))
    if plan.scaled:
        mag = w.abs().double()
        amax = amax.double()
        for j, y in zip(plan.scaled, plan.flush_y):
            cols.append((ok & ((mag * (plan.fmax[j] / amax)).float() <= y)).sum())
    return torch.stack(cols)


Quad = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]


def measure_counts(t: torch.Tensor, plan: Plan, histogram: bool) -> Union[Quad, str]:
    """`stats.measure(t)` plus the tensor's counts row and, when `histogram`, its histogram row
    (both None for tensors without float values: integer, bool, a wrapper's inner tensors), or
    a NOTE_* string. One call on CPU with the compiled kernel (a second for the histogram)."""
    if type(t) in stats.PLAIN_TYPES and t.layout is torch.strided and not t.is_meta and t.numel() > 0 \
            and t.dtype in _FLOATS and not t.is_quantized:
        v = t
        if v.device.type == "cpu":
            if not v.is_contiguous():
                v = stats.in_memory_order(v)
            if v.is_contiguous():
                kernel = KERNEL.get()
                fn = getattr(kernel, "counts", None)
                whole = getattr(kernel, "magnitude", None)  # loaded with counts
                if fn is not None and whole is not None:
                    args = plan.kernel_args.get(v.dtype) or plan.args(v.dtype)
                    mn, mx, row = fn(v, *args)
                    return mn, mx, row, (whole(v)[2] if histogram else None)
            mn, mx = stats.abs_minmax_torch_cpu(v)
            return mn, mx, counts_torch(v, mx, plan), (histogram_torch(v) if histogram else None)
        r = stats.measure(t)
        if isinstance(r, str):
            return r
        return r[0], r[1], counts_torch(t, r[1], plan), (histogram_torch(t) if histogram else None)
    r = stats.measure(t)
    if isinstance(r, str):
        return r
    vals = stats.values_of(t)
    if isinstance(vals, torch.Tensor) and vals.dtype in _FLOATS:
        return r[0], r[1], counts_torch(vals, r[1], plan), (histogram_torch(vals) if histogram else None)
    return r[0], r[1], None, None


# ---------------------------------------------------------------------------- shares
def shares(mat: torch.Tensor, amax: torch.Tensor, plan: Plan) -> Tuple[torch.Tensor, torch.Tensor]:
    """(underflow, overflow), each (n, len(targets)) float64, from n counts rows (float64, CPU)
    of tensors whose abs maxima are `amax` (n, float64): exact counts over the non-zero finite
    elements (0.0 when there are none); a scaled target's NaN when amax is inf/nan (no scale)."""
    n = mat.shape[0]
    total = mat[:, :1]
    denom = total.clamp(min=1)
    u = mat[:, plan.under_col] / denom
    over_cols = [c if c is not None else 0 for c in plan.over_col]
    o = torch.where(torch.tensor([c is None for c in plan.over_col]), torch.zeros(()), mat[:, over_cols] / denom)
    sc = torch.tensor(plan.is_scaled, dtype=torch.bool).unsqueeze(0).expand(n, -1)
    bad = sc & ~torch.isfinite(amax).unsqueeze(1) & (total > 0)
    nan = torch.full_like(u, math.nan)
    return torch.where(bad, nan, u), torch.where(bad, nan, o)


def magnitude_of(row: torch.Tensor, dtype: torch.dtype) -> Magnitude:
    """The Magnitude of one host row (a CPU tensor): zeros, and the non-empty span of buckets."""
    nb, off = _GEOMETRY[dtype][1], _GEOMETRY[dtype][2]
    body = row[1:nb + 1]
    nz = torch.nonzero(body).view(-1).tolist()
    zeros = int(row[0])
    if not nz:
        return Magnitude(zeros, 0, ())
    first, last = nz[0], nz[-1]
    return Magnitude(zeros, first + off, tuple(int(c) for c in body[first:last + 1].tolist()))
