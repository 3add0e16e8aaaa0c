"""Optimizer state as the watcher sees it (`optimizer_state=True`): after each optimizer step,
every state tensor (Adam's exp_avg and exp_avg_sq, any optimizer's tensors) is measured like a
weight, named `<param>.<key>` under the module that owns the parameter. A finite but huge
gradient can make exp_avg_sq inf while weights and activations stay finite: the parameter then
silently stops learning; this is where that shows. Owners come from the watcher's ParamIndex
(core/frames/attach.py), which follows parameters replaced after watch()."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..frame_draft import FrameDraft
from ..record import Record
from ..measure.stats import measure

if TYPE_CHECKING:
    from ..frames.param_index import ParamIndex


class OptimizerStateReader:
    def __init__(self, index: ParamIndex) -> None:
        self._owner = index.owner  # param -> (module info, parameter name) or None

    def record(self, optimizer: torch.optim.Optimizer, batch_number: int) -> Record:
        """One frame per parameter with state, in the optimizer's parameter order."""
        rec = Record(batch_number, phase="optimizer")
        state = optimizer.state
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    owner = self._owner(p)
                    st = state.get(p) if owner is not None else None
                    if owner is None or not st:
                        continue
                    info, pname = owner
                    d = FrameDraft()
                    for key, v in st.items():
                        # the step counter is a scalar, not a statistic of the parameter
                        if not isinstance(v, torch.Tensor) or v.numel() <= 1 or not v.is_floating_point():
                            continue
                        d.add(f"{pname}.{key}", measure(v), v.dtype)
                    if d.items:
                        rec.add_frame(info, d)
        return rec
