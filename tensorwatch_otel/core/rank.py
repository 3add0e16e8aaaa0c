"""Which process this is in a multi-rank run: the global rank, from torch.distributed when
it is initialised, else from the launcher's environment."""

from __future__ import annotations

import os

import torch


def current_rank() -> int:
    """Global rank: torch.distributed when initialised, else $RANK, else 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
