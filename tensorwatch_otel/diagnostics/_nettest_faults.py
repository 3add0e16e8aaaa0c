"""Test-only fault injection for `nettest`, read from TENSORWATCH_NETTEST_FAULT.

Format: `KIND:RANK[,KIND:RANK...]`, KIND one of `absent` (the rank never joins), `hang` (the rank
joins, then stops before the barrier) and `wrong_value` (the rank's reduced results are corrupted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping

from ..core.env import ENV_NETTEST_FAULT as ENV_VAR
KINDS = ("absent", "hang", "wrong_value")


@dataclass(frozen=True)
class Faults:
    """Which fault, if any, applies to which rank."""

    by_rank: Dict[int, str] = field(default_factory=dict)

    def has(self, kind: str, rank: int) -> bool:
        return self.by_rank.get(rank) == kind


def parse_faults(env: Mapping[str, str]) -> Faults:
    """Parses TENSORWATCH_NETTEST_FAULT; raises ValueError naming the variable when malformed."""
    raw = env.get(ENV_VAR, "").strip()
    by_rank: Dict[int, str] = {}
    if not raw:
        return Faults(by_rank)
    for item in raw.split(","):
        kind, sep, rank = item.strip().partition(":")
        if not sep or kind not in KINDS or not rank.strip().isdigit():
            raise ValueError(
                f"{ENV_VAR}={raw!r}: expected KIND:RANK[,KIND:RANK], KIND one of {', '.join(KINDS)}"
            )
        by_rank[int(rank)] = kind
    return Faults(by_rank)
