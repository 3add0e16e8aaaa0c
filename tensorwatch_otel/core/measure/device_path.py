"""Which devices take the device path of the statistics, and its fused Triton kernels, made once
per process: the process's two switches of the path (`set_mode`, `immediate`) and `kernel`.

The backend is chosen once per device: CUDA with Triton importable takes this path; a CPU takes
it only when forced (`set_mode("force")`, for tests and benchmarks, with TRITON_INTERPRET=1 set
before Triton is first imported: Triton's interpreter then runs the same kernel on CPU
tensors); `set_mode("off")` keeps every device on the routes of stats.py (benchmarks compare
the two). Everything else keeps the routes of stats.py. The recorder's use of the path is
device_stats.py; the buffer the kernels write is slot_buffer.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

log = logging.getLogger(__name__)

#: dtypes the kernel reads (each converted to float32 exactly); others go through stats.measure
KERNEL_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})

MODES = ("auto", "force", "off")


class _DevicePath:
    """The process's choice of devices (`mode`, see set_mode) and its kernels, made once each."""

    def __init__(self) -> None:
        self.mode = "auto"
        self.lock = threading.Lock()
        # interpreted? -> (the abs min/max kernel, the scaled-underflow kernel, the table kernel),
        # each launched as kernel[grid](...), or None
        self.kernels: Dict[bool, Optional[Tuple[Any, Any, Any]]] = {}


DEVICE_PATH = _DevicePath()


def set_mode(mode: str) -> None:
    """Which devices recorders made from now on measure on the device path: ``auto`` (CUDA with
    Triton), ``force`` (CPU tensors too, under Triton's interpreter: tests and benchmarks of the
    CUDA code on a machine without a GPU) or ``off`` (none). Not a user option."""
    if mode not in MODES:
        raise ValueError(f"device path mode {mode!r}: expected one of {', '.join(MODES)}")
    DEVICE_PATH.mode = mode


def force_on_cpu(on: bool) -> None:
    """`set_mode("force")` when `on`, else `set_mode("auto")`."""
    set_mode("force" if on else "auto")


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors): TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def kernel(interpreted: bool) -> Optional[Tuple[Any, Any, Any]]:
    """The Triton kernels (_device_kernel.build) for GPU tensors (`interpreted` False) or for CPU
    tensors under Triton's interpreter (True), made on first use; None when Triton cannot be
    imported, or when TRITON_INTERPRET says otherwise at that first use."""
    kernels = DEVICE_PATH.kernels
    if interpreted in kernels:
        return kernels[interpreted]
    if triton_interpreting() != interpreted:  # Triton would make the other kind now
        return None
    with DEVICE_PATH.lock:
        if interpreted not in kernels:
            k: Optional[Tuple[Any, Any, Any]] = None
            try:
                from . import _device_kernel
                k = _device_kernel.build()
            except Exception as exc:  # no Triton, or one that cannot build: the torch ops stay
                log.info("tensorwatch_otel: the fused device statistics kernel is not available (%s: %s); "
                         "device tensors are measured with torch ops", type(exc).__name__, exc)
            kernels[interpreted] = k
    return kernels[interpreted]


def wanted() -> bool:
    """Whether a new recorder takes the device path for some device: CUDA is available, or the
    path is forced on the CPU under Triton's interpreter (Triton itself is imported later, at
    the first buffer a device needs)."""
    mode = DEVICE_PATH.mode
    if mode == "force":
        return triton_interpreting()
    return mode == "auto" and torch.cuda.is_available()


class _Immediate(threading.local):
    """Depth of the calling thread's `immediate()` blocks."""

    def __init__(self) -> None:
        self.depth = 0


IMMEDIATE = _Immediate()


@contextlib.contextmanager
def immediate() -> Iterator[None]:
    """Frames recorded inside are measured at once, never deferred (core/frames/compiled.py's ops run
    the hooks inside a compiled graph, whose buffers inductor reuses without a version bump)."""
    IMMEDIATE.depth += 1
    try:
        yield
    finally:
        IMMEDIATE.depth -= 1
