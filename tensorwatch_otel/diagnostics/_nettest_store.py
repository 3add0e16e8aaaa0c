"""The key-value store `nettest` ranks use to check in and hand their results to rank 0.

The store stays usable when a collective is broken, so it carries the verdicts; rank 0 hosts it
unless torchrun's agent already does (TORCHELASTIC_USE_AGENT_STORE=True).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any, Dict, Iterable, List, Optional

PREFIX = "tensorwatch/nettest"


def open_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """A TCPStore client (or server on rank 0) under the nettest prefix.

    Unlike env:// rendezvous, rank 0 does not wait for every worker to connect, so a rank
    that never joins is named by the check-in step instead of ending in a bare timeout.
    """
    from torch.distributed import PrefixStore, TCPStore

    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = TCPStore(addr, port, world_size, False, timeout)
    else:
        store = TCPStore(addr, port, world_size, rank == 0, timeout,
                         wait_for_workers=False, multi_tenant=True)
    return PrefixStore(PREFIX, store)


def put(store: Any, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def get(store: Any, key: str) -> Any:
    return json.loads(store.get(key).decode())


def present(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # store gone: the caller treats the key as absent
        return False


def wait_for(store: Any, keys: Iterable[str], deadline: float, poll_s: float = 0.05) -> List[str]:
    """Waits until every key exists or the monotonic deadline passes; returns the missing keys."""
    missing = list(keys)
    while True:
        missing = [k for k in missing if not present(store, k)]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(poll_s)


def collect(store: Any, keys: Iterable[str]) -> Dict[str, Any]:
    """The JSON values of the keys that exist (missing ones are left out)."""
    out: Dict[str, Any] = {}
    for k in keys:
        if present(store, k):
            try:
                out[k] = get(store, k)
            except Exception:
                continue
    return out


def read_optional(store: Any, key: str) -> Optional[Any]:
    return collect(store, [key]).get(key)
