"""A node-local channel for stopping the ranks together: under torchrun the node's leader (local
rank 0) writes its answers from the process group's store into a small shared-memory file, and the
node's other ranks read them there instead of asking the store (core/fleet.py's FleetStop uses it).
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import mmap
import os
import struct
import tempfile
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Protocol, Tuple

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

log = logging.getLogger(__name__)

#: the store key prefix under which a node's leader names its shared-memory file
NODE_KEY = "tensorwatch_otel/fleet_node"
#: how long a rank waits for its node's leader (the file at first, then each answer)
NODE_WAIT_S = 30.0

Published = Dict[str, Any]  # a published detection: rank, batch_number, phase, module, ...


class Requests(Protocol):
    """Who counts the store requests a node's channel makes (FleetStop)."""

    requests: int


# The node's shared file: the leader's answers, read by the node's other ranks.
#   [0:8)   int64  point: the last safe point the leader answered (-1: none yet)
#   [8:16)  int64  state: 0 nothing published, 1 published (the record follows), 2 leader gone
#   [16:24) int64  length of the record; [24:) the record (JSON)
# The leader writes the record, then the state, then the point; a reader reads the point, then
# the state, so an answered point's stop is never missed.
_SIZE = 4096
_CLEAR, _STOP, _GONE = 0, 1, 2
NODE_FILES = itertools.count()  # node files this process opened: the same sequence on every local rank


class NodeShare:
    """A node-local channel from the node's leader (local rank 0) to its other ranks."""

    def __init__(self, mm: mmap.mmap, leader: bool, path: str) -> None:
        self._mm = mm
        self.leader = leader
        self.path = path
        if leader:  # a leader dropped without leaving (its loop raised): its ranks ask the store
            self._unlink = weakref.finalize(self, _leave_and_unlink, mm, path)

    @classmethod
    def open(cls, fleet: Requests, store_of: Callable[[], Store]) -> Optional["NodeShare"]:
        """The node's channel under torchrun with several local ranks; None otherwise. `store_of()`
        gives the process group's store; `fleet.requests` counts the requests made of it."""
        try:
            local, local_size, group = (int(os.environ[k]) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"))
        except (KeyError, ValueError):
            return None
        if local_size <= 1:
            return None
        key = f"{NODE_KEY}/{group}/{next(NODE_FILES)}"
        store = store_of()
        if local == 0:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="tensorwatch_otel-fleet-", dir=folder)
            try:
                os.ftruncate(fd, _SIZE)
                mm = mmap.mmap(fd, _SIZE)
            finally:
                os.close(fd)
            struct.pack_into("<qq", mm, 0, -1, _CLEAR)
            share = cls(mm, True, path)
            fleet.requests += 1
            store.set(key, path)
            return share
        fleet.requests += 2
        store.wait([key], datetime.timedelta(seconds=NODE_WAIT_S))
        path = store.get(key).decode()
        fd = os.open(path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        fleet.requests += 1
        if store.add(f"{key}/opened", 1) == local_size - 1:  # the node's last rank to open it
            _unlink(path)  # the mappings stay: nothing is left behind, even if torchrun kills the ranks
        return cls(mm, False, path)

    # the leader
    def answer(self, point: int) -> None:
        """Nothing was published before `point`."""
        struct.pack_into("<q", self._mm, 0, point)

    def stop(self, first: Published) -> None:
        data = json.dumps(first, separators=(",", ":")).encode()[:_SIZE - 24]
        self._mm[24:24 + len(data)] = data
        struct.pack_into("<q", self._mm, 16, len(data))
        struct.pack_into("<q", self._mm, 8, _STOP)

    def leave(self) -> None:
        """The leader answers no more (its loop ended, its store failed): unless it published a
        stop, the node's ranks ask the store themselves."""
        if self.leader:
            _leave(self._mm)

    # the other ranks
    def read(self, point: int, timeout: float) -> Optional[Tuple[int, Optional[Published]]]:
        """(point, record or None) once the leader answered `point` or published a stop; None when
        the leader is gone or did not answer within `timeout` seconds."""
        mm = self._mm
        nap, deadline = 0.0, None
        while True:
            answered = struct.unpack_from("<q", mm, 0)[0]
            state = struct.unpack_from("<q", mm, 8)[0]
            if state == _STOP:
                size = struct.unpack_from("<q", mm, 16)[0]
                return point, json.loads(bytes(mm[24:24 + size]))
            if answered >= point:  # (a leader gone after answering `point` answered it)
                return point, None
            if state == _GONE:
                return None
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout
            elif now > deadline:
                log.warning("tensorwatch_otel: the node's leader (local rank 0) gave no stop signal for "
                            "%.0f s; this rank asks the process group's store itself from now on", timeout)
                return None
            time.sleep(nap)
            nap = min(nap * 2 or 2e-5, 2e-4)


def _leave(mm: mmap.mmap) -> None:
    if not mm.closed and struct.unpack_from("<q", mm, 8)[0] == _CLEAR:
        struct.pack_into("<q", mm, 8, _GONE)


def _leave_and_unlink(mm: mmap.mmap, path: str) -> None:
    try:
        _leave(mm)
    except ValueError:
        pass
    _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
