"""Was it the numbers or the device? (`rerun_on_detect=True`) Right after a forward detection,
before backward or the optimizer consumed anything, the batch is run once more on the same
weights from its batch-start RNG state, every module checked as it returns. The same inf/nan
in the same place is a numeric problem (fix the model, the data, the scale); none is a
transient fault: suspect the device (the event names the rank and host)."""

from __future__ import annotations

import logging
import socket
from typing import Optional

import torch

from .capture import BatchCapture
from .events import NonFiniteEvent
from .ports import Sink

log = logging.getLogger(__name__)


class FirstNonFinite(Sink):
    """Keeps the first detection a probe watcher makes."""

    def __init__(self):
        self.event: Optional[NonFiniteEvent] = None

    def on_event(self, event) -> None:
        if self.event is None and isinstance(event, NonFiniteEvent):
            self.event = event


def rerun_batch(model: torch.nn.Module, held: BatchCapture, batch_number: int, module: str, tensor: str,
                make_watcher) -> Optional[bool]:
    """True when the replay finds inf/nan at `module` and `tensor`, False when it finds
    none, None when the batch could not be replayed. `make_watcher(model, sink)` builds a silent
    module-checking watcher. Buffers (BatchNorm statistics) and RNG states are restored after.

    The replay runs on copies of the held inputs, so the caller's tensors, lists and dicts are
    left as the forward left them. A batch whose inputs the forward changed in place (the
    replay would not see the batch as it was), or that holds other objects (a transformers
    cache: the replay would change it and could not give it back) is not replayed: None, with
    one log line naming those inputs."""
    _, _, rng = held.held(batch_number)
    if rng is None:
        return None
    problems = held.changed(batch_number)
    if problems:
        _say_skipped(held, batch_number, problems)
        return None
    saved_rng = torch.get_rng_state()
    saved_cuda = torch.cuda.get_rng_state_all() if "cuda" in rng else None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    probe = None
    try:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])
        args, kwargs = held.replay_inputs(batch_number)
        sink = FirstNonFinite()
        probe = make_watcher(model, sink)
        with torch.no_grad():
            model(*args, **kwargs)
        found = sink.event
    except Exception as exc:  # the replay must never hide the detection itself
        log.warning("tensorwatch_otel: could not re-run batch %d: %s: %s", batch_number,
                    type(exc).__name__, exc)
        return None
    finally:
        if probe is not None:
            probe.detach()
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        torch.set_rng_state(saved_rng)
        if saved_cuda is not None:
            torch.cuda.set_rng_state_all(saved_cuda)
    return found is not None and (found.module, found.tensor) == (module, tensor)


def _say_skipped(held: BatchCapture, batch_number: int, problems: list) -> None:
    """One warning per watcher (its capture holder); later skips at debug level."""
    level = logging.WARNING if held.replay_skipped() == 1 else logging.DEBUG
    log.log(level, "tensorwatch_otel: rerun_on_detect skipped for batch %d: a replay would not see these inputs "
            "as the batch did, or could not give them back as it found them: %s", batch_number,
            ", ".join(problems[:8]) + (f" and {len(problems) - 8} more" if len(problems) > 8 else ""))


def replay_would_block(model: torch.nn.Module) -> bool:
    """A replay on one rank of a sharded model (FSDP) waits in collectives the other ranks
    never join: such models are not re-run."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    if any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) or hasattr(m, "_get_fsdp_state")
           for m in model.modules()):
        log.warning("tensorwatch_otel: rerun_on_detect skipped: the model is sharded (FSDP) over several "
                    "ranks, and a replay on this rank alone would wait for the others")
        return True
    return False


def host() -> str:
    return socket.gethostname()
