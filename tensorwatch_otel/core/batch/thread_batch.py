"""The threads' batches: each thread's batch in progress (`ThreadBatch`, the state machine of its
`Phase`), held per thread (`PerThread`), and the one counter that numbers every thread's batches
(`BatchNumbers`). See core/batch/lifecycle.py's docstring for the phases and their moves.
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..record import Record
from ..history import History


class Phase(enum.Enum):
    """Where a thread's batch is (see the module's docstring)."""

    IDLE = "idle"
    RECORDING = "recording"
    UNSAMPLED = "unsampled"
    QUIET = "quiet"


class ThreadBatch:
    """One thread's batch in progress: the lifecycle's record of it.

    `phase`, with `recording` (phase is RECORDING) and `quiet` (phase is QUIET) kept beside it for
    the hooks to read without a comparison, and `rec` (the record being filled; None exactly when
    IDLE) change only through `open`, `close` and `carry_on`. The rest are counters and slots the
    lifecycle and its hooks keep up directly: `depth` (pre-hook +1, forward hook -1), `entry`
    (while QUIET: the outermost call's module, whose hooks stay on), `held` (open `batch()`
    blocks), `checked` (frames already checked inside `batch()`), `inputs` (the root's inputs
    waiting for a batch number) and `history` (the thread's finished records a detection ring
    reaches back into)."""

    __slots__ = ("phase", "recording", "quiet", "rec", "depth", "entry", "held", "checked", "inputs", "history")

    def __init__(self, max_frames: int) -> None:
        self.phase = Phase.IDLE
        self.recording = False
        self.quiet = False
        self.rec: Optional[Record] = None
        self.depth = 0
        self.entry: Optional[torch.nn.Module] = None
        self.held = 0
        self.checked = 0
        self.inputs: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]] = None
        self.history = History(max_frames)

    def open(self, rec: Record, phase: Phase) -> None:
        """IDLE -> `phase` (RECORDING, UNSAMPLED or QUIET): a batch begins, filling `rec`."""
        self._to(phase)
        self.rec = rec
        self.checked = 0

    def close(self) -> Record:
        """An open phase -> IDLE: the batch ends; returns its record."""
        rec = self.rec
        self._to(Phase.IDLE)
        assert rec is not None  # (open: _to refused IDLE -> IDLE)
        self.rec = None
        self.entry = None
        self.checked = 0
        return rec

    def carry_on(self, rec: Record) -> Record:
        """The open batch goes on filling `rec`; returns the record filled so far."""
        done = self.rec
        if done is None:
            raise RuntimeError("tensorwatch_otel: no batch is open to carry on")
        self.rec = rec
        return done

    def _to(self, phase: Phase) -> None:
        # the one place the phase (and the flags the hooks read) changes: IDLE <-> an open phase
        if (self.phase is Phase.IDLE) is (phase is Phase.IDLE):
            raise RuntimeError(f"tensorwatch_otel: batch phase {self.phase.name} -> {phase.name} is not a transition")
        self.phase = phase
        self.recording = phase is Phase.RECORDING
        self.quiet = phase is Phase.QUIET


class PerThread(threading.local):
    """`.st`: the calling thread's ThreadBatch, made on its first access in that thread."""

    def __init__(self, max_frames: int) -> None:
        self.st = ThreadBatch(max_frames)



class BatchNumbers:
    """The batches of one watcher, numbered with one counter for every thread; `on_second_thread`
    is called (under the counter's lock) when a thread other than the last one begins a batch."""

    def __init__(self, on_second_thread: Callable[[], None]) -> None:
        self._on_second_thread = on_second_thread
        self._lock = threading.Lock()
        self._batches = 0  # batches begun, by every thread: the next batch's number
        self._thread = 0  # the thread that began the last batch (a second one turns quiet batches off)

    @property
    def next(self) -> int:
        """Batches begun so far, by every thread: the next batch's number."""
        return self._batches

    def take(self) -> int:
        """A batch begins in the calling thread: its number."""
        with self._lock:  # one counter for every thread
            b = self._batches
            self._batches = b + 1
            thread = threading.get_ident()
            if self._thread != thread:
                if self._thread:
                    self._on_second_thread()
                self._thread = thread
        return b
