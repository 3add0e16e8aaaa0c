"""The fused Triton kernel of the device path (core/device_stats.py); importing this module
imports Triton, so device_stats imports it only when a device first needs it. `build()` makes
the kernel: compiled for the GPU, or run by Triton's interpreter when TRITON_INTERPRET=1 (Triton
decides when the function is decorated)."""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl


def abs_minmax_slots(slots, xs, ns, first, programs, BLOCK: tl.constexpr):
    """Abs min and abs max of each tensor xs[i] (ns[i] elements) into slot first + i of `slots`:
    slots[2j] keeps 0x7FFFFFFF minus the smallest sign-cleared float32 pattern, slots[2j + 1]
    the largest, both by atomic max. Program p reads blocks p, p + programs, ... of every
    tensor. fp16 is converted to float32 (exact: every fp16 value is a float32 normal or zero),
    bf16 is widened on its bits (its subnormals stay subnormals), float32 is read as bits: no
    float arithmetic, so no flush to zero."""
    pid = tl.program_id(0)
    for i in tl.static_range(len(xs)):
        x = xs[i]
        n = ns[i]
        start = pid.to(tl.int64) * BLOCK
        if start < n:
            hi = tl.zeros([BLOCK], dtype=tl.int32)
            low = tl.zeros([BLOCK], dtype=tl.int32)  # 0x7FFFFFFF minus the smallest pattern
            for s in range(start, n, programs * BLOCK):
                offs = s + tl.arange(0, BLOCK)
                inside = offs < n
                v = tl.load(x + offs, mask=inside, other=0)
                if x.dtype.element_ty == tl.bfloat16:
                    bits = (v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << 16
                elif x.dtype.element_ty == tl.float16:
                    bits = v.to(tl.float32).to(tl.int32, bitcast=True)
                else:
                    bits = v.to(tl.int32, bitcast=True)
                bits = bits & 0x7FFFFFFF
                hi = tl.maximum(hi, tl.where(inside, bits, 0))
                low = tl.maximum(low, tl.where(inside, 0x7FFFFFFF - bits, 0))
            tl.atomic_max(slots + 2 * (first + i), tl.max(low, 0))
            tl.atomic_max(slots + 2 * (first + i) + 1, tl.max(hi, 0))


def build() -> Any:
    """The kernel, as Triton's current TRITON_INTERPRET says (a JITFunction, or its interpreter's
    twin). The first slot and the program count change from call to call: not specialised on
    their values (1, multiples of 16). Triton 3.9 still specialises the elements of a tuple (the
    sizes in `ns`), so variants are per tensor count, dtypes, pointer alignment and size class
    (1, multiple of 16, other); each is compiled once and cached on disk by Triton."""
    return triton.jit(do_not_specialize=["first", "programs"])(abs_minmax_slots)
