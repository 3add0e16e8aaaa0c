"""The device path's calls in a few lines (core/frames/recorder.py takes the rest): a module call of
one tensor in and one out whose tensors all take slot codes of one buffer's deferred table, and
whether a cached statistic is still usable (a value, or a slot code of a read still kept)."""

from __future__ import annotations

import weakref
from typing import List, Optional

import torch

from .. import naming
from ..frame_draft import Item, ModuleInfo, Stat
from ..record import Record
from ..measure.device_stats import DeviceStats
from ..measure.slot_words import FRESH_READS
from .frame_batch import ActsSeen, ParamsSeen, StatPair

INPUT0 = naming.input_name(0)


def device_call(device: Optional[DeviceStats], params_seen: ParamsSeen, acts_seen: ActsSeen, rec: Record,
                info: ModuleInfo, x: torch.Tensor, y: torch.Tensor) -> bool:
    """The recorder's `_one_in_one_out` on the device path: a module call of one tensor in and one out whose
    tensors all take one device buffer's deferred table (SlotBuffer.take_one: a slot code
    each), taken in a few lines with the caches and record of `_frame`. False for any other
    frame, and for one whose tensors must be measured at once (a module learnt or being
    learnt, inside a compiled graph): `_frame` takes it (the tensors taken here by then are
    in the caches)."""
    if device is None or y is x or info.lent:
        return False
    buf = device.one
    if buf is None:
        return False
    take = buf.take_one
    items: List[Item] = []
    stats: List[Stat] = []
    dtypes: List[torch.dtype] = []
    others = 0  # cached statistics that are not slot codes (taken by `_frame` earlier)
    for name, p in info.params.items():
        if p is None:
            continue
        seen = params_seen.get(id(p))
        version = p._version
        if seen is not None and seen[1] == version and seen[2] == p.data_ptr() and seen[3] is p.dtype \
                and (seen[4][0].__class__ is not int or seen[4][0] >> 32 > buf.epoch - FRESH_READS):
            r = seen[4]
            if r[0].__class__ is not int:
                others += 2
            dt = seen[3]
        else:
            code = take(p, info)
            if code is None:
                return False
            r = (code, code)
            dt = p.dtype
            params_seen[id(p)] = (p, version, p.data_ptr(), dt, r)
        stats += r
        dtypes.append(dt)
        items.append(name)
    for t, name in ((x, INPUT0), (y, "output")):
        seen_t = acts_seen.get(id(t))
        if seen_t is not None and seen_t[0]() is t and seen_t[1] == t._version \
                and (seen_t[2][0].__class__ is not int or seen_t[2][0] >> 32 > buf.epoch - FRESH_READS):
            r = seen_t[2]
            if r[0].__class__ is not int:
                others += 2
            dtypes.append(seen_t[3])
        else:
            if t.is_inference():
                return False
            code = take(t, info)
            if code is None:
                return False
            r = (code, code)
            dt = t.dtype
            acts_seen[id(t)] = (weakref.ref(t), t._version, r, dt)
            dtypes.append(dt)
        stats += r
        items.append(name)
    rec.add_lists(info, items, stats, dtypes, buf, others)
    return True


def usable(device: Optional[DeviceStats], rec: Record, r: StatPair) -> bool:
    """A cached pair `rec` can take: a value, or a slot code of a read still kept when `rec`
    reads back (SlotBuffer.decoded keeps KEPT_READS reads: check="module" reads after every
    frame), `rec` told which buffer its codes are of. A code too old is measured again."""
    code = r[0]
    if code.__class__ is not int:
        return True
    coder = device.coder if device is not None else None
    if coder is None or code >> 32 <= coder.epoch - FRESH_READS:
        return False
    rec.uses_codes(coder)
    return True
