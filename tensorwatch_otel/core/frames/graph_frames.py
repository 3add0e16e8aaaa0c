"""One watcher's share of the in-graph statistics (core/measure/graph_stats.py): the row ids of its
submodules' hooks, where its last read of each device's table stopped, its recorded batch's
stamp, and each (module, layout)'s frame plan, made once.

A row id lives on its module's device (the rows are written there, in the graph); when the
model moves to another device, the ids move with it at the next recorded batch (the graphs
that held the old ones are traced again, once)."""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..measure import graph_sites, graph_stats
from . import transforms
from .op_spec import parsed_spec
from ..frame_stats import NOTE_EMPTY, NOTE_NO_DATA
from ..frame_draft import FrameDraft, Item, ModuleInfo
from ..record import Record

log = logging.getLogger(__name__)

# a frame plan: the module's info, its items (a name per measured value, (name, note) for the
# others) and the measured values' dtypes
Plan = Tuple[ModuleInfo, List[Item], List[torch.dtype]]


def _outside_transforms() -> "contextlib.AbstractContextManager[None]":
    """The calling thread's torch.func transforms set aside while the tables are read or stamped
    (they are not the transform's tensors); nothing to do outside a transform."""
    return transforms.set_aside() if transforms.active() else contextlib.nullcontext()


def _first_device(params: Dict[str, Optional[torch.nn.Parameter]]) -> Optional[torch.device]:
    for p in params.values():
        if p is not None:
            return p.device
    return None


class GraphFrames:
    """See the module docstring. `row_id(info)` gives a hook its row id; `begin()` starts a
    recorded batch; `frames(rec)` adds the rows written since the last read to `rec`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._infos: Dict[int, ModuleInfo] = {}  # row id -> the module it was given for
        self._holders: List[Tuple["weakref.ref[Any]", ModuleInfo]] = []  # (its hook, its module) per row id given
        self._cursor: Dict[torch.device, Tuple[graph_sites.Table, int]] = {}
        self._stamp = -1.0
        self._plans: Dict[Tuple[int, int], Optional[Plan]] = {}
        self._device: Optional[torch.device] = None  # the model's device when the ids were made
        self._said_lost = False
        self.read_rows = False  # some row of this watcher's was read (its compiled graphs write rows)

    @property
    def active(self) -> bool:
        """Some hook of this watcher has a row id."""
        return bool(self._infos)

    def _model_device(self) -> torch.device:
        t: Optional[torch.Tensor] = next(self._model.parameters(), None)
        if t is None:
            t = next(self._model.buffers(), None)
        return t.device if t is not None else torch.device("cpu")

    def _new_id(self, info: ModuleInfo) -> torch.Tensor:
        number, row_id = graph_stats.new_row_id(_first_device(info.params) or self._model_device())
        self._infos[number] = info
        return row_id

    def row_id(self, info: ModuleInfo, holder: Any) -> torch.Tensor:
        """A new row id for `holder`, the forward hook of `info`'s module."""
        if self._device is None:
            self._device = self._model_device()
        self._holders.append((weakref.ref(holder), info))
        return self._new_id(info)

    def begin(self) -> None:
        """A recorded batch begins: the rows written from now on (stamped) are its own. A model
        moved to another device since the ids were made gets them anew there first."""
        with _outside_transforms():  # (a call inside torch.func: the tables are not the transform's)
            device = self._model_device()
            if device != self._device:
                self._device = device
                self._infos.clear()
                for ref, info in self._holders:
                    holder = ref()
                    if holder is not None:
                        holder.rehome(self._new_id(info))
            self._stamp = graph_stats.begin_batch()

    def frames(self, rec: Record) -> None:
        """The frames of the rows this watcher's hooks wrote in the batch since the last read,
        in the order they ran, read with one copy per device: added to `rec`."""
        with _outside_transforms():
            rows, lost = graph_stats.ran(self._cursor, self._stamp, self._infos)
        if rows:
            self.read_rows = True
        if lost and not self._said_lost:
            self._said_lost = True
            log.warning("tensorwatch_otel: %d rows of in-graph statistics were written over before they were read "
                        "(more module calls between two reads than the table holds); their frames are missing "
                        "from this batch, and the table is grown; said once", lost)
        plans = self._plans
        for row_id, site, vals in rows:
            key = (row_id, site.number)
            plan = plans.get(key)
            if plan is None and key not in plans:
                plan = plans[key] = self._plan(self._infos.get(row_id), site)
            if plan is None:
                continue
            info, items, dtypes = plan
            d = FrameDraft()
            d.items = list(items)
            d.stats += vals  # (two per measured value, in the order of `items`)
            d.dtypes = list(dtypes)
            rec.add_frame(info, d)

    @staticmethod
    def _plan(info: Optional[ModuleInfo], site: graph_sites.Site) -> Optional[Plan]:
        """The frame of `site`'s rows for `info`'s module, made once (None: not recorded)."""
        if info is None or not info.recorded:
            return None
        items: List[Item] = []
        dtypes: List[torch.dtype] = []
        for name, kind, dt in site.layout(info.kw_names, parsed_spec):
            if kind == "m":
                items.append(name)
                dtypes.append(getattr(torch, dt))
            elif kind == "e":
                items.append((name, NOTE_EMPTY))
            elif kind == "x":
                items.append((name, NOTE_NO_DATA))
            else:
                items.append((name, kind))
        return info, items, dtypes
