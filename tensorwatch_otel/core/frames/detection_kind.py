"""The kind of a detection's tensor, its own rather than its frame's (`exact_kind`): the recorder
(core/frames/recorder.py) finds the tensor again in its caches."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..frame_stats import TensorStat
from ..record import Record
from ..measure.stats import nonfinite_kind_of


def exact_kind(rec: Record, fi: int, stat: Optional[TensorStat],
               measured: Callable[[Any], Optional[torch.Tensor]]) -> str:
    """The kind of the detection's tensor `stat` (frame `fi` of `rec`): its own, not its
    frame's ("inf" for an inf weight whose output went nan). Abs min/max show NaN for a
    tensor holding NaN whether or not it also holds an infinity, so a "nan" is checked on
    the tensor itself when it is still alive (weights always; activations of the batch
    while referenced; `measured(mn)`: the tensor whose measurement gave the abs min `mn`, when
    alive): "inf,nan" when it holds both."""
    if stat is None:
        return "nan"
    kind = stat.kind or "nan"
    if kind != "nan":
        return kind
    mn = rec.abs_min_entry(fi, stat.name)
    if mn is None:
        return kind
    t = measured(mn)
    if t is None:  # a weight read with the weight table (core/measure/weights.py): its module holds it
        w = rec.frame_info(fi).params.get(stat.name) if 0 <= fi < rec.frame_count else None
        t = w if isinstance(w, torch.Tensor) else None
    if t is None:
        return kind
    try:
        exact = nonfinite_kind_of(t)
    except Exception:  # reading it again must not hide the detection
        exact = None
    return exact or kind
