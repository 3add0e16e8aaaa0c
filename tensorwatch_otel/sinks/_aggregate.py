"""One entry per (module, tensor) of a batch for the metric sinks: module filters, the extremes
of a module called more than once, and the series cap. Runs on exporter threads."""

from __future__ import annotations

import fnmatch
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..core.events import BatchStats, label_for_module

Patterns = Optional[Union[str, Sequence[str]]]
Key = Tuple[str, str]  # (module label, tensor)


def patterns(p: Patterns) -> Tuple[str, ...]:
    if p is None:
        return ()
    return (p,) if isinstance(p, str) else tuple(p)


class ModuleFilter:
    """include/exclude globs matched against the module path and its label ("(root)")."""

    def __init__(self, include: Patterns = None, exclude: Patterns = None):
        self.include = patterns(include)
        self.exclude = patterns(exclude)
        self._cache: Dict[str, bool] = {}

    def __call__(self, module: str) -> bool:
        ok = self._cache.get(module)
        if ok is None:
            names = (module, label_for_module(module))
            ok = (not self.include or any(fnmatch.fnmatchcase(n, p) for n in names for p in self.include)) \
                and not any(fnmatch.fnmatchcase(n, p) for n in names for p in self.exclude)
            self._cache[module] = ok
        return ok


def _max_nan(a: float, b: float) -> float:
    # NaN wins: a NaN anywhere in the batch must not be hidden by comparison order.
    if a != a or b != b:
        return math.nan
    return a if a >= b else b


def _min_nan(a: float, b: float) -> float:
    if a != a or b != b:
        return math.nan
    return a if a <= b else b


def aggregate(stats: BatchStats, wanted: ModuleFilter, cap: int) -> Tuple[Dict[Key, List], int]:
    """({(module label, tensor): [module_class, dtype, abs_min, abs_max, range_used]}, dropped).

    Rows of a module called several times in the batch merge into their extremes (min of abs
    min, max of abs max). Pairs beyond `cap` (in frame order) are dropped and counted.
    """
    entries: Dict[Key, List] = {}
    dropped = 0
    for r in stats.rows():
        if not wanted(r.module):
            continue
        key = (label_for_module(r.module), r.tensor)
        e = entries.get(key)
        if e is None:
            if len(entries) >= cap:
                dropped += 1
                continue
            entries[key] = [r.module_class, r.dtype, r.abs_min, r.abs_max, r.range_used]
        else:
            e[2] = _min_nan(e[2], r.abs_min)
            e[3] = _max_nan(e[3], r.abs_max)
            if r.range_used is not None:
                e[4] = r.range_used if e[4] is None else _max_nan(e[4], r.range_used)
    return entries, dropped
