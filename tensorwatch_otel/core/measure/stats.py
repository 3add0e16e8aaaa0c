"""On-device statistics of one tensor: abs min and abs max, without a host sync.

The hot path calls `measure(t)`; odd tensors (meta, empty, sparse, quantized, fp8, complex,
bool, subclasses) are guarded here so the watcher never has to think about them.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from .cpu_kernel import CODES, KERNEL
from ..frame_stats import NOTE_EMPTY, NOTE_NO_DATA
from ..process import said_once

log = logging.getLogger(__name__)

Pair = Tuple[torch.Tensor, torch.Tensor]  # (abs_min, abs_max) as 0-d device tensors

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                         "float8_e8m0fnu") if hasattr(torch, n))
# abs(-128) does not fit in int8 (it stays -128), and the wide unsigned types have no CPU abs or
# aminmax kernels: widen these first. They are rare (ids and masks are int64 or bool).
_WIDEN = {**{d: torch.int64 for d in (torch.int8, torch.int16, torch.int32)},
          **{getattr(torch, n): torch.float64 for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)}}


def _finfo_max(dtype: torch.dtype) -> Optional[float]:
    if dtype.is_floating_point:
        return float(torch.finfo(dtype).max)
    return None


# largest finite value per dtype, for range_used (None for integer/bool dtypes)
DTYPE_MAX = {d: _finfo_max(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64) + _FP8}
@functools.lru_cache(maxsize=None)
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def values_of(t: torch.Tensor) -> Union[torch.Tensor, str, List[torch.Tensor]]:
    """The tensor whose abs min/max describe `t`, or a NOTE_* when there are none (a wrapper
    subclass without a dequantize method: the list of its inner tensors)."""
    if type(t) not in PLAIN_TYPES:
        u = _unwrap_subclass(t)
        if isinstance(u, (str, list)):
            return u
        t = u
    if t.is_meta:
        return NOTE_NO_DATA
    if t.layout is not torch.strided:
        if t.layout in (torch.sparse_coo,):
            vals = t.coalesce().values() if not t.is_coalesced() else t.values()
            if vals.numel() < t.numel():  # implicit zeros take part in abs min
                vals = torch.cat([vals.reshape(-1), vals.new_zeros(1)])
            t = vals
        elif t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
            return values_of(t.to_sparse_coo())
        else:
            return NOTE_NO_DATA
    if t.is_quantized:
        t = t.dequantize()
    if t.numel() == 0:
        return NOTE_EMPTY
    dt = t.dtype
    if dt is torch.bool:
        return t.view(torch.uint8)
    if dt in _FP8:
        return t.float()
    return t


# Wrapper subclasses (torchao's Float8Tensor, NF4Tensor...) hold their values in inner tensors
# (`__tensor_flatten__`): measured as the values they stand for when the class offers one of
# these methods (a full-precision copy, made on each measurement), else as their inner tensors.
_DEQUANTIZE = ("dequantize", "get_original_weight", "to_original_precision")


def _wrapper_values(t: torch.Tensor) -> Union[torch.Tensor, List[torch.Tensor], None]:
    """The dequantized value of a wrapper subclass, else the list of its inner tensors; None
    when `t` is not a wrapper subclass (no `__tensor_flatten__`)."""
    tp = type(t)
    if not hasattr(tp, "__tensor_flatten__"):
        return None
    for name in _DEQUANTIZE:
        method = getattr(tp, name, None)
        if method is None or method is getattr(torch.Tensor, name, None):
            continue
        try:
            v = getattr(t, name)()
        except Exception:  # another signature (NF4Tensor.dequantize is a static helper)
            continue
        if isinstance(v, torch.Tensor) and type(v) in PLAIN_TYPES:
            return v
    wrapper: Any = t  # a wrapper subclass (checked above): it has __tensor_flatten__
    names = wrapper.__tensor_flatten__()[0]
    inner = [getattr(t, n, None) for n in names]
    return [x for x in inner if isinstance(x, torch.Tensor)]


def _unwrap_subclass(t: torch.Tensor) -> Union[torch.Tensor, str, List[torch.Tensor]]:
    """A plain tensor with the same values, for tensor subclasses (a wrapper's inner tensors as a
    list when it cannot be dequantized); NOTE_NO_DATA if there is none."""
    to_local: Optional[Callable[[], torch.Tensor]] = getattr(t, "to_local", None)  # DTensor: the local shard
    try:
        if callable(to_local):
            return to_local()
        cls_name = type(t).__name__
        if cls_name in ("FakeTensor", "FunctionalTensor") or t.is_meta:
            return NOTE_NO_DATA
        wrapped = _wrapper_values(t)
        if wrapped is not None:
            if isinstance(wrapped, list):
                inner = [values_of(x) for x in wrapped]
                found = [x for x in inner if not isinstance(x, str)]
                flat = [y for x in found for y in (x if isinstance(x, list) else (x,))]
                return flat or NOTE_NO_DATA
            return wrapped
        with torch._C.DisableTorchFunctionSubclass():
            plain = t.as_subclass(torch.Tensor)
        if plain.untyped_storage().data_ptr() == 0 and plain.numel() > 0:
            return NOTE_NO_DATA  # wrapper subclass: the data lives elsewhere
        return plain
    except Exception as exc:  # any subclass may refuse; never break training for it
        return _cannot_read(t, exc)


def _cannot_read(t: torch.Tensor, exc: Exception) -> str:
    """NOTE_NO_DATA, with a warning logged once per tensor type."""
    key = type(t)
    if said_once(("cannot read", key)):
        log.warning("tensorwatch_otel: cannot read values of %s (%s); reported without statistics",
                    key.__name__, exc)
    return NOTE_NO_DATA


def measure(t: torch.Tensor) -> Union[Pair, str]:
    """(abs_min, abs_max) as device scalars, or a NOTE_* string. Call under no_grad.

    Both are exact element values (in the tensor's dtype, or float64 for integers). NaN
    anywhere makes both NaN and an infinity shows in abs_max, so detection needs nothing more
    (whether a NaN-holding tensor also held an infinity: nonfinite_kind_of, at a detection).
    A wrapper subclass is measured as its dequantized values, or over its inner tensors.
    """
    v = values_of(t) if (type(t) not in PLAIN_TYPES or t.layout is not torch.strided or t.is_meta
                       or t.numel() == 0 or t.dtype is torch.bool or t.dtype in _FP8 or t.is_quantized) else t
    if not isinstance(v, torch.Tensor):
        if isinstance(v, str):
            return v
        # a wrapper's inner tensors: the extremes over all of them
        pairs = [p for p in (measure(x) for x in v) if not isinstance(p, str)]
        if not pairs:
            return NOTE_NO_DATA
        mn, mx = pairs[0]
        for a, b in pairs[1:]:
            mn, mx = torch.minimum(mn, a), torch.maximum(mx, b)
        return mn, mx
    dt = v.dtype
    if dt in _FLOATS:
        dev = v.device.type
        if dev == "cpu":
            return _abs_minmax_cpu(v)
        if dev == "cuda":
            return _abs_minmax_device(v)
    if dt is torch.uint8:
        a = v
    else:
        wide = _WIDEN.get(dt)
        a = (v if wide is None else v.to(wide)).abs()  # complex: abs() is the magnitude
    try:
        mn, mx = torch.aminmax(a)
    except (RuntimeError, NotImplementedError) as exc:  # a layout without the kernel (nested...)
        return _cannot_read(t, exc)
    if not a.is_floating_point():
        # keep integers exact when stacked with float32 stats (float64 holds int up to 2**53)
        mn, mx = mn.double(), mx.double()
    return mn, mx


_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_CODES = CODES
_STRIDED = torch.strided
_INF = float("inf")
def host_readable(t: torch.Tensor) -> bool:
    """A tensor the CPU kernel reads as it is and the caches can key by version: dense,
    contiguous, non-empty, on the CPU, of a float dtype the kernel reads, not an inference
    tensor (no version counter). The caller checks its class (a plain tensor)."""
    return t.is_cpu and t.dtype in _CODES and t.layout is _STRIDED and t.is_contiguous() \
        and t.numel() > 0 and not t.is_inference()


def measure_host(t: torch.Tensor) -> Union[Pair, Tuple[float, float], str]:
    """`measure(t)`, except that a dense CPU float tensor read by the compiled kernel gives its
    two values as Python floats (on the host already: no 0-d tensors to make, stack and copy
    at the read-back). Same values, same NaN rule."""
    if t.__class__ in PLAIN_TYPES and t.dtype in _FLOATS and t.device.type == "cpu" and t.layout is torch.strided \
            and t.is_contiguous() and t.numel() > 0 and not t.is_meta:
        kernel = KERNEL.get()
        host: Optional[Callable[[torch.Tensor], Tuple[float, float]]] = getattr(kernel, "host", None)
        if host is not None:
            return host(t)
    return measure(t)


def _abs_minmax_device(v: torch.Tensor) -> Pair:
    """CUDA (and ROCm): two reads of `v` and no |x| temporary (no extra device memory, no write
    pass). The ±inf norms are max|x| and min|x| in v's dtype, with NaN-propagating max/min in
    the CUDA and HIP reduce kernels. On CPU the same ops are exact but not vectorised (far
    slower than a read: docs/performance.md), so CPU takes the chunked path below."""
    return torch.linalg.vector_norm(v, -_INF), torch.linalg.vector_norm(v, _INF)


# CPU without the kernel: |x| goes into a reused buffer, chunk by chunk, so no tensor-sized
# buffer is allocated (a fresh multi-MB allocation costs page faults). Chunks of 2**20 elements
# measured fastest; larger chunks are slower again as the buffer leaves the cache (the figures:
# docs/performance.md, "Measuring one CPU tensor").
# The extremes of |x| are then taken on its bits read as integers: abs() clears the sign bit
# (NaN's too, as IEEE 754 defines it), and with the sign bit clear the integer order of bit
# patterns is the order of magnitudes (subnormals, inf, and NaN above inf included). Integer
# aminmax skips the NaN bookkeeping of the float kernel, so it is faster (docs/performance.md).
# The patterns viewed back as floats are exact element values. Up to _SMALL elements, the
# fixed cost of those extra steps outweighs the saving: a fresh abs() and float aminmax.
_CHUNK = 1 << 20
_SMALL = 1 << 16
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float64: torch.int64}
_scratch = threading.local()


def in_memory_order(v: torch.Tensor) -> torch.Tensor:
    """`v` itself, or, when it is dense memory read in another order (transposed, permuted), a
    contiguous view of the same elements. Abs min and max do not depend on the order, and CPU
    aminmax would copy a non-contiguous tensor first (a tensor-sized allocation, many times the
    time of the read: docs/performance.md)."""
    order = sorted(range(v.dim()), key=v.stride, reverse=True)
    p = v.permute(order)
    return p if p.is_contiguous() else v


def _abs_minmax_cpu(v: torch.Tensor) -> Pair:
    """One read with the compiled kernel (core/measure/cpu_kernel.py) when the memory is dense, else
    the torch ops below."""
    if not v.is_contiguous():
        v = in_memory_order(v)
    if v.is_contiguous():
        kernel = KERNEL.get()
        if kernel is not None:
            return kernel(v)
    return abs_minmax_torch_cpu(v)


def abs_minmax_torch_cpu(v: torch.Tensor) -> Pair:
    if v.requires_grad:
        v = v.detach()
    if not v.is_contiguous():
        v = in_memory_order(v)
    n = v.numel()
    if n <= _SMALL:
        return torch.aminmax(v.abs())  # float aminmax: NaN anywhere gives NaN in both
    dt = v.dtype
    bits = _BITS[dt]
    if not v.is_contiguous():
        mn, mx = torch.aminmax(v.abs().view(bits))
    else:
        bufs = getattr(_scratch, "bufs", None)
        if bufs is None:
            bufs = _scratch.bufs = {}
        buf = bufs.get(dt)
        if buf is None:
            buf = bufs[dt] = torch.empty(_CHUNK, dtype=dt)
        flat = v.view(-1)
        if n <= _CHUNK:
            b = buf[:n]
            torch.abs(flat, out=b)
            mn, mx = torch.aminmax(b.view(bits))
        else:
            mins, maxs = [], []
            for i in range(0, n, _CHUNK):
                c = flat[i:i + _CHUNK]
                b = buf[:c.numel()]
                torch.abs(c, out=b)
                lo, hi = torch.aminmax(b.view(bits))
                mins.append(lo)
                maxs.append(hi)
            mn, mx = torch.stack(mins).min(), torch.stack(maxs).max()
    mx = mx.view(dt)  # a NaN's pattern is the largest: NaN anywhere is NaN here
    return torch.minimum(mn.view(dt), mx), mx  # and in abs min too (minimum propagates NaN)


def storage_freed(t: torch.Tensor) -> bool:
    """A plain tensor whose storage no longer holds its elements: FSDP2 frees an unsharded
    parameter's storage after its module ran, and reading it then would crash the process."""
    if type(t) not in PLAIN_TYPES or t.is_meta or t.layout is not torch.strided or t.numel() == 0:
        return False
    try:
        need = (t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
        return t.untyped_storage().nbytes() < need
    except Exception:  # no storage to ask (a functional tensor, a fake one): not ours to read
        return True


def nonfinite_kind_of(t: torch.Tensor) -> Optional[str]:
    """'inf', 'nan', 'inf,nan' or '' for what `t` holds, read now in one transfer (for a
    detection only, never in the hot path); None when its values cannot be read. The abs
    min/max say NaN for a tensor holding NaN whether or not it also holds an infinity."""
    if storage_freed(t):
        return None
    v = values_of(t)
    if isinstance(v, str):
        return None
    flags = [torch.stack([torch.isinf(x).any(), torch.isnan(x).any()])
             for x in (v if isinstance(v, list) else (v,)) if x.is_floating_point() or x.is_complex()]
    if not flags:
        return ""
    pairs = torch.stack([f.to(flags[0].device) for f in flags]).to("cpu", copy=True).tolist()
    has_inf, has_nan = any(p[0] for p in pairs), any(p[1] for p in pairs)
    return ",".join(k for k, on in (("inf", has_inf), ("nan", has_nan)) if on)
