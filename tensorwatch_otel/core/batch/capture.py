"""The offending batch, captured (`capture_dir=`): the watched root's inputs of the current
batch are held by reference (tensors are not copied: their containers are, and each tensor's
version) with the RNG states at its start; only on a detection are they moved to the CPU and
written, a bounded number of files per process. The same held inputs feed `rerun_on_detect`'s
replay and the replay that localizes a detection in an unsampled batch (`every_n_batches`), as
copies, and only when the forward did not change them in place, with the autocast state the
call ran under. They are let go at the next batch, at a detection that raises, and at detach."""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch

log = logging.getLogger(__name__)

MAX_CAPTURES = 8  # files written per process; a run that detects more keeps the first ones
MAX_BYTES = 2 << 30  # a batch larger than this is not written (said once)
FORMAT = "tensorwatch_otel.capture/1"


# Autocast is per device type; these are torch's (a replay re-enters the held state of each)
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla")
#: the autocast state a root call ran under: ((device type, dtype) for each one enabled, cache
#: flag); ((), True) when autocast was off
AutocastState = Tuple[Tuple[Tuple[str, torch.dtype], ...], bool]
_AUTOCAST_OFF: AutocastState = ((), True)


def autocast_state() -> AutocastState:
    """The calling thread's autocast state (one call when autocast is off)."""
    if not torch._C._is_any_autocast_enabled():
        return _AUTOCAST_OFF
    return (tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)),
            torch.is_autocast_cache_enabled())


def _rng_states() -> Dict[str, Any]:
    states: Dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


# What a capture holds, and all that load_capture() reads without trusting the file: plain
# tensors (moved to the CPU), lists, tuples and dicts of them, and these plain values.
# Anything else (a DynamicCache, a dataclass, a tensor subclass, any object) is written as None
# and named in the file's "not_captured" list (and logged once): unpickling such an object can
# run code from the file, so the safe loader could not read it back.
_PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_KEYS = (str, int, float, bool, type(None))
_MAX_DEPTH = 32
_CHANGED = " (changed in place by the forward)"


def _safe(v: Any, where: str, skipped: List[str], depth: int = 0) -> Any:
    """`v` as a capture holds it: tensors on the CPU, namedtuples as tuples, mappings as dicts;
    what cannot be held safely becomes None and is listed in `skipped`."""
    if isinstance(v, torch.Tensor):
        if type(v) in (torch.Tensor, torch.nn.Parameter):
            return v.detach().to("cpu", copy=True)
    elif isinstance(v, _PLAIN_VALUES):
        return v
    elif depth < _MAX_DEPTH:
        if isinstance(v, (list, tuple)):
            items = [_safe(x, f"{where}[{i}]", skipped, depth + 1) for i, x in enumerate(v)]
            return items if isinstance(v, list) else tuple(items)
        if isinstance(v, Mapping) and all(isinstance(k, _KEYS) for k in v):
            return {k: _safe(x, f"{where}[{k!r}]", skipped, depth + 1) for k, x in v.items()}
    skipped.append(f"{where}: {type(v).__name__}")
    return None


def _shape(v: Any) -> str:
    """How the held inputs treat a value: "tensor", "plain" (immutable), "list", "tuple",
    "namedtuple", "dict" (exactly these containers are copied and walked), or "other"."""
    if isinstance(v, torch.Tensor):
        return "tensor"
    if isinstance(v, _PLAIN_VALUES):
        return "plain"
    tp = type(v)
    if tp is list or tp is tuple or tp is dict:
        return tp.__name__
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return "namedtuple"
    return "other"


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _rebuild(v: Any, shape: str, items: List[Any]) -> Any:
    if shape == "list":
        return items
    if shape == "tuple":
        return tuple(items)
    return type(v)(*items)


def _skeleton(v: Any, versions: List[int], depth: int = 0) -> Any:
    """`v` with its lists, tuples and dicts copied (a forward that appends to a list the caller
    passed does not change what is held) and its tensors by reference, each one's version
    appended to `versions` (a forward that writes a tensor in place is seen at the replay).
    Other objects (a DynamicCache, a dataclass) are held as they are."""
    shape = _shape(v)
    if shape == "tensor":
        versions.append(_version(v))
        return v
    if shape in ("plain", "other") or depth >= _MAX_DEPTH:
        return v
    if shape == "dict":
        return {k: _skeleton(x, versions, depth + 1) for k, x in v.items()}
    return _rebuild(v, shape, [_skeleton(x, versions, depth + 1) for x in v])


