"""Per-rank results of a torchrun'd test script: one JSON file per rank in a folder, because the
ranks share one stdout and their lines can interleave."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List


def write_observed(folder: str, rank: int, out: Dict[str, Any]) -> None:
    path = Path(folder) / f"observed-rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, path)


def read_observed(folder: Path, world: int, proc: Any) -> List[Dict[str, Any]]:
    seen = []
    for rank in range(world):
        path = Path(folder) / f"observed-rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result\n{proc.stdout}\n{proc.stderr[-4000:]}"
        seen.append(json.loads(path.read_text()))
    return seen
