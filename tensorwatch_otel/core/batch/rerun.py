"""Was it the numbers or the device? (`rerun_on_detect=True`) Right after a forward detection,
before backward or the optimizer consumed anything, the batch is run once more on the same
weights from its batch-start RNG state, every module checked as it returns. The same inf/nan
in the same place is a numeric problem (fix the model, the data, the scale); none is a
transient fault: suspect the device (the event names the rank and host). On a compiled model
the batch is replayed eagerly and then compiled, and the event's `verdict` says which of the
two reproduces it: "model", "compiler" or "transient" (see rerun).

The same replay localizes a detection made in a batch `every_n_batches` did not record (by the
check of its output, or by the step guard): `localize` runs the batch once with every module
checked and returns the event a recorded batch would have given (see core/batch/detection.py).

A replay runs under the autocast state the batch's call ran under, from its start RNG states,
and gives back what it changed (core/batch/replay_state.py). One that cannot run the batch as it ran
(random numbers it cannot draw as the batch drew them: a compiled model's dropout, a generator
a module holds) does not name a place or a verdict: the event says why (`uncertain`)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import socket
import sys
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

from .. import naming
from ..frames import transforms
from .capture import AutocastState, BatchCapture, autocast_state
from ..events import NonFiniteEvent
from ..fleet import sharded
from ..ports import Sink
from .replay_state import ReplayState

log = logging.getLogger(__name__)

#: NonFiniteEvent.verdict on a compiled model: the eager replay reproduces the inf/nan...
VERDICT_MODEL = "model"
#: ...only the compiled replay does (suspect the compiler)...
VERDICT_COMPILER = "compiler"
#: ...neither does (suspect the device, as `reproduced=False` says)
VERDICT_TRANSIENT = "transient"
_OPTIMIZED = "OptimizedModule"  # torch.compile's module wrapper (torch._dynamo is imported only when used)

MakeWatcher = Callable[[torch.nn.Module, Sink], Any]
Args = Tuple[Any, ...]
Kwargs = Dict[str, Any]


class FirstNonFinite(Sink):
    """Keeps the first detection a probe watcher makes."""

    def __init__(self) -> None:
        self.event: Optional[NonFiniteEvent] = None

    def on_event(self, event: object) -> None:
        if self.event is None and isinstance(event, NonFiniteEvent):
            self.event = event


class Rerun(NamedTuple):
    """What `rerun_on_detect`'s replays say: `reproduced` and `verdict` as the event has them,
    and `uncertain`: why they are not known (the replays drew random numbers the batch did not
    draw), else None."""

    reproduced: Optional[bool]
    verdict: Optional[str]
    uncertain: Optional[str] = None


class Localized(NamedTuple):
    """What the replay of an unsampled batch says: the forward's first inf/nan as a recorded
    batch gives it (None when the replay found none or could not say), and `uncertain`: why the
    batch was not replayed as it ran, else None (then a None event means the inf/nan was born
    outside the model's forward)."""

    event: Optional[NonFiniteEvent]
    uncertain: Optional[str] = None


class _Replayed(NamedTuple):
    event: Optional[NonFiniteEvent]  # the first inf/nan the probe watcher found
    bad: bool  # the outputs hold inf/nan
    drew_torch: bool  # the replay drew from torch's global generators (from the batch's start states)
    drew_other: List[str]  # ...and from these, whose states at the batch's start are not held


#: Localized/Rerun.uncertain: a compiled model's random numbers (inductor's own) are not an eager replay's
COMPILED_RANDOM = ("the eager replay cannot draw the random numbers the compiled model drew (dropout under "
                   "torch.compile)")


def _not_batch_random(drew: List[str]) -> str:
    return "the replay drew random numbers the batch did not draw (from " + ", ".join(drew) + ")"


def rerun_batch(model: torch.nn.Module, held: BatchCapture, batch_number: int, module: str, tensor: str,
                make_watcher: MakeWatcher) -> Optional[bool]:
    """True when the replay finds inf/nan at `module` and `tensor`, False when it finds
    none, None when the batch could not be replayed. `make_watcher(model, sink)` builds a silent
    module-checking watcher. What the replay changes is given back after (core/batch/replay_state.py).

    The replay runs on copies of the held inputs, so the caller's tensors, lists and dicts are
    left as the forward left them. A batch whose inputs the forward changed in place (the
    replay would not see the batch as it was), or that holds other objects (a transformers
    cache: the replay would change it and could not give it back) is not replayed: None, with
    one log line naming those inputs."""
    return _rerun_eager(model, held, batch_number, module, tensor, make_watcher).reproduced


def _rerun_eager(model: torch.nn.Module, held: BatchCapture, batch_number: int, module: str, tensor: str,
                 make_watcher: MakeWatcher) -> Rerun:
    if not _replayable(held, batch_number):
        return Rerun(None, None)
    found = _replay(model, held, batch_number, lambda a, k: model(*a, **k), make_watcher, grad=False)
    if isinstance(found, str):
        return Rerun(None, None)
    same = found.event is not None and (found.event.module, found.event.tensor) == (module, tensor)
    if not same and found.drew_other:  # other random numbers: not finding it says nothing
        return Rerun(None, None, _not_batch_random(found.drew_other))
    return Rerun(same, None)


def rerun_verdict(watched: torch.nn.Module, held: BatchCapture, batch_number: int, module: str, tensor: str,
                  make_watcher: MakeWatcher) -> Tuple[Optional[bool], Optional[str]]:
    """(reproduced, verdict): `rerun(...)` without its note."""
    found = rerun(watched, held, batch_number, module, tensor, make_watcher)
    return found.reproduced, found.verdict


def rerun(watched: torch.nn.Module, held: BatchCapture, batch_number: int, module: str, tensor: str,
          make_watcher: MakeWatcher) -> Rerun:
    """(reproduced, verdict, uncertain) for a detection in the model given to watch() (`watched`:
    the user's model or its wrappers). For an eager model the verdict is None and `reproduced` is
    rerun_batch's. For a compiled one (`watch(torch.compile(m))`, `m.compile()`, a compiled
    submodule, or `torch.compile(m)` called after `watch(m)`) the batch is replayed eagerly
    first (every `torch.compile` ignored, every module checked): inf/nan anywhere is "model".
    Else it is replayed through the compiled callable the user runs (same grad mode, outputs
    checked): inf/nan there is "compiler", none is "transient". `reproduced` is True for
    "model" and "compiler", False for "transient"; (None, None) when a replay failed.

    An eager replay that draws random numbers (dropout) cannot draw the compiled model's (the
    compiler generates its own): then the compiled replay, which draws the batch's, decides
    alone: none there is "transient"; inf/nan there is reproduced, with no verdict (the eager
    model might overflow too with the compiled run's numbers) and `uncertain` saying why."""
    model = naming.unwrap_root(watched)
    compiled = compiled_callable(watched)
    if compiled is None:
        return _rerun_eager(model, held, batch_number, module, tensor, make_watcher)
    if not _replayable(held, batch_number):
        return Rerun(None, None)
    grad = torch.is_grad_enabled()  # the detecting forward's mode: the compiled graph depends on it

    def eager(args: Args, kwargs: Kwargs) -> Any:
        with torch.compiler.set_stance("force_eager"):
            return model(*args, **kwargs)

    found = _replay(model, held, batch_number, eager, make_watcher, grad=False)
    if isinstance(found, str):
        return Rerun(None, None)
    eager_random = found.drew_torch or bool(found.drew_other)
    if not eager_random and (found.event is not None or found.bad):
        return Rerun(True, VERDICT_MODEL)
    again = _replay(model, held, batch_number, lambda a, k: compiled(*a, **k), None, grad=grad)
    if isinstance(again, str):
        return Rerun(None, None)
    if again.drew_other:
        why = _not_batch_random(again.drew_other)
        return Rerun(True, None, why) if again.bad else Rerun(None, None, why)
    if not again.bad:
        return Rerun(False, VERDICT_TRANSIENT)
    if eager_random:
        return Rerun(True, None, COMPILED_RANDOM if found.drew_torch else _not_batch_random(found.drew_other))
    return Rerun(True, VERDICT_COMPILER)


def localize(watched: torch.nn.Module, held: BatchCapture, batch_number: int,
             make_watcher: MakeWatcher) -> Localized:
    """The first inf/nan a replay of batch `batch_number` finds in the forward, every module
    checked (eagerly, on a compiled model), as the event a recorded batch gives: numbered as
    that batch, with its frames. The replay is of the batch's root call held last (a `batch()`
    block that calls the root twice: the second; what it finds is where that call's inf/nan was
    born), under the autocast state that call ran under. No event when the replay finds none (the
    inf/nan was born outside the model's modules' forward: in a loss computed outside, in the
    backward, or in another call of the batch). No event and `uncertain` saying why when the
    batch cannot be replayed (no root call, inputs changed in place, objects a replay cannot give
    back, a failed replay: said once) or the replay could not run it as it ran (random numbers:
    a compiled model's, or those of a generator whose state at the batch's start is not held).
    What the replay changes is given back after (core/batch/replay_state.py)."""
    if held.held(batch_number)[2] is None:
        return Localized(None, _say_skipped(held, batch_number,
                                            ["the inputs, not held (the batch did not call the root)"]))
    why = _not_replayable(held, batch_number)
    if why is not None:
        return Localized(None, why)
    model = naming.unwrap_root(watched)

    def eager(args: Args, kwargs: Kwargs) -> Any:
        if "torch._dynamo" not in sys.modules:  # torch.compile never ran: nothing to keep from compiling
            return model(*args, **kwargs)
        with torch.compiler.set_stance("force_eager"):
            return model(*args, **kwargs)

    found = _replay(model, held, batch_number, eager, make_watcher, grad=False)
    if isinstance(found, str):
        return Localized(None, found)
    if found.drew_other:
        return Localized(None, _say_uncertain(held, batch_number, _not_batch_random(found.drew_other)))
    if found.drew_torch and compiled_callable(watched) is not None:
        return Localized(None, _say_uncertain(held, batch_number, COMPILED_RANDOM))
    event = found.event
    if event is None:
        return Localized(None)
    frames = tuple(dataclasses.replace(f, batch_number=batch_number) for f in event.frames)
    return Localized(dataclasses.replace(event, batch_number=batch_number, frames=frames))


def compiled_callable(watched: torch.nn.Module) -> Optional[Callable[..., Any]]:
    """The compiled callable the user runs for `watched`, or None when nothing of it is
    compiled: the OptimizedModule at the root (inside DDP / DataParallel), the model itself when
    it or a submodule was compiled in place or replaced by a compiled one, else an
    OptimizedModule that wraps the model (`torch.compile(model)` called after `watch(model)`),
    found by one pass over the interpreter's objects, at a detection only."""
    root = watched
    while type(root).__name__ in ("DistributedDataParallel", "DataParallel"):
        inner = getattr(root, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        root = inner
    if type(root).__name__ == _OPTIMIZED:
        return root
    if any(type(m).__name__ == _OPTIMIZED or getattr(m, "_compiled_call_impl", None) is not None
           for m in root.modules()):
        return root
    frames = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(frames, _OPTIMIZED, None)
    if optimized is None:  # torch.compile never ran in this process: nothing wraps the model
        return None
    model = naming.unwrap_root(root)
    for obj in gc.get_objects():
        if issubclass(type(obj), optimized) and getattr(obj, "_orig_mod", None) is model:  # (no __class__ lookups)
            found: Callable[..., Any] = obj
            return found
    return None


def _replayable(held: BatchCapture, batch_number: int) -> bool:
    return _not_replayable(held, batch_number) is None


def _not_replayable(held: BatchCapture, batch_number: int) -> Optional[str]:
    """Why the held batch cannot be replayed (said once), or None."""
    _, _, rng = held.held(batch_number)
    if rng is None:
        return "not replayed: its inputs are not held"
    problems = held.changed(batch_number)
    if problems:
        return _say_skipped(held, batch_number, problems)
    return None


@contextlib.contextmanager
def _autocast(state: AutocastState) -> Iterator[None]:
    """The autocast state `state` (capture.autocast_state()) for every device type it or the
    caller's has enabled: the replay computes in the dtypes the batch computed in, wherever it
    runs (at optimizer.step(), outside the user's autocast region, or inside another one)."""
    held, cache = state
    dtypes = dict(held)
    now = autocast_state()[0]
    with contextlib.ExitStack() as stack:
        for device in dict.fromkeys([d for d, _ in held] + [d for d, _ in now]):
            dtype = dtypes.get(device)
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=dtype is not None, cache_enabled=cache))
        yield


