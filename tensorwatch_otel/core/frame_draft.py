"""What a frame is built from before it enters a record: the hooked module's ModuleInfo and the
FrameDraft of one module call (its items and statistics), with the Stat and Item types they hold."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch

from .measure.slot_buffer import SlotStat
from .naming import module_class_name

# a statistic (FrameDraft.stats): a 0-d device tensor, a float on the host already (the CPU
# kernel), or a device buffer's slot until the batch's read-back (core/measure/slot_buffer.py): a
# SlotStat, or a slot code (an int, SlotBuffer.take_one) of the record's one code buffer
Stat = Union[torch.Tensor, float, SlotStat, int]
# a frame item (FrameDraft.items): a measured tensor's name, or (name, note) for a value without statistics
Item = Union[str, Tuple[str, str]]


class ModuleInfo:
    """What a hook knows of its module: path, class name, the live parameter dict."""

    __slots__ = ("path", "cls", "params", "kw_names", "is_root", "recorded", "lent")

    def __init__(self, path: str, module: torch.nn.Module, is_root: bool, recorded: bool,
                 cls: Optional[str] = None, params: Optional[Dict[str, Optional[torch.nn.Parameter]]] = None):
        self.path = path
        self.cls = cls or module_class_name(module)
        # live dict: a replaced parameter is seen at once
        self.params = module._parameters if params is None else params
        self.kw_names: Dict[str, str] = {}
        self.is_root = is_root
        self.recorded = recorded
        self.lent = False  # accelerate lends the parameters per call (lend())

    def lend(self, params: Optional[Dict[str, Optional[torch.nn.Parameter]]] = None) -> None:
        """accelerate's offload lends this module its parameters for each call, new tensors each
        time (core/frames/offload.py): read them from `params` (what the module held during its call),
        else from the module as before, and measure them without caching (a cached one would
        keep the lent copy alive)."""
        if params is not None:
            self.params = params
        self.lent = True


class FrameDraft:
    """One frame being built: the record's write side. Whoever builds a frame (the recorder's
    hot path, the backward and optimizer recorders, the compiled sites) fills a draft and hands
    it to the record in one call, `Record.add_frame(info, draft)`; a frame that fails half-built
    is dropped with its draft and leaves nothing in the record.

    `items`: a tensor name (str) per measured tensor, or a (name, note) pair for a value
    without statistics; `stats`: two entries per measured tensor (abs min, abs max: 0-d device
    tensors, floats on the host, or a device buffer's SlotStat at both places); `dtypes`: one
    per measured tensor; with target_dtypes `counts` and `mags`: one per measured tensor (its
    counts row, its histogram row or None). `add` writes one tensor; the recorder's hot path
    writes the lists inline (a call per tensor is a cost there, docs/performance.md)."""

    __slots__ = ("items", "stats", "dtypes", "counts", "mags")

    def __init__(self) -> None:
        self.items: List[Item] = []
        self.stats: List[Stat] = []
        self.dtypes: List[torch.dtype] = []
        self.counts: List[Union[torch.Tensor, SlotStat, None]] = []
        self.mags: List[Optional[torch.Tensor]] = []

    def add(self, name: str, result: Union[str, Tuple[Stat, ...]], dtype: torch.dtype) -> bool:
        """One tensor: `result` is its (abs min, abs max) pair, or the note (a str) of a value
        without statistics. True when it was a pair."""
        if isinstance(result, str):
            self.items.append((name, result))
            return False
        self.stats += result
        self.dtypes.append(dtype)
        self.items.append(name)
        return True
