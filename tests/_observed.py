"""Per-rank results of a torchrun'd test script: one JSON file per rank in a folder, because the
ranks share one stdout and their lines can interleave."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, NoReturn


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


def _wait_for_peers(folder: str, seconds: float = 30.0) -> None:
    """Until every rank of the launch has written its result (or `seconds` pass): a rank that
    exits non-zero makes torchrun end the others at once, and on a loaded machine a peer that
    stopped at the same step may not have written its result yet."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all((Path(folder) / f"observed-rank{r}.json").exists() for r in range(world)):
            return
        time.sleep(0.05)


def leave(code: int, folder: str = "") -> NoReturn:
    """End a torchrun'd rank once its results are written: the exit handlers run (the package's,
    logging's, torch's), then the process ends without the interpreter's finalization, where a
    finished rank has aborted under load ("terminate called without an active exception",
    cause unknown) and failed a test whose every check had passed. The tests are about the
    training; the launches set PYTHONFAULTHANDLER, so an abort before this point still shows
    every thread's stack. `folder`: where the ranks write their results; a non-zero exit waits
    there for its peers' results first."""
    if code and folder:
        _wait_for_peers(folder)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
