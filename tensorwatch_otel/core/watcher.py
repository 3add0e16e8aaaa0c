"""The watcher: what `watch()` returns, the public face of one watch's session (core/session.py:
the collaborators, hooks, recorder, batch lifecycle, detection, step monitor, sinks, built once and
in order); the batches themselves are core/batch/lifecycle.py's.

A batch ends when a thread's outermost watched call ends: the root's forward, as in
transformers.debug_utils (with gradient accumulation every micro-batch forward is a batch; eval
forwards count too, `generate()` one batch per decoding step), or, for a model used through
its submodules (`model.encode(...)`), each outermost submodule call; inside `with
watcher.batch():` every watched call of that thread is one batch, ended when the block ends.
Each thread has its own batch in progress; batch numbers come from one counter, taken when a
thread's batch starts. The sinks are given to it (the port in core/ports.py): the core imports no sink.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from types import TracebackType
from typing import Any, Dict, List, Literal, Optional, Sequence, Type

import torch

from .batch.behaviour import Behaviour
from .batch.lifecycle import BatchLifecycle
from .batch.thread_batch import ThreadBatch
from .config import WatchConfig
from .ports import Sink
from .session import Session

log = logging.getLogger(__name__)


class BatchScope:
    """What `Watcher.batch()` returns: a context manager, re-entrant, for the calling thread."""

    __slots__ = ("_watcher", "_life", "_state")

    def __init__(self, watcher: "Watcher", life: BatchLifecycle) -> None:
        self._watcher = watcher
        self._life = life
        self._state: List[ThreadBatch] = []

    def __enter__(self) -> "Watcher":
        self._state.append(self._life.hold())
        return self._watcher

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> Literal[False]:
        self._life.release(self._state.pop(), exc_type is not None)
        return False


# Watchers alive in this process, for detect_overflow(); weak so a dropped watcher goes away.
ACTIVE: "weakref.WeakSet[Watcher]" = weakref.WeakSet()


class Watcher:
    """Hooks on every (included) module of `model`; see `watch()`. A context manager. Its
    collaborators are its session's (core/session.py)."""

    def __init__(self, model: torch.nn.Module, sinks: Sequence[Sink], config: WatchConfig,
                 owned_sinks: Sequence[Sink] = (), behaviour: Optional[Behaviour] = None,
                 grad_scaler: Any = None, local: bool = False) -> None:
        """`local`: a replay's probe; its detections are not published to the other ranks."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.config = config
        self.behaviour = behaviour or Behaviour()
        self.grad_scaler = grad_scaler
        self._owned = list(owned_sinks)
        self._lock = threading.Lock()
        self._session = Session(model, sinks, config, self.behaviour, grad_scaler, local, self._probe)
        self._session.attach()
        ACTIVE.add(self)

    # ---------------------------------------------------------------- lifetime
    def detach(self) -> None:
        """Remove every hook, flush the sinks and close those the watcher created. Idempotent."""
        with self._lock:
            if not self._session.attached:
                return
            self._session.attached = False
        ACTIVE.discard(self)
        self._session.detach(self._owned)

    close = detach

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self._session.fleet.at_exit()  # multi-rank: a stop held for a later stop point is raised now
        finally:
            self.detach()

    @property
    def attached(self) -> bool:
        """Its hooks are on the model (between watch() and detach())."""
        return self._session.attached

    @property
    def hook_failures(self) -> int:
        """Module calls and gradients the hooks could not record so far (the first said at ERROR;
        training goes on)."""
        return self._session.failures.count

    @property
    def sinks(self) -> List[Sink]:
        return self._session.fanout.sinks

    @property
    def sink_failures(self) -> Dict[str, int]:
        """Failures per sink method, counted since the watcher was built."""
        return dict(self._session.fanout.failures)

    @property
    def batch_number(self) -> int:
        """The number of the calling thread's batch in progress; between its batches, the number
        the next batch takes (the batches begun so far, by every thread)."""
        return self._session.life.batch_number()

    def batch(self) -> BatchScope:
        """A context manager: every watched call inside it (in the calling thread) is one batch.

        Use it when one step calls several submodules directly, or to count a forward, its
        backward and the optimizer step as one batch. Nested blocks are the same batch; it ends
        when the outermost block ends, even on an exception (the exception goes on unchanged;
        the frames are still recorded). Each outermost call inside it is still checked as it
        ends, so a detection raises there, before the backward or the step that would follow.
        A block in which no watched call ran takes no batch number.

        Example::

            with watcher.batch():
                loss = model.head(model.encoder(x)).sum()
                loss.backward()
                optimizer.step()
        """
        return BatchScope(self, self._session.life)

    @property
    def measure_every_n_batches(self) -> int:
        """The watcher measures one batch in this many: every_n_batches, or the interval
        max_overhead chose last. Detection runs on every batch."""
        return self._session.sampling.every_n_batches

    @property
    def overhead(self) -> Optional[float]:
        """With max_overhead: the watcher's share of the step time over the last complete
        interval (its seconds over the rest of the step's); None without a budget, or before
        one interval is complete."""
        return self._session.sampling.overhead

    def _probe(self, model: torch.nn.Module, sink: Sink) -> "Watcher":
        """A silent watcher that checks every module as it returns (for a replay): the modules,
        frames and statistics this watcher records, every batch, forwards only."""
        config = dataclasses.replace(self.config, check="module", on_detect="report", every_n_batches=1,
                                     trace_batches=frozenset(), abort_after_batch=None, gradients=False,
                                     optimizer_state=False, capture_dir=None, rerun_on_detect=False,
                                     guard_steps=False, strict=False, max_overhead=None)
        return Watcher(model, [sink], config, local=True)

    # ---------------------------------------------------------------- gradients and steps
    @property
    def steps_skipped(self) -> int:
        """Optimizer steps skipped so far (non-finite gradients no step consumed)."""
        return self._session.steps.steps_skipped

    @property
    def nonfinite_steps_skipped(self) -> int:
        """Optimizer steps the watcher skipped so far (on_detect="skip")."""
        return self._session.steps.nonfinite_steps_skipped

    @property
    def detections(self) -> int:
        """Detections made so far."""
        return self._session.detection.detections

    def overflow_check(self, event: object) -> None:
        """Hand a detect_overflow() finding to the sinks (durable before returning)."""
        self._session.detection.overflow_check(event)
