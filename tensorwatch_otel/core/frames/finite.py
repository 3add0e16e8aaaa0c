"""Whether a set of tensors holds inf/nan, in one host read: the gradients an optimizer step
will consume (core/steps/guard.py), the output of an unsampled batch's outermost call (core/batch/lifecycle.py),
looked into as far as a frame looks (core/frames/recorder.py's bounds).

Dense CPU float tensors go to the statistics kernel in one call (their values are on the host at
once: no read of their own); tensors on a device in `fused` get one inf-norm launch per device;
anything else is measured alone. One stack and one read then answer for all of them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import naming
from ..naming import MAX_DEPTH, MAX_ITEMS
from ..measure.host_batch import HostBatch
from ..measure.stats import measure

_INF = float("inf")
# dtypes one float32 inf-norm takes without narrowing (float64 would not fit: measured alone)
_FUSED_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))
# graph_tensors' walk (core/steps/poison.py): the tensors it looks at in all, and how deep
_GRAPH_TENSORS = 64
_GRAPH_DEPTH = 4


def _fusable(t: torch.Tensor, fused: Tuple[str, ...]) -> bool:
    """`t` goes into its device's one inf-norm launch (a DTensor's local shard goes through measure)."""
    return t.__class__ is torch.Tensor and t.device.type in fused and t.layout is torch.strided \
        and t.dtype in _FUSED_DTYPES


def all_finite(tensors: Sequence[torch.Tensor], fused: Tuple[str, ...]) -> bool:
    """True when no tensor of `tensors` holds inf or NaN. Call under no_grad."""
    tops: List[torch.Tensor] = []  # a 0-d tensor per tensor (or per device group): non-finite iff a bad value
    groups: Dict[torch.device, List[torch.Tensor]] = {}
    host = HostBatch()
    # the common CPU case, gathered with no Python per tensor; else one by one below
    gathered = "cpu" not in fused and host.add_all(list(tensors))
    for t in () if gathered else tensors:
        if _fusable(t, fused):
            groups.setdefault(t.device, []).append(t)
            continue
        if host.add(t):
            continue
        r = measure(t)
        if not isinstance(r, str):
            tops.append(r[1])  # abs max: inf or NaN when any element is
    if len(host.ns):
        values = host.measure()
        if values is None:  # the kernel is not loaded (yet): a read each
            return _all_finite_each(tensors, fused)
        if not math.isfinite(sum(values)):  # NaN or inf anywhere (abs values: no inf - inf)
            return False
    for group_tensors in groups.values():
        # max |x| of every tensor in one launch (NaN propagates), as float32
        tops.extend(torch._foreach_norm(group_tensors, _INF, dtype=torch.float32))
    return _tops_finite(tops)


def _tops_finite(tops: List[torch.Tensor]) -> bool:
    if not tops:
        return True
    try:
        return bool(torch.stack(tops).isfinite().all())
    except RuntimeError:  # tensors on several devices (a model split over GPUs): a read each
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for t in tops:
            by_device.setdefault(t.device, []).append(t)
        return all(bool(torch.stack(ts).isfinite().all()) for ts in by_device.values())


def _all_finite_each(tensors: Sequence[torch.Tensor], fused: Tuple[str, ...]) -> bool:
    """all_finite without the kernel: CPU tensors measured each, the rest fused as above."""
    tops: List[torch.Tensor] = []
    groups: Dict[torch.device, List[torch.Tensor]] = {}
    for t in tensors:
        if _fusable(t, fused):
            groups.setdefault(t.device, []).append(t)
            continue
        r = measure(t)
        if not isinstance(r, str):
            tops.append(r[1].to("cpu"))  # abs max
    for group_tensors in groups.values():
        tops.extend(t.to("cpu") for t in torch._foreach_norm(group_tensors, _INF, dtype=torch.float32))
    return _tops_finite(tops)


def output_tensors(output: Any) -> List[torch.Tensor]:
    """The floating tensors an unsampled batch's output check reads: the loss alone when the
    output carries one (a `loss` key or attribute, as transformers' ModelOutput has: computed
    from every logit the training uses, so a bad logit it leaves out can only show in the
    gradients, which the step guard reads), else every floating tensor of the output that a
    frame of it would measure (tensors, lists, tuples, mappings, dataclass fields and tensor
    attributes: MAX_ITEMS values of each container, MAX_DEPTH levels down, no cap on the whole)."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None) \
        if output.__class__ is not torch.Tensor else None
    if isinstance(loss, torch.Tensor) and (loss.is_floating_point() or loss.is_complex()):
        return [loss.detach()]
    found: List[torch.Tensor] = []
    _walk(output, found, 0, MAX_ITEMS, MAX_DEPTH, None)
    return [t.detach() for t in found]


def graph_tensors(output: Any) -> List[torch.Tensor]:
    """The floating tensors of an output that a backward can pass through (they require grad),
    as they are (not detached); a shorter walk (64 tensors in all, 4 levels down)."""
    found: List[torch.Tensor] = []
    _walk(output, found, 0, _GRAPH_TENSORS, _GRAPH_DEPTH, _GRAPH_TENSORS)
    return [t for t in found if t.requires_grad]


def _walk(v: Any, found: List[torch.Tensor], depth: int, items: int, max_depth: int, total: Optional[int]) -> None:
    """The floating tensors of `v` into `found`: `items` values of each container, containers
    `max_depth` levels down not looked into (a tensor there is taken), `total` tensors at most."""
    if total is not None and len(found) >= total:
        return
    if isinstance(v, torch.Tensor):
        if v.is_floating_point() or v.is_complex():
            found.append(v)
        return
    if depth >= max_depth or v is None or isinstance(v, (str, bytes, int, float, bool)):
        return
    if isinstance(v, (list, tuple)):
        for x in v[:items]:
            _walk(x, found, depth + 1, items, max_depth, total)
    elif isinstance(v, Mapping):
        for x in itertools.islice(v.values(), items):
            _walk(x, found, depth + 1, items, max_depth, total)
    else:
        fields = naming.dataclass_fields(v)
        if fields:
            for f in fields[:items]:
                _walk(getattr(v, f, None), found, depth + 1, items, max_depth, total)
            return
        for k in tensor_attributes(v)[:items]:
            _walk(v.__dict__[k], found, depth + 1, items, max_depth, total)


def tensor_attributes(v: object) -> Tuple[str, ...]:
    """The public attributes of a plain object (a result with `.loss`, `.logits`) that are
    tensors: looked into as dataclass fields are. Only direct tensors: an object holding lists of
    them (a key/value cache) is not walked on every call. Modules and classes are not looked into."""
    attrs = getattr(v, "__dict__", None)
    if not isinstance(attrs, dict) or isinstance(v, (torch.nn.Module, type)):
        return ()
    return tuple(k for k, x in attrs.items() if isinstance(x, torch.Tensor) and isinstance(k, str) and k[:1] != "_")
