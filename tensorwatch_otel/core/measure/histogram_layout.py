"""The bit layout of the float dtypes a magnitude histogram row follows (core/measure/magnitude.py
describes the row): shared by the torch ops and the CPU kernel's binding."""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _geometry(dtype: torch.dtype) -> Tuple[int, int, int]:
    """(mantissa bits, finite non-zero buckets NB, OFF) of a float dtype's bit layout."""
    fi = torch.finfo(dtype)
    mant = -round(math.log2(fi.eps))
    bias = 1 - round(math.log2(fi.smallest_normal))
    exp_bits = fi.bits - 1 - mant
    return mant, (1 << exp_bits) + mant - 1, -(bias + mant)


#: dtype -> (mantissa bits, NB, OFF)
GEOMETRY: Dict[torch.dtype, Tuple[int, int, int]] = {d: _geometry(d) for d in FLOATS}


def row_width(dtype: torch.dtype) -> int:
    """Counters in a histogram row of a tensor of `dtype` (zeros, NB buckets, inf/nan)."""
    return GEOMETRY[dtype][1] + 2


#: row width -> the dtype whose layout it has (the widths differ: 2101, 280, 264, 43)
ROW_DTYPE = {row_width(d): d for d in FLOATS}


def row_offset(dtype: torch.dtype) -> int:
    """The scale-0 bucket index of row[1] for `dtype`."""
    return GEOMETRY[dtype][2]