def _unchanged(v: Any, versions: Iterator[int], where: str, problems: List[str], depth: int = 0) -> None:
    """Walk a skeleton as _skeleton did: name each tensor whose version moved since it was held,
    and each object a replay could change and not give back (anything but tensors, plain values
    and the containers _skeleton copies)."""
    shape = _shape(v)
    if shape == "tensor":
        if _version(v) != next(versions, None):
            problems.append(f"{where}{_CHANGED}")
    elif shape == "other" or (depth >= _MAX_DEPTH and shape != "plain"):
        problems.append(f"{where}: {type(v).__name__}")
    elif shape == "dict":
        for k, x in v.items():
            _unchanged(x, versions, f"{where}[{k!r}]", problems, depth + 1)
    elif shape != "plain":
        for i, x in enumerate(v):
            _unchanged(x, versions, f"{where}[{i}]", problems, depth + 1)


def _replay_copy(v: Any, depth: int = 0) -> Any:
    """A skeleton that passed _unchanged, with every tensor cloned and every container new:
    what the replay may change."""
    shape = _shape(v)
    if shape == "tensor":
        return v.detach().clone()
    if shape in ("plain", "other") or depth >= _MAX_DEPTH:
        return v
    if shape == "dict":
        return {k: _replay_copy(x, depth + 1) for k, x in v.items()}
    return _rebuild(v, shape, [_replay_copy(x, depth + 1) for x in v])


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(_nbytes(x) for x in v)
    if isinstance(v, Mapping):
        return sum(_nbytes(x) for x in v.values())
    return 0


class BatchCapture:
    """Holds the current batch's inputs (references) and RNG states; writes them on demand."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = directory
        self.rank = rank
        self.written = 0
        self._args: Any = None
        self._kwargs: Any = None
        self._versions: Optional[List[int]] = []
        self._rng: Optional[Dict[str, Any]] = None
        self._autocast = _AUTOCAST_OFF
        self._batch = -1
        self._said = False
        self._said_skipped = False
        self._said_once: Set[str] = set()
        self.replays_skipped = 0

    def hold(self, batch_number: int, args: Any, kwargs: Any) -> None:
        """The inputs of a root call of batch `batch_number` (its last one), by reference, the
        RNG states at its start and the autocast state it runs under."""
        self._batch = batch_number
        versions: List[int] = []
        try:
            self._args, self._kwargs = _skeleton(args, versions), _skeleton(kwargs, versions)
            self._versions = versions
        except Exception as exc:  # an odd container must not stop training; no replay of it
            self._args, self._kwargs, self._versions = args, kwargs, None
            log.debug("tensorwatch_otel: inputs held as they are (%s: %s)", type(exc).__name__, exc)
        self._rng = _rng_states()
        self._autocast = autocast_state()

    def release(self) -> None:
        """Let the held inputs go (a detection that raises, detach): nothing of the batch stays
        alive through the watcher."""
        self._args = self._kwargs = self._rng = None
        self._versions = []
        self._autocast = _AUTOCAST_OFF
        self._batch = -1

    def held(self, batch_number: int) -> Tuple[Any, Any, Optional[Dict[str, Any]]]:
        """(args, kwargs, rng states) held for `batch_number`, or (None, None, None)."""
        if self._batch != batch_number:
            return None, None, None
        return self._args, self._kwargs, self._rng

    def changed(self, batch_number: int) -> List[str]:
        """The held inputs of `batch_number` a replay cannot see as they were, or give back as
        it found them: tensors the forward wrote in place, and objects other than tensors,
        containers and plain values (`"kwargs['past_key_values']: DynamicCache"`)."""
        if self._batch != batch_number:
            return []
        if self._versions is None:
            return ["the inputs (a container that could not be copied)"]
        problems: List[str] = []
        versions = iter(self._versions)
        _unchanged(tuple(self._args or ()), versions, "args", problems)
        _unchanged(dict(self._kwargs or {}), versions, "kwargs", problems)
        return problems

    def autocast(self, batch_number: int) -> AutocastState:
        """The autocast state the held root call of `batch_number` ran under."""
        return self._autocast if self._batch == batch_number else _AUTOCAST_OFF

    def first_time(self, what: str) -> bool:
        """True the first time this holder (one per watcher) is asked about `what`: a replay's
        note is said once at WARNING, later at debug level."""
        if what in self._said_once:
            return False
        self._said_once.add(what)
        return True

    def replay_skipped(self) -> int:
        """Count a replay skipped for `changed()` inputs; the count so far."""
        self.replays_skipped += 1
        return self.replays_skipped

    def replay_inputs(self, batch_number: int) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """Copies of the held (args, kwargs) of `batch_number` for a replay to consume."""
        return _replay_copy(tuple(self._args or ())), _replay_copy(dict(self._kwargs or {}))

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
            skipped: List[str] = []
            args = _safe(tuple(self._args or ()), "args", skipped)
            kwargs = _safe(dict(self._kwargs or {}), "kwargs", skipped)
            torch.save({"format": FORMAT, "batch_number": batch_number, "rank": self.rank, "args": args,
                        "kwargs": kwargs, "rng": self._rng, "not_captured": skipped}, tmp)
            os.replace(tmp, path)
        except Exception as exc:  # a full disk must not hide the detection itself
            log.error("tensorwatch_otel: could not write the capture of batch %d to %s: %s",
                      batch_number, self.directory, exc)
            return None
        self.written += 1
        changed = [p for p in self.changed(batch_number) if p.endswith(_CHANGED)]
        if (skipped or changed) and not self._said_skipped:
            self._said_skipped = True
            if skipped:
                log.warning("tensorwatch_otel: inputs not captured in %s (a capture holds only tensors, lists, "
                            "tuples and dicts of them and plain values; these are written as None and a "
                            "replay must supply them): %s", path, ", ".join(skipped))
            if changed:
                log.warning("tensorwatch_otel: the forward changed inputs in place; %s holds them as the "
                            "forward left them, not as the batch began: %s", path, ", ".join(changed))
        return path


class Capture:
    """A captured batch: `.args`, `.kwargs`, `.batch_number`, `.rank`, `.restore_rng()`, and
    `.not_captured`: the inputs written as None because a capture cannot hold them safely
    (`"kwargs['past_key_values']: DynamicCache"`)."""

    def __init__(self, data: Dict[str, Any]) -> None:
        self.args = tuple(data.get("args") or ())
        self.kwargs = dict(data.get("kwargs") or {})
        self.batch_number = int(data["batch_number"])
        self.rank = int(data.get("rank", 0))
        self.not_captured = tuple(str(s) for s in data.get("not_captured") or ())
        self._rng = data.get("rng") or {}

    def restore_rng(self) -> None:
        """Put the RNG states back as they were when the batch started (dropout replays)."""
        if "cpu" in self._rng:
            torch.set_rng_state(self._rng["cpu"])
        if "cuda" in self._rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self._rng["cuda"])


_BOILERPLATE = ("Weights only load failed", "Check the documentation", "Please file an issue", "Re-running")


def _reason(exc: BaseException) -> str:
    """The line of torch's error that says what was wrong (not its advice to load unsafely)."""
    for line in str(exc).splitlines():
        line = line.split("WeightsUnpickler error:")[-1].strip()
        if line and not line.startswith(_BOILERPLATE):
            return line if len(line) <= 200 else line[:200] + "..."
    return type(exc).__name__


