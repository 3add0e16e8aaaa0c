"""The offending batch, captured (`capture_dir=`): the watched root's inputs of the current
batch are held by reference (no copy) with the RNG states at its start; only on a detection
are they moved to the CPU and written, a bounded number of files per process."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

MAX_CAPTURES = 8  # files written per process; a run that detects more keeps the first ones
MAX_BYTES = 2 << 30  # a batch larger than this is not written (said once)
FORMAT = "tensorwatch_otel.capture/1"


def _rng_states() -> dict:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _to_cpu(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", copy=True)
    if isinstance(v, (list, tuple)):
        return type(v)(_to_cpu(x) for x in v) if not hasattr(v, "_fields") else type(v)(*(_to_cpu(x) for x in v))
    if isinstance(v, dict):
        return {k: _to_cpu(x) for k, x in v.items()}
    return v


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_nbytes(x) for x in v)
    if isinstance(v, dict):
        return sum(_nbytes(x) for x in v.values())
    return 0


class BatchCapture:
    """Holds the current batch's inputs (references) and RNG states; writes them on demand."""

    def __init__(self, directory: str, rank: int):
        self.directory = directory
        self.rank = rank
        self.written = 0
        self._args = self._kwargs = None
        self._rng: Optional[dict] = None
        self._batch = -1
        self._said = False

    def hold(self, batch_number: int, args, kwargs) -> None:
        self._batch = batch_number
        self._args, self._kwargs = args, kwargs
        self._rng = _rng_states()

    def held(self, batch_number: int):
        """(args, kwargs, rng states) held for `batch_number`, or (None, None, None)."""
        if self._batch != batch_number:
            return None, None, None
        return self._args, self._kwargs, self._rng

    def write(self, batch_number: int) -> Optional[str]:
        """The captured inputs of `batch_number` as a file; None when not held or over the bounds."""
        if self._batch != batch_number or self._rng is None:
            return None
        if self.written >= MAX_CAPTURES or _nbytes((self._args, self._kwargs)) > MAX_BYTES:
            if not self._said:
                self._said = True
                log.warning("tensorwatch_otel: batch %d not captured (at most %d captures of %d bytes each)",
                            batch_number, MAX_CAPTURES, MAX_BYTES)
            return None
        try:
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"capture-rank{self.rank}-batch{batch_number}.pt")
            tmp = path + ".tmp"
            torch.save({"format": FORMAT, "batch_number": batch_number, "rank": self.rank,
                        "args": _to_cpu(self._args), "kwargs": _to_cpu(self._kwargs), "rng": self._rng}, tmp)
            os.replace(tmp, path)
        except Exception as exc:  # a full disk must not hide the detection itself
            log.error("tensorwatch_otel: could not write the capture of batch %d to %s: %s",
                      batch_number, self.directory, exc)
            return None
        self.written += 1
        return path


class Capture:
    """A captured batch: `.args`, `.kwargs`, `.batch_number`, `.rank`, and `.restore_rng()`."""

    def __init__(self, data: dict):
        self.args = tuple(data.get("args") or ())
        self.kwargs = dict(data.get("kwargs") or {})
        self.batch_number = int(data["batch_number"])
        self.rank = int(data.get("rank", 0))
        self._rng = data.get("rng") or {}

    def restore_rng(self) -> None:
        """Put the RNG states back as they were when the batch started (dropout replays)."""
        if "cpu" in self._rng:
            torch.set_rng_state(self._rng["cpu"])
        if "cuda" in self._rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self._rng["cuda"])


def load_capture(path: str) -> Capture:
    """Load a capture written on a detection (`event.capture`)."""
    data = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"load_capture: {path!r} is not a tensorwatch_otel capture")
    return Capture(data)
