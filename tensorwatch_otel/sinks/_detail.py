"""Fleet mode of the Prometheus sink: which per-module series a rank serves (``detail=``,
``detail_ranks=``), and the per-rank summary series that every rank serves whatever it chooses.

A 70B-shaped model has about 2,970 (module, tensor) pairs, 8,910 tensor series per rank; a
thousand ranks overrun one Prometheus. In ``top:K`` mode a rank serves the K pairs with the
largest range used (at most 2K, see DetailPolicy), plus ``tensorwatch_detail_cutoff_ratio``: the
largest range used among the pairs it left out. So the fleet-wide per module maximum
(``max without (rank, instance)``) is exact for every pair above the fleet's largest cutoff, and
every hidden pair is known to be below it.
See docs/at-scale.md.
"""

from __future__ import annotations

import math
import os
import threading
from typing import FrozenSet, Iterable, List, Optional, Sequence, Tuple

from ..core import env as _env

ENV_DETAIL = _env.ENV_PROMETHEUS_DETAIL
ENV_DETAIL_RANKS = _env.ENV_PROMETHEUS_DETAIL_RANKS

DETAIL_ALL = "all"
DETAIL_SUMMARY = "summary"
_TOP = "top:"
_EXPECTED = "expected 'all', 'summary', 'top:K' or an integer K >= 1 (the K pairs with the largest range used)"

Row = tuple  # Snapshot row: (module label, module_class, tensor, dtype, abs_min, abs_max, range_used, shares)


def detail_setting(value, arg: str = "detail") -> str:
    """Argument, then TENSORWATCH_PROMETHEUS_DETAIL, then ``all``; normalised to all/summary/top:K."""
    source = arg
    if value is None:
        raw = os.environ.get(ENV_DETAIL, "").strip()
        if not raw:
            return DETAIL_ALL
        value, source = raw, ENV_DETAIL
    k: Optional[int] = None
    if isinstance(value, int) and not isinstance(value, bool):
        k = value
    elif isinstance(value, str):
        text = value.strip().lower()
        if text in (DETAIL_ALL, DETAIL_SUMMARY):
            return text
        digits = text[len(_TOP):] if text.startswith(_TOP) else text
        if digits.strip().lstrip("-").isdigit():
            k = int(digits)
    if k is None or k < 1:
        raise _env.ConfigError(f"{source}={value!r}: {_EXPECTED}")
    return f"{_TOP}{k}"


def detail_ranks_setting(value, arg: str = "detail_ranks") -> FrozenSet[int]:
    """Argument (ints or "0,8,16"), then TENSORWATCH_PROMETHEUS_DETAIL_RANKS, then none."""
    source = arg
    if value is None:
        raw = os.environ.get(ENV_DETAIL_RANKS, "").strip()
        if not raw:
            return frozenset()
        value, source = raw, ENV_DETAIL_RANKS
    items: Iterable = _env.parse_list(source, value) if isinstance(value, str) else value
    out = set()
    try:
        for item in items:
            if isinstance(item, bool):
                raise ValueError
            n = int(item.strip()) if isinstance(item, str) else int(item) if isinstance(item, int) else -1
            if n < 0:
                raise ValueError
            out.add(n)
    except (TypeError, ValueError):
        raise _env.ConfigError(f"{source}={value!r}: expected global rank numbers (integers >= 0), "
                               "comma-separated or as a list") from None
    return frozenset(out)


def _badness(row: Row) -> float:
    """How close a pair is to its dtype's limit: inf/NaN first, then range used (0 without one)."""
    hi, ru = row[5], row[6]
    if hi != hi or hi == math.inf:
        return math.inf
    return 0.0 if ru is None else ru


class DetailPolicy:
    """Chooses the rows a rank serves as per-module series.

    ``top:K`` serves the K worst pairs, and keeps serving a pair it served at the previous scrape
    while that pair stays among the 2K worst: a pair near the boundary does not flap in and out
    of Prometheus (each flap is a gap in its series and the recording rules' output). At most 2K
    pairs are served. The cutoff is computed over whatever is left out, so it stays exact.
    """

    __slots__ = ("setting", "ranks", "_k", "_served", "_lock")

    def __init__(self, setting: str, ranks: FrozenSet[int]):
        self.setting = setting
        self.ranks = ranks
        self._k = int(setting[len(_TOP):]) if setting.startswith(_TOP) else None
        self._served: FrozenSet[Tuple[str, str]] = frozenset()  # (module, tensor) of the last scrape
        self._lock = threading.Lock()  # scrapes of two Prometheus servers may overlap

    def select(self, rows: Sequence[Row], rank: int, detected: bool) -> Tuple[Sequence[Row], float, int]:
        """(rows to serve, cutoff, hidden): cutoff is the largest badness among the rows left out
        (0 when none is), hidden how many were left out."""
        if self.setting == DETAIL_ALL or detected or rank in self.ranks:
            return rows, 0.0, 0
        k = 0 if self._k is None else self._k
        if k >= len(rows):
            return rows, 0.0, 0
        ranked = sorted(rows, key=_badness, reverse=True)
        with self._lock:
            keep = [i for i in range(k, min(2 * k, len(ranked))) if (ranked[i][0], ranked[i][2]) in self._served]
            chosen = list(range(k)) + keep
            self._served = frozenset((ranked[i][0], ranked[i][2]) for i in chosen)
        left = set(chosen)
        cutoff = next((_badness(ranked[i]) for i in range(len(ranked)) if i not in left), 0.0)
        return [ranked[i] for i in chosen], cutoff, len(rows) - len(chosen)

    @staticmethod
    def worst(rows: Sequence[Row]) -> Optional[Row]:
        return max(rows, key=_badness) if rows else None


def summary_families(snap_rows: Optional[Sequence[Row]], r: str, cutoff: float, hidden: int) -> List:
    """The per-rank fleet-mode series: the worst pair (with its labels), the cutoff, the hidden count."""
    from prometheus_client.core import GaugeMetricFamily

    from .catalogue import BY_KEY

    worst_f, cutoff_f, hidden_f = (GaugeMetricFamily(BY_KEY[k].prom, BY_KEY[k].help, labels=BY_KEY[k].labels)
                                   for k in ("rank_worst", "detail_cutoff", "detail_hidden"))
    if snap_rows is not None:
        worst = DetailPolicy.worst(snap_rows)
        if worst is not None:
            module, cls, tensor, dtype = worst[0], worst[1], worst[2], worst[3]
            worst_f.add_metric((module, cls, tensor, dtype, r), _badness(worst))
        cutoff_f.add_metric((r,), cutoff)
        hidden_f.add_metric((r,), hidden)
    return [worst_f, cutoff_f, hidden_f]
