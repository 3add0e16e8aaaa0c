"""Precision headroom (target_dtypes): a power-of-two histogram of |x| per measured tensor, taken
in the read that gives its abs min/max, and the underflow/overflow shares derived from it.

The histogram (a "row") of a tensor of dtype D has `row_width(D)` counters: row[0] counts exact
zeros; row[s], 1 <= s <= NB, counts finite |x| in (2**(s - 1 + OFF), 2**(s + OFF)] (upper-inclusive:
the OpenTelemetry exponential histogram's scale-0 bucket s - 1 + OFF, OFF = `row_offset(D)`, the
bucket of D's smallest subnormal); row[NB + 1] counts inf/nan (left out of every share). The CPU
kernel (core/cpu_kernel.py) fills it in the same read as the abs min/max; elsewhere the torch ops
below do, with no host sync.

Shares, for each target dtype T (largest finite value `fmax`, smallest subnormal `tiny`):
- 8-bit (and smaller) floats are cast with per-tensor current scaling: x * fmax / amax (amax: this
  batch's abs max of the tensor). underflow: |x| * fmax / amax <= tiny / 2 (round to nearest even:
  a value exactly half of `tiny` becomes 0). overflow: 0 by construction (the scaled abs max is
  fmax, up to rounding, which a cast rounds back to fmax). Both NaN when amax is inf/nan (no scale).
- wider floats are cast directly. underflow: |x| <= tiny / 2 (a power of two: a bucket edge, so the
  count is exact); overflow: |x| > fmax.
Each share is a fraction of the tensor's non-zero finite elements (0.0 when it has none). A count
against a threshold inside a bucket takes the buckets below it exactly and the threshold's bucket
in part, log-linearly (the share of the octave below the threshold): exact when that bucket is
empty or the threshold is its upper edge, otherwise off by at most that bucket's share.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import stats
from .cpu_kernel import KERNEL
from .env import ConfigError
from .events import Magnitude

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _geometry(dtype: torch.dtype) -> Tuple[int, int, int]:
    """(mantissa bits, finite non-zero buckets NB, OFF) of a float dtype's bit layout."""
    fi = torch.finfo(dtype)
    mant = -round(math.log2(fi.eps))
    bias = 1 - round(math.log2(fi.smallest_normal))
    exp_bits = fi.bits - 1 - mant
    return mant, (1 << exp_bits) + mant - 1, -(bias + mant)


_GEOMETRY = {d: _geometry(d) for d in _FLOATS}


def row_width(dtype: torch.dtype) -> int:
    """Counters in a histogram row of a tensor of `dtype` (zeros, NB buckets, inf/nan)."""
    return _GEOMETRY[dtype][1] + 2


#: row width -> the dtype whose layout it has (the widths differ: 2101, 280, 264, 43)
ROW_DTYPE = {row_width(d): d for d in _FLOATS}


def row_offset(dtype: torch.dtype) -> int:
    """The scale-0 bucket index of row[1] for `dtype`."""
    return _GEOMETRY[dtype][2]


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
def _parse_one(option: str, name) -> str:
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


def parse_targets(option: str, value) -> Tuple[str, ...]:
    """Normalized dtype names (`torch.half` -> "float16"), in order, without repeats; a
    ConfigError naming `option` (the argument or the variable) for a name that is not a torch
    floating dtype torch can describe (torch.finfo) with a zero to flush to."""
    if value is None:
        return ()
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


_TARGETS: Dict[str, Tuple[float, float, bool]] = {}


def target_params(names: Sequence[str]) -> List[Tuple[float, float, bool]]:
    out = []
    for n in names:
        p = _TARGETS.get(n)
        if p is None:
            p = _TARGETS[n] = _target(getattr(torch, n))
        out.append(p)
    return out


