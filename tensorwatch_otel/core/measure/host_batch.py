"""Dense CPU float tensors gathered for one call of the CPU kernel (core/measure/cpu_kernel.py):
their addresses, sizes and dtype codes in flat arrays, measured together (`HostBatch.measure`).

The recorder gathers a module call's tensors here, the step guard its gradients; a tensor the
kernel cannot read as it is is left to core/measure/stats.py's `measure`.
"""

from __future__ import annotations

import array
import operator
from typing import List, Optional

import torch

from .cpu_kernel import CODES, KERNEL
from .stats import PLAIN_TYPES

_CODES = CODES
_STRIDED = torch.strided
# HostBatch.add_all: attribute reads mapped over a list (no bytecode per tensor)
_PLAIN_SET = frozenset(PLAIN_TYPES)
_STRIDED_SET = {torch.strided}
_class_of = operator.attrgetter("__class__")
_is_cpu = operator.attrgetter("is_cpu")
_layout_of = operator.attrgetter("layout")
_dtype_of = operator.attrgetter("dtype")
_contiguous = torch.Tensor.is_contiguous
_numel = torch.Tensor.numel
_data_ptr = torch.Tensor.data_ptr


class HostBatch:
    """Dense CPU float tensors gathered for one kernel call (`measure_many`): their addresses,
    sizes and dtype codes in flat arrays reused from call to call (no tensor is made)."""

    __slots__ = ("ptrs", "ns", "codes", "out")

    def __init__(self) -> None:
        self.ptrs = array.array("q")
        self.ns = array.array("q")
        self.codes = array.array("b")
        self.out = array.array("d")

    def add(self, t: torch.Tensor) -> bool:
        """Take `t` when the kernel can read it as it is (a dense CPU float tensor); False
        otherwise (measure it with `measure`)."""
        if t.__class__ not in PLAIN_TYPES or not t.is_cpu:  # (meta tensors are not is_cpu)
            return False
        code = _CODES.get(t.dtype)
        if code is None or t.layout is not _STRIDED or not t.is_contiguous():
            return False
        n = t.numel()
        if not n:
            return False
        self.ptrs.append(t.data_ptr())
        self.ns.append(n)
        self.codes.append(code)
        return True

    def add_all(self, ts: List[torch.Tensor]) -> bool:
        """Take every tensor of `ts` at once when the kernel can read each of them as it is
        (the `add` rule, checked over the whole list with no Python call per tensor: the cost
        of a step guard over thousands of gradients); False, and nothing taken, otherwise."""
        if not ts:
            return True
        try:
            if set(map(_class_of, ts)) - _PLAIN_SET or not all(map(_is_cpu, ts)) \
                    or set(map(_layout_of, ts)) != _STRIDED_SET or not all(map(_contiguous, ts)):
                return False
            codes = array.array("b", map(_CODES.__getitem__, map(_dtype_of, ts)))
        except (KeyError, RuntimeError):  # a dtype the kernel does not read; a layout without strides
            return False
        ns = array.array("q", map(_numel, ts))
        if 0 in ns:
            return False
        self.ptrs.extend(array.array("q", map(_data_ptr, ts)))
        self.ns.extend(ns)
        self.codes.extend(codes)
        return True

    def measure(self) -> Optional[array.array[float]]:
        """Abs min and abs max of every tensor added, as doubles (2 per tensor, in order), and
        the batch emptied; None when the kernel is not loaded (measure them with `measure`)."""
        k = len(self.ns)
        kernel = KERNEL.get()
        many = getattr(kernel, "host_many", None)
        if many is None:
            return None
        out = self.out
        if len(out) < 2 * k:
            out.extend([0.0] * (2 * k - len(out)))
        if k:
            many(self.ptrs.buffer_info()[0], self.ns.buffer_info()[0], self.codes.buffer_info()[0], k,
                 out.buffer_info()[0])
        del self.ptrs[:], self.ns[:], self.codes[:]
        return out[:2 * k]

    def clear(self) -> None:
        del self.ptrs[:], self.ns[:], self.codes[:]
