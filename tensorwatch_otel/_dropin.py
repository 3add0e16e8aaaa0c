"""Drop-in replacements for transformers.debug_utils: DebugUnderflowOverflow and detect_overflow.

Same arguments and report text as the peer, built on the watcher: statistics stay on the
device (one read-back per batch), hooks can be removed, the frame buffer stays bounded,
an inf seen while tracing does not abort the next batch, and the batch number is exact.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

import torch

from ._config import WatchConfig
from ._events import OverflowCheckEvent, TensorStat
from ._stats import dtype_name, measure
from ._watcher import _ACTIVE, Watcher, _env_sinks, current_rank


class DebugUnderflowOverflow:
    """Detects the first inf/nan in weights, inputs and outputs of every module of `model`,
    printing the frames that led to it and raising a ValueError; or traces the abs min/max of
    the batches in `trace_batch_nums` (0-indexed, detection off in those batches), and stops
    with a ValueError once batch `abort_after_batch_num` has finished.

    Unlike the peer, it can be removed: `detach()` (or use it as a context manager).
    """

    def __init__(self, model: torch.nn.Module, max_frames_to_save: int = 21,
                 trace_batch_nums: Optional[Iterable[int]] = None,
                 abort_after_batch_num: Optional[int] = None):
        from .sinks.text import TextReport

        config = WatchConfig.build(max_frames=max_frames_to_save, trace_batches=trace_batch_nums or (),
                                   abort_after_batch=abort_after_batch_num)
        self.model = model
        self.trace_batch_nums = list(trace_batch_nums or [])
        self.abort_after_batch_num = abort_after_batch_num
        sinks = [TextReport()] + _env_sinks()
        self._watcher = Watcher(model, sinks, config, owned_sinks=sinks, _compat=True)

    @property
    def batch_number(self) -> int:
        return self._watcher.batch_number

    def detach(self) -> None:
        """Remove every hook (idempotent)."""
        self._watcher.detach()

    def __enter__(self) -> "DebugUnderflowOverflow":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()


def detect_overflow(var: torch.Tensor, ctx: str) -> bool:
    """Print `{ctx} has nans` / `{ctx} has infs` and return True when `var` holds any.

    An explicit check of an intermediate tensor: it reads the answer back at once. Detections
    also go to the sinks of every active watcher (JSON lines, spans, metrics).
    """
    if not isinstance(var, torch.Tensor):
        raise ValueError(f"detect_overflow: expected a tensor for {ctx!r}, got {type(var).__name__}")
    has_nan = has_inf = False
    if var.is_floating_point() or var.is_complex():
        with torch.no_grad():
            flags = torch.stack([torch.isnan(var).any(), torch.isinf(var).any()]).tolist()
        has_nan, has_inf = bool(flags[0]), bool(flags[1])
    if has_nan:
        print(f"{ctx} has nans")
    if has_inf:
        print(f"{ctx} has infs")
    detected = has_nan or has_inf
    if detected and len(_ACTIVE):
        kind = ",".join(k for k, on in (("inf", has_inf), ("nan", has_nan)) if on)
        with torch.no_grad():
            r = measure(var)
        if isinstance(r, str):
            stat = TensorStat(ctx, None, None, dtype_name(var.dtype), r)
        else:
            mn, mx = torch.stack(list(r)).tolist()
            stat = TensorStat(ctx, mn, mx, dtype_name(var.dtype))
        for w in list(_ACTIVE):
            event = OverflowCheckEvent(w.batch_number, current_rank(), ctx, kind, stat, time.time())
            w._overflow_check(event)
    return detected
