"""Which process this is in a multi-rank run: the global rank, from torch.distributed when
it is initialised, else from the launcher's environment (one parser for every reader)."""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch

from .env import parse_int

#: The launcher's global rank variable (torchrun, accelerate, Slurm wrappers); not ours, so not
#: among the TENSORWATCH_* constants of core/env.py.
RANK_VAR = "RANK"


def env_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """$RANK as an integer >= 0 (0 when unset or blank). Raises ConfigError (a ValueError)
    naming RANK for anything else (``abc``, ``0,1``, ``-1``), so every sink and the watcher agree
    on one rank or fail together, when they are built."""
    env = os.environ if environ is None else environ
    raw = env.get(RANK_VAR, "")
    raw = raw.strip() if isinstance(raw, str) else ""
    return parse_int(RANK_VAR, raw, 0) if raw else 0


def current_rank() -> int:
    """Global rank: torch.distributed when initialised, else $RANK, else 0 (see env_rank)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_rank()
