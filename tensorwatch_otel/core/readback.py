"""A record's statistics brought to the host: device buffer slots and slot codes resolved to their
values, and the underflow/overflow shares and histogram rows derived from the counts rows read
back with them (target_dtypes). Functions of what a Record (or its PrecisionRows) hands them;
those keep the state.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Set, Tuple, Union, cast

import torch

from .frame_draft import Stat
from .measure import magnitude as _mag
from .measure.slot_buffer import SlotBuffer, SlotStat
from .measure.histogram_layout import ROW_DTYPE

# PrecisionRows._rows: (host matrix, its row, dtype) of a measured tensor's histogram
Row = Tuple[torch.Tensor, int, torch.dtype]


def code_values(buf: SlotBuffer, pending: List[Stat], first: int, lost: Set[int]) -> List[Stat]:
    """`pending` (statistics from place `first` on) with each slot code of `buf` replaced by its
    value (the abs min at a tensor's even place, the abs max at its odd one; a lost one, 0.0, its
    tensor added to `lost`). Codes of the buffer's current read read it first (one copy), with the
    0-d tensors among `pending` on its device (integer tensors, float64, odd ones) in it."""
    out = list(pending)
    current = buf.epoch
    if any(s.__class__ is int and s >> 32 == current for s in out):
        zero_d = [i for i, s in enumerate(out) if s.__class__ is torch.Tensor]
        tensors = cast(List[torch.Tensor], [out[i] for i in zero_d])
        if zero_d and all(t.device == buf.device for t in tensors):
            for i, v in zip(zero_d, buf.read(torch.stack(tensors).reshape(-1).to(torch.float64))):
                out[i] = v
        else:
            buf.read()
    reads: Dict[int, Optional[Tuple[List[float], set[int]]]] = {}
    for i, code in enumerate(out):
        if not isinstance(code, int) or isinstance(code, bool):
            continue
        epoch, slot = code >> 32, code & 0xFFFFFFFF
        if epoch not in reads:
            d = buf.decoded(epoch)
            reads[epoch] = None if d is None else (d[0].tolist(), d[1])
        got = reads[epoch]
        if got is None or slot in got[1]:  # too old a read (never expected), or written in place
            out[i] = 0.0
            lost.add((first + i) // 2)
        else:
            out[i] = got[0][2 * slot + ((first + i) & 1)]
    return out


def slot_values(pending: List[Stat], first: int) -> List[Stat]:
    """`pending` (the statistics from place `first` on) with each SlotStat replaced by its
    value: the abs min at a tensor's even place, the abs max at its odd one. A device buffer
    holding a slot not read yet is read (one copy for all its slots); when it is the only
    one and the 0-d tensors among `pending` are on its device (integer tensors, float64,
    odd ones) they travel in that copy too."""
    out = list(pending)
    unread = {s.buffer for s in out if isinstance(s, SlotStat) and not s.read}
    others = [i for i, s in enumerate(out) if isinstance(s, torch.Tensor)]
    if len(unread) == 1 and others:
        buf = next(iter(unread))
        zero_d = cast(List[torch.Tensor], [out[i] for i in others])
        if all(t.device == buf.device for t in zero_d):
            for i, v in zip(others, buf.read(torch.stack(zero_d).to(torch.float64))):
                out[i] = v
    for i, s in enumerate(out):
        if isinstance(s, SlotStat):
            if not s.read:
                s.buffer.read()
            out[i] = s.hi if (first + i) & 1 else s.lo
    return out


def lose_changed(stats: List[Stat], pending: List[Stat], first: int, lost: Set[int]) -> None:
    """The tensors among `pending` (the record's `stats` from place `first` on, values now) whose
    SlotStat says `changed`: their values are lost, added to `lost` (0.0 placeholders)."""
    for i in range(0, len(pending) - (len(pending) & 1), 2):
        s = stats[first + i] if first + i < len(stats) else None
        if isinstance(s, SlotStat) and s.changed:
            lost.add((first + i) // 2)
            pending[i] = pending[i + 1] = 0.0


def shares_and_rows(plan: _mag.Plan, nt: int, counts: List[Union[torch.Tensor, SlotStat, None]],
                    mags: List[Optional[torch.Tensor]], flat: torch.Tensor,
                    values: List[float]) -> Tuple[List[Optional[Row]], List[float], List[float]]:
    """(histogram rows, underflow shares, overflow shares) of the measured tensors whose counts
    rows (and, on histogram batches, histogram rows) `flat` holds read back, in order: `nt`
    shares per tensor (NaN where none applies), a row per tensor or None; `values` are their abs
    min/max pairs read back."""
    idx = [i for i, c in enumerate(counts) if c is not None]
    width = plan.width
    mat = flat[:width * len(idx)].view(len(idx), width)
    under = [math.nan] * (len(counts) * nt) if len(idx) < len(counts) else [0.0] * (len(counts) * nt)
    over = list(under)
    if idx:
        amax = torch.tensor([values[2 * i + 1] for i in idx], dtype=torch.float64)
        ut, ot = _mag.shares(mat, amax, plan)
        u, o = ut.view(-1).tolist(), ot.view(-1).tolist()
        if len(idx) == len(counts):  # every tensor had float values: the rows in order
            under, over = u, o
        else:
            for r, i in enumerate(idx):
                under[i * nt:(i + 1) * nt] = u[r * nt:(r + 1) * nt]
                over[i * nt:(i + 1) * nt] = o[r * nt:(r + 1) * nt]
    # the histogram rows (histogram batches): rows of one width (the usual case: one float
    # dtype) are one matrix, no per-row slicing
    hist = flat[width * len(idx):]
    rows: List[Optional[Row]] = [None] * len(mags)
    if hist.numel() == 0:  # not a histogram batch
        return rows, under, over
    widths = [None if m is None else m.shape[0] for m in mags]
    groups: Dict[int, List[int]] = {}
    for i, w in enumerate(widths):
        if w is not None:
            groups.setdefault(w, []).append(i)
    if len(groups) == 1:
        (w, gi), = groups.items()
        mats = {w: hist[:w * len(gi)].view(len(gi), w)}
    else:
        starts, pos = [], 0
        for w in widths:
            starts.append(pos)
            pos += w or 0
        mats = {w: torch.stack([hist[starts[i]:starts[i] + w] for i in gi]) for w, gi in groups.items()}
    for w, gi in groups.items():
        dt = ROW_DTYPE[w]  # the measured values' dtype (an fp8 tensor is read as float32)
        for r, i in enumerate(gi):
            rows[i] = (mats[w], r, dt)
    return rows, under, over