def load_capture(path: str, *, trusted: bool = False) -> Capture:
    """Load a capture written on a detection (`event.capture`).

    The file is read with torch's weights-only unpickler: only tensors, lists, tuples, dicts and
    plain values (numbers, strings, None, dtypes, devices, sizes) are rebuilt, so a pickled
    object placed in the file cannot run code. A file holding anything else is refused with a
    ValueError; `trusted=True` unpickles it fully: only for a file from a source you trust, as
    that runs whatever code the file names. A damaged file (truncated, not a capture) is a
    ValueError naming it as well."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=not trusted)
    except OSError:
        raise
    except pickle.UnpicklingError as exc:
        if not trusted and "GLOBAL" in str(exc):
            raise ValueError(
                f"load_capture: {path!r} holds objects other than tensors, containers and plain values, and "
                f"unpickling them could run code from the file, so it was not loaded ({_reason(exc)}). "
                f"Only for a file from a source you trust: load_capture(path, trusted=True)") from None
        raise ValueError(f"load_capture: {path!r} cannot be read as a tensorwatch_otel capture (damaged or "
                         f"not a capture file): {_reason(exc)}") from None
    except Exception as exc:  # truncated zip, random bytes, an empty file: torch raises many kinds
        raise ValueError(f"load_capture: {path!r} cannot be read as a tensorwatch_otel capture (damaged or "
                         f"not a capture file): {type(exc).__name__}: {_reason(exc)}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"load_capture: {path!r} is not a tensorwatch_otel capture")
    try:
        return Capture(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"load_capture: {path!r} is not a complete tensorwatch_otel capture: "
                         f"{type(exc).__name__}: {exc}") from None
