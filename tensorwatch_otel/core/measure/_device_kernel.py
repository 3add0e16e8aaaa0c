"""The fused Triton kernels of the device path (core/measure/device_stats.py); importing this module
imports Triton, so core/measure/device_path.py imports it only when a device first needs it. `build()` makes
the kernels: compiled for the GPU, or run by Triton's interpreter when TRITON_INTERPRET=1 (Triton
decides when the function is decorated)."""

from __future__ import annotations

from typing import Any, Tuple

import triton
import triton.language as tl


@triton.jit
def sign_cleared_bits(v):
    """The sign-cleared float32 bit pattern of each element of `v` (float32, float16 or
    bfloat16), whose integer order is the order of the magnitudes: fp16 converted to float32
    (exact: every fp16 value is a float32 normal or zero), bf16 widened on its bits (its
    subnormals stay subnormals), float32 read as bits. No float arithmetic on the values, so
    nothing is flushed to zero. Both kernels read their tensors through it."""
    if v.dtype == tl.bfloat16:
        bits = (v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << 16
    elif v.dtype == tl.float16:
        bits = v.to(tl.float32).to(tl.int32, bitcast=True)
    else:
        bits = v.to(tl.int32, bitcast=True)
    return bits & 0x7FFFFFFF


def abs_minmax_slots(slots, xs, ns, first, programs, ranges, BLOCK: tl.constexpr, STRIDE: tl.constexpr,
                     RANGES: tl.constexpr, RANGES_P2: tl.constexpr):
    """Abs min and abs max of each tensor xs[i] (ns[i] elements) into the int32 words of
    `slots` from 2 * first + STRIDE * i: word 0 keeps 0x7FFFFFFF minus the smallest sign-cleared
    float32 pattern, word 1 the largest, both by atomic max. Program p reads blocks p,
    p + programs, ... of every tensor, each element as its sign-cleared pattern
    (sign_cleared_bits).

    With RANGES > 0 (target_dtypes, core/measure/magnitude.py) the same read also counts, for each
    range r < RANGES, the elements whose sign-cleared float32 pattern m has lo_r <= m <= hi_r,
    into word 2 + r by atomic add (integer compares only: nothing tensor-sized is made). The
    ranges are int32 (lo, hi) pairs, RANGES_P2 rows per input dtype (float32, float16,
    bfloat16 in that order; unused rows are (1, 0), which nothing falls in), already moved from
    the input dtype's patterns to the float32 patterns of the same values. A count wraps modulo
    2**32: the host reads it as unsigned."""
    pid = tl.program_id(0)
    for i in tl.static_range(len(xs)):
        x = xs[i]
        n = ns[i]
        base = 2 * first + STRIDE * i
        start = pid.to(tl.int64) * BLOCK
        if start < n:
            hi = tl.zeros([BLOCK], dtype=tl.int32)
            low = tl.zeros([BLOCK], dtype=tl.int32)  # 0x7FFFFFFF minus the smallest pattern
            if x.dtype.element_ty == tl.bfloat16:
                row = 2
            elif x.dtype.element_ty == tl.float16:
                row = 1
            else:
                row = 0
            if RANGES > 0:
                r = tl.arange(0, RANGES_P2)
                r_lo = tl.load(ranges + (row * RANGES_P2 + r) * 2)
                r_hi = tl.load(ranges + (row * RANGES_P2 + r) * 2 + 1)
                counts = tl.zeros([RANGES_P2], dtype=tl.int32)
            for s in range(start, n, programs * BLOCK):
                offs = s + tl.arange(0, BLOCK)
                inside = offs < n
                v = tl.load(x + offs, mask=inside, other=0)
                bits = sign_cleared_bits(v)
                hi = tl.maximum(hi, tl.where(inside, bits, 0))
                low = tl.maximum(low, tl.where(inside, 0x7FFFFFFF - bits, 0))
                if RANGES > 0:  # lanes past the end read 0, below every range (lo >= 1)
                    hit = (bits[None, :] >= r_lo[:, None]) & (bits[None, :] <= r_hi[:, None])
                    counts += tl.sum(hit.to(tl.int32), axis=1)
            tl.atomic_max(slots + base, tl.max(low, 0))
            tl.atomic_max(slots + base + 1, tl.max(hi, 0))
            if RANGES > 0:
                tl.atomic_add(slots + base + 2 + r, counts, mask=r < RANGES)


def scaled_underflow_slots(slots, xs, ns, first, programs, scaled, BLOCK: tl.constexpr, STRIDE: tl.constexpr,
                           COLUMN: tl.constexpr, SCALED: tl.constexpr, SCALED_P2: tl.constexpr):
    """The second pass of target_dtypes with 8-bit targets, launched after abs_minmax_slots on
    the same tensors and slots: a cast with per-tensor scaling flushes the elements whose
    float32(|x| * r) is at most Y, r = fmax * (1 / amax) in float64 (the torch ops' arithmetic,
    core/measure/magnitude.py counts_torch), and that threshold needs the tensor's abs max, which the
    first pass has written to word 1 of its slot. Every program finds, for each scaled target
    s, the largest float32 pattern U with pattern_value(U) * r <= bound_s by bisection on
    patterns (bound_s: the largest float64 whose float32 rounding is at most Y, so the compare
    is float64 only), then counts the elements with 1 <= m <= min(U, inf - 1) into word
    COLUMN + s by atomic add. `scaled` holds float64 (fmax, bound) pairs, SCALED_P2 rows (unused
    ones (1, -1): nothing counts). No count when the abs max is 0 or NaN; an infinite one gives
    r = 0 (every finite non-zero element), as the torch ops do."""
    pid = tl.program_id(0)
    s_idx = tl.arange(0, SCALED_P2)
    fmax = tl.load(scaled + 2 * s_idx)
    bound = tl.load(scaled + 2 * s_idx + 1)
    for i in tl.static_range(len(xs)):
        x = xs[i]
        n = ns[i]
        base = 2 * first + STRIDE * i
        start = pid.to(tl.int64) * BLOCK
        if start < n:
            top = tl.load(slots + base + 1)  # the abs max's pattern (the first pass is complete)
            finite = top < 0x7F800000
            valid = (top > 0) & (top <= 0x7F800000)
            amax = tl.where(finite & valid, top, 0x3F800000).to(tl.float32, bitcast=True).to(tl.float64)
            r = tl.where(finite, fmax * (1.0 / amax), 0.0)
            lo = tl.zeros([SCALED_P2], dtype=tl.int32)  # pattern_value(lo) * r <= bound (0 does)
            # ... and at up it does not (unless top does); a NaN abs max counts nothing (limit 0
            # below) and is bisected as inf, whose value is not read: no NaN arithmetic
            up = tl.zeros([SCALED_P2], dtype=tl.int32) + tl.minimum(top, 0x7F800000)
            top_value = tl.where(finite, top, 0).to(tl.float32, bitcast=True).to(tl.float64)
            top_in = finite & (top_value * r <= bound)
            for _ in range(31):
                mid = lo + (up - lo) // 2
                ok = mid.to(tl.float32, bitcast=True).to(tl.float64) * r <= bound
                lo = tl.where(ok, mid, lo)
                up = tl.where(ok, up, mid)
            limit = tl.where(top_in, top, lo)
            limit = tl.where(valid, tl.minimum(limit, 0x7F7FFFFF), 0)
            counts = tl.zeros([SCALED_P2], dtype=tl.int32)
            for s in range(start, n, programs * BLOCK):
                offs = s + tl.arange(0, BLOCK)
                v = tl.load(x + offs, mask=offs < n, other=0)
                bits = sign_cleared_bits(v)
                hit = (bits[None, :] >= 1) & (bits[None, :] <= limit[:, None])
                counts += tl.sum(hit.to(tl.int32), axis=1)
            tl.atomic_add(slots + base + COLUMN + s_idx, counts, mask=s_idx < SCALED)


def abs_minmax_table(slots, table, BLOCK: tl.constexpr):
    """Abs min and abs max of many tensors listed in `table`, as abs_minmax_slots writes them:
    entry i is four int64s (the tensor's address, its element count, its dtype code: 0
    float32, 1 float16, 2 bfloat16, and the index of its slot's first int32 word). The grid is
    (entries, programs per tensor): program (i, p) reads blocks p, p + programs, ... of tensor
    i. One launch for the tensors of many module calls (core/measure/slot_buffer.py defers them), with
    a signature that does not change with their number, dtypes or sizes: one compiled variant."""
    i = tl.program_id(0)
    p = tl.program_id(1)
    programs = tl.num_programs(1)
    addr = tl.load(table + 4 * i)
    n = tl.load(table + 4 * i + 1)
    code = tl.load(table + 4 * i + 2)
    base = tl.load(table + 4 * i + 3)
    hi = tl.zeros([BLOCK], dtype=tl.int32)
    low = tl.zeros([BLOCK], dtype=tl.int32)  # 0x7FFFFFFF minus the smallest pattern
    start = p.to(tl.int64) * BLOCK
    for s in range(start, n, programs * BLOCK):
        offs = s + tl.arange(0, BLOCK)
        inside = offs < n
        if code == 0:
            bits = sign_cleared_bits(tl.load(addr.to(tl.pointer_type(tl.float32)) + offs, mask=inside, other=0))
        elif code == 1:
            bits = sign_cleared_bits(tl.load(addr.to(tl.pointer_type(tl.float16)) + offs, mask=inside, other=0))
        else:
            bits = sign_cleared_bits(tl.load(addr.to(tl.pointer_type(tl.bfloat16)) + offs, mask=inside, other=0))
        hi = tl.maximum(hi, tl.where(inside, bits, 0))
        low = tl.maximum(low, tl.where(inside, 0x7FFFFFFF - bits, 0))
    if start < n:
        tl.atomic_max(slots + base, tl.max(low, 0))
        tl.atomic_max(slots + base + 1, tl.max(hi, 0))


def build() -> Tuple[Any, Any, Any]:
    """The three kernels (abs_minmax_slots, scaled_underflow_slots, abs_minmax_table), as
    Triton's current TRITON_INTERPRET says (JITFunctions, or their interpreter's twins). The first slot and the
    program count change from call to call: not specialised on their values (1, multiples of
    16). Triton 3.9 still specialises the elements of a tuple (the sizes in `ns`), so variants
    are per tensor count, dtypes, pointer alignment and size class (1, multiple of 16, other),
    and per counts layout (the constexprs); each is compiled once and cached on disk by
    Triton."""
    jit = triton.jit(do_not_specialize=["first", "programs"])
    return jit(abs_minmax_slots), jit(scaled_underflow_slots), triton.jit(abs_minmax_table)