# ---------------------------------------------------------------------------- measuring
Triple = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def measure_magnitude(t: torch.Tensor) -> Union[Triple, str]:
    """`stats.measure(t)` plus the tensor's histogram row (None for tensors without float
    values: integer, bool, a wrapper's inner tensors), or a NOTE_* string. One read on CPU with
    the compiled kernel."""
    if type(t) in stats._PLAIN and t.layout is torch.strided and not t.is_meta and t.numel() > 0 \
            and t.dtype in _FLOATS and not t.is_quantized:
        v = t
        if v.device.type == "cpu":
            if not v.is_contiguous():
                v = stats._in_memory_order(v)
            if v.is_contiguous():
                kernel = KERNEL.get()
                both = getattr(kernel, "magnitude", None)
                if both is not None:
                    return both(v)
            mn, mx = stats._abs_minmax_torch_cpu(v)
            return mn, mx, histogram_torch(v)
        r = stats.measure(t)
        if isinstance(r, str):
            return r
        return r[0], r[1], histogram_torch(t)
    r = stats.measure(t)
    if isinstance(r, str):
        return r
    v = stats._values(t)
    hist = histogram_torch(v) if isinstance(v, torch.Tensor) and v.dtype in _FLOATS else None
    return r[0], r[1], hist


# ---------------------------------------------------------------------------- shares
def _counts_at_or_below(body: torch.Tensor, cum: torch.Tensor, off: int, t: torch.Tensor) -> torch.Tensor:
    """Count of |x| <= 2**t per row (t: (n, T) float64, log2 of the thresholds): buckets below
    exactly, the threshold's own bucket log-linearly."""
    nb = body.shape[1]
    i = torch.ceil(t) - 1  # the bucket (2**i, 2**(i+1)] holding the threshold
    frac = (t - i).clamp(0, 1)
    col = i - off
    inside = (col >= 0) & (col < nb)
    c = torch.nan_to_num(col, nan=0.0).clamp(0, nb - 1).to(torch.int64)
    below = torch.where(c >= 1, cum.gather(1, (c - 1).clamp(min=0)), torch.zeros_like(frac))
    part = below + frac * body.gather(1, c)
    total = cum[:, -1:].expand_as(part)
    return torch.where(inside, part, torch.where(col >= nb, total, torch.zeros_like(part)))


def shares(rows: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor,
           targets: Sequence[Tuple[float, float, bool]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(underflow, overflow), each (n, len(targets)) float64, for n rows (float64, CPU) of
    tensors of `dtype` whose abs maxima are `amax` (n, float64)."""
    nb, off = _GEOMETRY[dtype][1], _GEOMETRY[dtype][2]
    body = rows[:, 1:nb + 1]
    cum = body.cumsum(1)
    total = cum[:, -1:]
    n = rows.shape[0]
    log_amax = torch.log2(amax).unsqueeze(1)  # inf/nan amax: NaN shares for scaled targets
    t_under, t_over, scaled = [], [], []
    for half_tiny, fmax, sc in targets:
        lf = math.log2(fmax)
        t_under.append(half_tiny - lf if sc else half_tiny)
        t_over.append(lf)
        scaled.append(sc)
    sc = torch.tensor(scaled, dtype=torch.bool).unsqueeze(0).expand(n, -1)
    tu = torch.tensor(t_under, dtype=torch.float64).unsqueeze(0).expand(n, -1)
    tu = torch.where(sc, tu + log_amax, tu)
    to = torch.tensor(t_over, dtype=torch.float64).unsqueeze(0).expand(n, -1)
    under = _counts_at_or_below(body, cum, off, tu)
    over = total - _counts_at_or_below(body, cum, off, to)
    denom = total.clamp(min=1)
    u, o = under / denom, over / denom
    u = torch.where(total > 0, u, torch.zeros_like(u))
    o = torch.where(total > 0, o, torch.zeros_like(o))
    bad = sc & ~torch.isfinite(log_amax).expand(n, -1) & (total > 0)
    nan = torch.full_like(u, math.nan)
    o = torch.where(sc, torch.zeros_like(o), o)
    return torch.where(bad, nan, u.clamp(0, 1)), torch.where(bad, nan, o.clamp(0, 1))


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
