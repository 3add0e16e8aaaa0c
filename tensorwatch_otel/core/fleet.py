"""Stop every rank together: under torch.distributed a detection is published in the default
process group's store, and every rank raises at the same safe point, after the step's collectives.

Why: a rank that raises in the middle of a step leaves the others blocked in the step's next
collective (a DDP gradient all-reduce, an FSDP all-gather) until the collective timeout, with an
error that says nothing about the inf. So under torch.distributed (world size > 1, on_detect
"raise") the detecting rank records its detection (sinks, durable), publishes it with one
compare-and-set on the store key `tensorwatch_otel/fleet_stop`, and keeps taking part in the
step. Every rank then raises at the first safe point at or after the *target batch*:

- the optimizer step that would consume the values of a batch >= target (the watcher's global
  optimizer-step pre-hook, for any optimizer holding the model's parameters), or
- the start of a batch > target (loops without a `torch.optim` step: evaluation, a GradScaler
  that skipped the step, hand-written updates), unless the batch before it ran DDP's backward
  without its all-reduce (inside `no_sync()`, gradient accumulation): nothing has synchronised
  the ranks there, so a rank may already be in the accumulation's all-reduce. The ranks meet
  at the optimizer step after that all-reduce instead.

The target is the detection's batch for a forward detection (the step's backward collectives
come after the publish, so every rank has seen it by the step's optimizer call), and the next
batch for a detection made after them (gradients, optimizer state). Every rank derives the same
stop point from the published record, so nobody is left alone in a collective.

Who asks the store. At a safe point a rank needs to know whether anything was published before
the collective it just left. Under torchrun (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK set, more
than one rank per node) only each node's local rank 0 (the node's *leader*) asks the store; it
writes its answer for that safe point, keyed by the safe point (2 * batch, + 1 for an optimizer
step), into a small shared-memory file of the node (core/fleet_node.py), and the node's other
ranks wait for the leader's answer for the same safe point (the leader left the same collective, so its answer
covers everything published before it). The store's load per step is then one `check` per
node, not per rank. A leader that stops answering (left its loop, store failure, 30 s without
an answer) sends its node's ranks back to asking the store themselves. Without torchrun's
variables every rank asks the store.

Cost when nothing happened: one store `check` per node (per rank without torchrun) per optimizer
step, or per batch start when no optimizer step ran since the last one; the node's other ranks
read a few bytes of shared memory; no collective.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Literal, Optional, Tuple, Union

import torch

from .errors import NonFiniteDetected
from .events import NonFiniteEvent, StoppedByRankEvent
from .fleet_node import NODE_WAIT_S, NodeShare, Published
from .rank import current_rank

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

log = logging.getLogger(__name__)

#: the store key a detection is published under (one per process group: the run is over once set)
STORE_KEY = "tensorwatch_otel/fleet_stop"


def _dist() -> Optional[ModuleType]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def stopped_message(event: StoppedByRankEvent) -> str:
    where = event.module or "(root)"
    return (f"tensorwatch_otel: rank {event.rank} stopped because rank {event.first_rank} detected "
            f"{event.kind} in {where} ({event.module_class}) {event.tensor} during "
            f"batch_number={event.batch_number}; see rank {event.first_rank}'s report")


class FleetStop:
    """One watcher's part in stopping the ranks together.

    `emit(event)` records an event durably (the watcher's sinks, flushed); `batch_number()` is
    the watcher's batch counter; `model` the watched model (to see DDP's `no_sync()`). With
    `stops=False` (on_detect="report") detections are still published, for their first_rank,
    but nothing is checked per batch and nobody stops. `publishes=False` (a replay's probe
    watcher, whose findings belong to the detection that asked for the replay): none is.
    """

    def __init__(self, emit: Callable[[object], None], batch_number: Callable[[], int], stops: bool = True,
                 model: Optional[torch.nn.Module] = None, publishes: bool = True):
        self._emit = emit
        self._batch_number = batch_number
        self._model = model
        self._pending: Optional[NonFiniteDetected] = None  # own detection, raised at the stop point
        self._first: Optional[Published] = None  # the published record (first rank's), once known
        self._done = False  # this watcher has raised its stop
        self._stops = stops
        self._failed = False  # the store failed once: back to raising at once
        self._publishes = publishes
        self._stepped = False  # an optimizer step was polled since the last batch start
        self._unsynced = False  # the last batch ran DDP's backward without its all-reduce
        self._synced = False  # the last batch ran DDP's backward with its all-reduce
        self._node: Union[None, Literal[False], NodeShare] = None  # False: none (this rank asks the store)
        self._sharded: Optional[Tuple[int, bool]] = None  # (parameter generation, the model is FSDP-sharded)
        self._agree_failed = False  # any_rank's collective failed once
        self.polls = 0  # store checks made (for tests and measurements)
        self.requests = 0  # store requests of any kind (check, get, compare_set, set, wait)
        self.node_reads = 0  # answers read from the node's leader instead of the store

    # ------------------------------------------------------------------ the detecting rank
    def active(self) -> bool:
        """Detections are published: a multi-rank run with a usable store."""
        return self._publishes and not self._failed and not self._done and _dist() is not None

    def publish(self, event: NonFiniteEvent) -> NonFiniteEvent:
        """Publish this rank's detection; `event` with first_rank set (the first to publish wins).
        Returns `event` unchanged when the store cannot be used (the caller raises at once)."""
        if self._first is not None:  # a later detection of this rank, or one after another rank's
            return _with_first(event, self._first["rank"])
        # where the frames came from: a gradient record's frames say "backward"
        phase = event.frames[-1].phase if event.phase == "forward" and event.frames else event.phase
        mine = {"rank": event.rank, "batch_number": event.batch_number, "phase": phase,
                "module": event.module, "module_class": event.module_class, "tensor": event.tensor,
                "kind": event.kind, "time": event.time}
        payload = json.dumps(mine, separators=(",", ":"))
        try:
            self.requests += 1
            got = _store().compare_set(STORE_KEY, "", payload)
            first: Published = mine if got == payload.encode() else json.loads(got)
            self._learned(first)
        except Exception as exc:  # no usable store: this rank stops alone, as without a fleet
            self._store_failed(exc)
            return event
        return _with_first(event, first["rank"])

    def defer(self, exc: NonFiniteDetected, replicated: bool = False) -> bool:
        """Hold `exc` until the stop point; False when it must be raised now. `replicated`: every
        rank holds the values that were found bad (all-reduced gradients) and finds them at this
        same point, so this rank raises now, as every other does (nobody waits in a collective)."""
        if self._first is None or self._failed or not self._stops:
            return False
        if replicated:
            self._done = True
            self._pending = None
            return False
        if self._pending is None:
            self._pending = exc
        return True

    # ------------------------------------------------------------------ safe points
    def at_optimizer_step(self) -> None:
        """Before an optimizer step: the batch whose values it consumes is batch_number - 1."""
        self._stepped = True
        batch = max(self._batch_number() - 1, 0)
        self._at_safe_point(batch, 0, 2 * batch + 1)

    def at_batch_start(self) -> None:
        """Before the root's outermost forward; polls only when no optimizer step polled since
        the last batch start (a step poll would have seen every stop this one could), and never
        right after a batch whose backward skipped DDP's all-reduce (no_sync: the ranks are not
        in step there; they meet at the accumulation's all-reduce and the optimizer step)."""
        stepped, self._stepped = self._stepped, False
        unsynced = self._unsynced
        # (also without stops: on_detect="skip" asks gradients_replicated() at the step)
        ddp = self._active_ddp()
        self._unsynced = ddp is not None and not getattr(ddp, "require_backward_grad_sync", True)
        self._synced = ddp is not None and not self._unsynced
        if not self._stops:
            return
        if unsynced or (stepped and self._first is None):
            return
        batch = self._batch_number()
        self._at_safe_point(batch, 1, 2 * batch)

    def at_exit(self) -> None:
        """The watcher's with-block ended: a detection still held is raised now, and so is a
        stop another rank published (the loop ended before its stop point)."""
        try:
            if self._done or not self._stops:
                return
            if self._pending is not None:
                self._raise(self._pending)
            first = self._first
            if first is None and not self._failed and _dist() is not None:
                first = self._ask_store(None)  # the published record, once learned
            if first is not None:
                self._stop(first, self._batch_number())
        finally:
            if self._node:
                self._node.leave()  # a leader's node asks the store itself from now on

    def _at_safe_point(self, batch: int, after: int, point: int) -> None:
        if self._done or self._failed or not self._stops:
            return
        first = self._first
        if first is None:
            if _dist() is None:
                return
            first = self._poll(point)
            if first is None:
                return
        target = first["batch_number"] + (0 if first.get("phase", "forward") == "forward" else 1)
        if batch < target + after:
            return
        if self._pending is not None:
            self._raise(self._pending)
        self._stop(first, batch)

    def gradients_replicated(self) -> bool:
        """The gradients the coming optimizer step consumes are the same on every rank: the last
        batch ran a DistributedDataParallel backward with its all-reduce (an inf or nan on any
        rank is then on all of them). False for FSDP (each rank holds its own shard), no_sync()
        micro-batches, and anything not seen to be DDP."""
        return self._synced and not self._failed and _dist() is not None

    def gradients_sharded(self, generation: int) -> bool:
        """Each rank holds, and checks, its own shard of the gradients (FSDP) in this multi-rank
        run, so the ranks must agree before they act on what one of them found (`any_rank`).
        `generation`: the watcher's count of parameter changes (fully_shard after watch())."""
        if _dist() is None or self._model is None:
            return False
        if self._sharded is None or self._sharded[0] != generation:
            self._sharded = (generation, sharded(self._model))
        return self._sharded[1]

    def any_rank(self, flag: bool) -> bool:
        """True when `flag` is True on any rank: one all_reduce (MAX) of a 0/1 flag on the default
        process group, which every rank must call at the same point. After a failure, this rank's
        own flag (said once)."""
        dist = _dist()
        if dist is None or self._agree_failed:
            return flag
        try:
            t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device(dist))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return bool(t.item())
        except Exception as exc:
            self._agree_failed = True
            log.error("tensorwatch_otel: the ranks could not agree on skipping an optimizer step (%s: %s); "
                      "each rank decides alone from now on", type(exc).__name__, exc)
            return flag

    def _active_ddp(self) -> Optional[torch.nn.Module]:
        """The DistributedDataParallel module whose backward this batch runs, if any."""
        if not torch.is_grad_enabled():
            return None
        from torch.nn.parallel import DistributedDataParallel as DDP

        # set while a DDP forward runs its module
        ddp: Optional[torch.nn.Module] = getattr(DDP, "_active_ddp_module", None)
        if ddp is None and isinstance(self._model, DDP):  # the watched root is the DDP wrapper
            ddp = self._model
        return ddp

    def _stop(self, first: Published, batch: int) -> None:
        """Raise the stop another rank published, after recording it."""
        event = StoppedByRankEvent(
            batch_number=first["batch_number"], rank=current_rank(), first_rank=first["rank"],
            module=first["module"], module_class=first["module_class"], tensor=first["tensor"],
            kind=first["kind"], time=time.time(), stopped_at_batch=batch)
        self._emit(event)
        self._raise(NonFiniteDetected(stopped_message(event), event))

    # ------------------------------------------------------------------ asking
    def _poll(self, point: int) -> Optional[Published]:
        """What was published before safe point `point`: from the node's leader, else the store."""
        node = self._node_share()
        if node is not None and not node.leader:
            try:
                answer = node.read(point, NODE_WAIT_S)
            except Exception as exc:  # the file went away: ask the store from now on
                answer = None
                log.warning("tensorwatch_otel: reading the node's stop signal failed (%s); this rank "
                            "asks the process group's store itself from now on", exc)
            if answer is not None:
                self.node_reads += 1
                if answer[1] is not None:
                    self._first = answer[1]
                return self._first
            self._node = False  # the leader does not answer: ask the store (logged by read)
        return self._ask_store(point)

    def _ask_store(self, point: Optional[int]) -> Optional[Published]:
        node = self._node if self._node and self._node.leader else None
        self.polls += 1
        try:
            store = _store()
            self.requests += 1
            if not store.check([STORE_KEY]):
                if node is not None and point is not None:
                    node.answer(point)
                return None
            self.requests += 1
            self._learned(json.loads(store.get(STORE_KEY)))
        except Exception as exc:
            self._store_failed(exc)
            return None
        return self._first

    def _learned(self, first: Published) -> None:
        self._first = first
        node = self._node_share() if self._stops else None
        if node is not None and node.leader:
            node.stop(first)  # the node's ranks see it at their next safe point

    def _node_share(self) -> Optional["NodeShare"]:
        if self._node is None:
            self._node = False
            try:
                self._node = NodeShare.open(self, _store) or False
            except Exception as exc:  # no shared file: every rank asks the store, as before
                log.warning("tensorwatch_otel: no node-local stop signal (%s: %s); this rank asks the "
                            "process group's store at every safe point", type(exc).__name__, exc)
        return self._node or None

    def _raise(self, exc: NonFiniteDetected) -> None:
        self._done = True
        self._pending = None
        raise exc

    def _store_failed(self, exc: Exception) -> None:
        self._failed = True
        if self._node:
            self._node.leave()
        log.error("tensorwatch_otel: the process group's store failed (%s: %s); ranks are no longer "
                  "stopped together, a detection raises on its own rank at once", type(exc).__name__, exc)



def sharded(model: torch.nn.Module) -> bool:
    """The model (or a part of it) is sharded with FSDP (fully_shard, FullyShardedDataParallel)."""
    return any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) or hasattr(m, "_get_fsdp_state")
               for m in model.modules())


def _flag_device(dist: ModuleType) -> torch.device:
    """Where a flag tensor for a collective must live: the CPU for gloo, else the accelerator."""
    if "gloo" in str(dist.get_backend()) or not torch.accelerator.is_available():
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    assert acc is not None
    return torch.device(acc.type, torch.accelerator.current_device_index())


def _store() -> Store:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _with_first(event: NonFiniteEvent, first_rank: int) -> NonFiniteEvent:
    return dataclasses.replace(event, first_rank=first_rank)