def _replay(model: torch.nn.Module, held: BatchCapture, batch_number: int, run: Callable[[Args, Kwargs], Any],
            make_watcher: Optional[MakeWatcher], grad: bool) -> "_Replayed | str":
    """Runs `run(args, kwargs)` once on copies of the held inputs from the batch's start RNG
    state, under the autocast state the batch's call ran under; what it changes in `model`
    (core/batch/replay_state.py) and the RNG states are given back after. Else why not: it failed
    (said), or the model holds what could not be given back (said once: not replayed)."""
    _, _, rng = held.held(batch_number)
    assert rng is not None
    state = ReplayState(model)
    if state.problems:
        return _say_skipped(held, batch_number, [f"the model's {p}" for p in state.problems])
    saved_rng = torch.get_rng_state()
    saved_cuda = torch.cuda.get_rng_state_all() if "cuda" in rng else None
    probe = None
    try:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])
        args, kwargs = held.replay_inputs(batch_number)
        sink = FirstNonFinite()
        if make_watcher is not None:
            probe = make_watcher(model, sink)
        with torch.set_grad_enabled(grad), _autocast(held.autocast(batch_number)):
            out = run(args, kwargs)
            bad = _holds_nonfinite(out)
        drew_torch = not torch.equal(torch.get_rng_state(), rng["cpu"]) or (
            "cuda" in rng and any(not torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), rng["cuda"])))
        return _Replayed(sink.event, bad, drew_torch, state.drew())
    except Exception as exc:  # the replay must never hide the detection itself
        log.warning("tensorwatch_otel: could not re-run batch %d: %s: %s", batch_number,
                    type(exc).__name__, exc)
        return f"the replay failed ({type(exc).__name__})"
    finally:
        if probe is not None:
            probe.detach()
        left = state.restore()
        torch.set_rng_state(saved_rng)
        if saved_cuda is not None:
            torch.cuda.set_rng_state_all(saved_cuda)
        if left:
            log.log(logging.ERROR if held.first_time("left") else logging.DEBUG,
                    "tensorwatch_otel: the replay of batch %d (rerun_on_detect, or localizing a detection in an "
                    "unsampled batch) changed what it cannot give back: %s", batch_number, ", ".join(left[:8]))


def _holds_nonfinite(out: Any, depth: int = 0) -> bool:
    """Whether a floating tensor in `out` (tensors, lists, tuples, mappings, dataclass-like
    results' tensor attributes) holds inf/nan. Runs once per replay, not on the hot path."""
    if isinstance(out, torch.Tensor):
        if not (out.is_floating_point() or out.is_complex()):
            return False
        if transforms.active():  # a replay inside torch.func (vmap): read what the wrapper holds
            with transforms.set_aside():
                return bool(not torch.isfinite(transforms.plain(out).detach()).all())
        return bool(not torch.isfinite(out.detach()).all())
    if depth >= 16:
        return False
    if isinstance(out, (list, tuple)):
        return any(_holds_nonfinite(v, depth + 1) for v in out)
    if isinstance(out, Mapping):
        return any(_holds_nonfinite(v, depth + 1) for v in out.values())
    attrs = getattr(out, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(out, torch.nn.Module):
        return any(_holds_nonfinite(v, depth + 1) for v in attrs.values() if isinstance(v, torch.Tensor))
    return False


def _say_skipped(held: BatchCapture, batch_number: int, problems: List[str]) -> str:
    """One warning per watcher (its capture holder); later skips at debug level. Returns the
    note an event carries (`uncertain`)."""
    level = logging.WARNING if held.replay_skipped() == 1 else logging.DEBUG
    what = ", ".join(problems[:8]) + (f" and {len(problems) - 8} more" if len(problems) > 8 else "")
    log.log(level, "tensorwatch_otel: batch %d not replayed (rerun_on_detect, or localizing a detection in an "
            "unsampled batch): a replay would not see these inputs as the batch did, or could not give them "
            "back as it found them: %s", batch_number, what)
    return "not replayed: " + what


def _say_uncertain(held: BatchCapture, batch_number: int, why: str) -> str:
    """A replay that could not run the batch as it ran: said once per watcher at WARNING."""
    log.log(logging.WARNING if held.first_time(why) else logging.DEBUG,
            "tensorwatch_otel: the detection in batch %d is named where it was seen, not where it was born: %s",
            batch_number, why)
    return why


def replay_would_block(model: torch.nn.Module) -> bool:
    """A replay on one rank of a sharded model (FSDP) waits in collectives the other ranks
    never join: such models are not re-run."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    if sharded(model):
        log.warning("tensorwatch_otel: no replay (rerun_on_detect, or localizing a detection in an unsampled "
                    "batch): the model is sharded (FSDP) over several ranks, and a replay on this rank alone "
                    "would wait for the others")
        return True
    return False


def host() -> str:
    return socket.gethostname()
