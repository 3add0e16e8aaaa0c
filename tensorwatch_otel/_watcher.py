"""The watcher: forward hooks that record a frame per module call, read the batch's statistics
back in one host transfer when the root module's forward ends, and hand events to the sinks.

A batch is one finished forward of the watched (root) module, as in transformers.debug_utils:
with gradient accumulation every micro-batch forward is a batch; eval forwards count too, and
`generate()` counts one batch per decoding step (every call of the model's forward).
"""

from __future__ import annotations

import bisect
import fnmatch
import logging
import math
import os
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _naming
from ._config import WatchConfig
from ._events import (
    NOTE_NONE,
    NOTE_NOT_TENSOR,
    AbortAfterBatchEvent,
    BatchStats,
    BatchTraceEvent,
    Frame,
    NonFiniteEvent,
    TensorStat,
    merge_kinds,
)
from ._stats import DTYPE_MAX, dtype_name, measure
from .sinks._base import Sink, SinkFanout

log = logging.getLogger("tensorwatch_otel")

_MAX_PENDING = 2_000_000  # stat slots held before an early read-back (no root forward seen)
_MAX_ITEMS = 256  # tensors looked at per container, so odd outputs stay bounded
_MAX_DEPTH = 6
_WEIGHT_REFRESH = 32  # batches between full weight re-measurements (see _end_batch)

# Watchers alive in this process, for detect_overflow(); weak so a dropped watcher goes away.
_ACTIVE: "weakref.WeakSet[Watcher]" = weakref.WeakSet()


class NonFiniteDetected(ValueError):
    """Raised (with on_detect="raise") once inf/nan was found and every sink has recorded it."""

    def __init__(self, message: str, event: NonFiniteEvent):
        super().__init__(message)
        self.event = event


class AbortAfterBatch(ValueError):
    """Raised after the batch named by abort_after_batch has finished."""


def current_rank() -> int:
    """Global rank: torch.distributed when initialised, else $RANK, else 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _ModuleInfo:
    __slots__ = ("path", "cls", "params", "kw_names", "is_root", "recorded")

    def __init__(self, path: str, module: torch.nn.Module, is_root: bool, recorded: bool):
        self.path = path
        self.cls = type(module).__name__
        self.params = module._parameters  # live dict: a replaced parameter is seen at once
        self.kw_names: Dict[str, str] = {}
        self.is_root = is_root
        self.recorded = recorded


class _Record:
    """One batch: device stats in call order, and per frame (info, items, first slot)."""

    __slots__ = ("batch_number", "stats", "dtypes", "frames", "host", "phase", "detected")

    def __init__(self, batch_number: int, phase: str = "forward"):
        self.batch_number = batch_number
        self.stats: List[torch.Tensor] = []  # abs_min, abs_max, abs_min, ... (0-d, on device)
        self.dtypes: List[torch.dtype] = []  # one per measured tensor
        self.frames: List[tuple] = []  # (info, items, first tensor index)
        self.host: List[float] = []
        self.phase = phase
        self.detected = False  # one detection per record (check="module" checks every frame)

    def materialize(self, lo: int = 0, hi: Optional[int] = None) -> Tuple[Frame, ...]:
        host, dtypes = self.host, self.dtypes
        out = []
        frames = self.frames
        hi = len(frames) if hi is None else hi
        for idx in range(lo, hi):
            info, items, k = frames[idx]
            stats = []
            for it in items:
                if it.__class__ is str:
                    mn, mx, dt = host[2 * k], host[2 * k + 1], dtypes[k]
                    k += 1
                    top = DTYPE_MAX.get(dt)
                    used = mx / top if top and mx == mx else None
                    stats.append(TensorStat(it, mn, mx, dtype_name(dt), "", used))
                else:
                    stats.append(TensorStat(it[0], None, None, "", it[1]))
            out.append(Frame(info.path, info.cls, tuple(stats), self.batch_number,
                             batch_start=(idx == 0 and self.phase == "forward"), phase=self.phase))
        return tuple(out)


class Watcher:
    """Hooks on every (included) module of `model`; see `watch()`. A context manager."""

    def __init__(self, model: torch.nn.Module, sinks: Sequence[Sink], config: WatchConfig,
                 owned_sinks: Sequence[Sink] = (), _compat: bool = False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.config = config
        self.batch_number = 0
        self.detections = 0
        self._fanout = SinkFanout(sinks, strict=config.strict)
        self._owned = list(owned_sinks)
        self._compat = _compat
        self._handles: list = []
        self._lock = threading.Lock()
        self._attached = False
        self._root_depth = 0
        self._params_seen: Dict[torch.Tensor, tuple] = {}  # param -> (version, (mn, mx), dtype)
        # Replaced parameters (functional_call, FSDP-style swaps, re-created weights) would stay
        # alive as keys: past this size the cache is dropped at a batch end and simply refilled.
        self._params_cap = 2 * sum(1 for _ in model.parameters()) + 64
        self._acts_seen: Dict[int, tuple] = {}  # id -> (weakref, version, (mn, mx), dtype)
        self._rec = _Record(0)
        # finished batches, newest last, kept while the newer ones hold fewer than max_frames frames
        self._history: List[_Record] = []
        self._grad_rec: Optional[_Record] = None
        self._active = self._watches(0)
        self._failed_hooks = 0
        self._hook_error_logged = False
        self._attach()

    # ---------------------------------------------------------------- lifetime
    def _attach(self) -> None:
        cfg = self.config
        seen = set()
        for path, module in self.model.named_modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            is_root = module is self.model
            recorded = self._included(path)
            if not (recorded or is_root):
                continue
            info = _ModuleInfo(path, module, is_root, recorded)
            if is_root:
                self._handles.append(module.register_forward_pre_hook(self._root_pre_hook))
            self._handles.append(module.register_forward_hook(
                self._make_hook(info), with_kwargs=True, always_call=True))
            if cfg.gradients and recorded:
                for name, p in module.named_parameters(recurse=False):
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(
                            self._make_grad_hook(info, name + ".grad")))
        self._attached = True
        _ACTIVE.add(self)

    def _included(self, path: str) -> bool:
        cfg = self.config
        label = path or "(root)"
        if cfg.include and not any(fnmatch.fnmatchcase(label, p) for p in cfg.include):
            return False
        return not any(fnmatch.fnmatchcase(label, p) for p in cfg.exclude)

    def detach(self) -> None:
        """Remove every hook, flush the sinks and close those the watcher created. Idempotent."""
        with self._lock:
            if not self._attached:
                return
            self._attached = False
            handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        _ACTIVE.discard(self)
        self._fanout.flush(self.config.flush_timeout_s)
        for s in self._owned:
            try:
                s.close()
            except Exception as exc:  # closing must not raise into user code
                log.warning("tensorwatch_otel: closing %s failed: %s", type(s).__name__, exc)
        self._params_seen.clear()
        self._acts_seen.clear()

    close = detach

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    @property
    def sinks(self) -> List[Sink]:
        return self._fanout.sinks

    @property
    def sink_failures(self) -> Dict[str, int]:
        """Failures per sink method, counted since the watcher was built."""
        return dict(self._fanout.failures)

    def _watches(self, batch: int) -> bool:
        cfg = self.config
        return batch % cfg.every_n_batches == 0 or batch in cfg.trace_batches

    # ---------------------------------------------------------------- hot path
    def _make_hook(self, info: _ModuleInfo):
        def hook(module, args, kwargs, output):
            if self._active and info.recorded and torch._C._current_graph_task_id() == -1 \
                    and not torch.compiler.is_compiling():
                # -1: not inside backward, so this is no checkpoint recomputation
                try:
                    with torch.no_grad():
                        self._record_frame(info, args, kwargs, output)
                except Exception as exc:  # a frame we cannot take must not stop training
                    self._hook_failed(info, exc)
                if self.config.check == "module":
                    self._readback(self._rec)
                    try:
                        self._check(self._rec, len(self._rec.frames) - 1)
                    finally:  # a detection in the root's own frame must still end the batch
                        if info.is_root:
                            self._root_depth = max(self._root_depth - 1, 0)
                            if self._root_depth == 0:
                                self._end_batch()
                    if info.is_root:
                        return
                elif len(self._rec.stats) > _MAX_PENDING:
                    self._readback(self._rec)
            if info.is_root:
                self._root_depth -= 1
                if self._root_depth <= 0:
                    self._root_depth = 0
                    self._end_batch()
        return hook

    def _root_pre_hook(self, module, args):
        self._root_depth += 1

    def _hook_failed(self, info: _ModuleInfo, exc: Exception) -> None:
        self._failed_hooks += 1
        if not self._hook_error_logged:
            self._hook_error_logged = True
            log.error("tensorwatch_otel: could not record %s (%s): %s: %s; training goes on, "
                      "further failures are counted", info.path or "(root)", info.cls,
                      type(exc).__name__, exc)

    def _record_frame(self, info: _ModuleInfo, args, kwargs, output) -> None:
        rec = self._rec
        items: list = []
        start = len(rec.dtypes)
        tensor = self._tensor
        for name, p in info.params.items():
            if p is not None:
                self._param(rec, p, name, items)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                tensor(rec, a, _naming.input_name(i), items)
            elif self._compat:
                items.append((_naming.input_name(i), NOTE_NONE if a is None else NOTE_NOT_TENSOR))
            else:
                self._value(rec, a, _naming.input_name(i), items, 0)
        if kwargs and not self._compat:
            kw_names = info.kw_names
            for k, v in kwargs.items():
                name = kw_names.get(k)
                if name is None:
                    name = kw_names[k] = f"input.{k}"
                self._value(rec, v, name, items, 0)
        if isinstance(output, torch.Tensor):
            tensor(rec, output, "output", items)
        elif self._compat:
            self._compat_output(rec, output, items)
        else:
            self._value(rec, output, "output", items, 0)
        rec.frames.append((info, items, start))

    def _compat_output(self, rec: _Record, output, items: list) -> None:
        """The peer's view: a tensor, a tuple, or one nested tuple level; else a note."""
        if isinstance(output, tuple):
            for i, x in enumerate(output):
                if isinstance(x, tuple):
                    for j, y in enumerate(x):
                        self._compat_leaf(rec, y, _naming.output_nested(i, j), items)
                else:
                    self._compat_leaf(rec, x, _naming.output_name(i), items)
        else:
            self._compat_leaf(rec, output, "output", items)

    def _compat_leaf(self, rec: _Record, x, name: str, items: list) -> None:
        if isinstance(x, torch.Tensor):
            self._tensor(rec, x, name, items)
        else:
            items.append((name, NOTE_NONE if x is None else NOTE_NOT_TENSOR))

    def _value(self, rec: _Record, v, name: str, items: list, depth: int) -> None:
        """Any input/output value: tensors are measured, containers walked, others noted."""
        if isinstance(v, torch.Tensor):
            self._tensor(rec, v, name, items)
        elif v is None:
            items.append((name, NOTE_NONE))
        elif depth >= _MAX_DEPTH:
            items.append((name, NOTE_NOT_TENSOR))
        elif isinstance(v, (tuple, list)):
            child = _naming.child
            for i, x in enumerate(v[:_MAX_ITEMS]):
                self._value(rec, x, child(name, i), items, depth + 1)
        elif isinstance(v, dict):  # includes transformers' ModelOutput
            child = _naming.child
            for n, (k, x) in enumerate(v.items()):
                if n >= _MAX_ITEMS:
                    break
                self._value(rec, x, child(name, k if isinstance(k, str) else str(k)), items, depth + 1)
        else:
            fields = _naming.dataclass_fields(v)
            if fields:
                child = _naming.child
                for f in fields[:_MAX_ITEMS]:
                    self._value(rec, getattr(v, f, None), child(name, f), items, depth + 1)
            else:
                items.append((name, NOTE_NOT_TENSOR))

    def _param(self, rec: _Record, p: torch.Tensor, name: str, items: list) -> None:
        # Weights change only at the optimizer step: measure again only when _version moved.
        seen = self._params_seen.get(p)
        version = p._version
        if seen is not None and seen[0] == version:
            rec.stats += seen[1]
            rec.dtypes.append(seen[2])
            items.append(name)
            return
        r = measure(p)
        if r.__class__ is str:
            items.append((name, r))
            return
        self._params_seen[p] = (version, r, p.dtype)
        rec.stats += r
        rec.dtypes.append(p.dtype)
        items.append(name)

    def _tensor(self, rec: _Record, t: torch.Tensor, name: str, items: list) -> None:
        # One module's output is the next one's input: the same object at the same version is
        # measured once. The weak reference guards against id() reuse after a tensor is freed.
        key = id(t)
        seen = self._acts_seen.get(key)
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            rec.stats += seen[2]
            rec.dtypes.append(seen[3])
            items.append(name)
            return
        r = measure(t)
        if r.__class__ is str:
            items.append((name, r))
            return
        try:
            self._acts_seen[key] = (weakref.ref(t), t._version, r, t.dtype)
        except (TypeError, RuntimeError):  # no weakref / no version (inference tensors): no reuse
            pass
        rec.stats += r
        rec.dtypes.append(t.dtype)
        items.append(name)

    # ---------------------------------------------------------------- batch end
    def _readback(self, rec: _Record) -> None:
        """Bring the not yet read stats of `rec` to the host: one transfer."""
        stats = rec.stats
        have = len(rec.host)
        if have >= len(stats):
            return
        pending = stats[have:] if have else stats
        try:
            stacked = torch.stack(pending)
        except RuntimeError:  # stats on several devices (a model split over GPUs)
            stacked = torch.stack([s.to("cpu") for s in pending])
        rec.host += stacked.to("cpu", copy=True).tolist()

    def _end_batch(self) -> None:
        rec = self._rec
        b = self.batch_number
        self.batch_number = b + 1
        self._rec = _Record(b + 1)
        self._active = self._attached and self._watches(b + 1)
        self._acts_seen.clear()
        if len(self._params_seen) > self._params_cap or self.batch_number % _WEIGHT_REFRESH == 0:
            # replaced parameters must not stay alive; and writes through `.data` do not move
            # _version, so every weight is measured afresh now and then
            self._params_seen.clear()
        if rec.frames:
            self._readback(rec)
            try:
                self._finish(rec)
            finally:  # a batch that raised NonFiniteDetected still precedes the next ring
                self._keep(rec)
        cfg = self.config
        if cfg.abort_after_batch is not None and self.batch_number > cfg.abort_after_batch:
            self._abort()

    def _finish(self, rec: _Record) -> None:
        cfg = self.config
        traced = rec.batch_number in cfg.trace_batches
        rank = current_rank()
        if self._fanout.wants_batches:
            self._fanout.on_batch(BatchStats(rec.batch_number, rank, time.time(), rec))
        if traced:
            self._fanout.on_event(BatchTraceEvent(rec.batch_number, rank, rec.materialize(), time.time()))
        if cfg.check == "batch" and not (traced and self._compat):
            self._check(rec, 0)  # (the peer turns detection off in traced batches)

    def _check(self, rec: _Record, first_frame: int) -> None:
        """Detect inf/nan in frames[first_frame:] of `rec` (their stats are on the host)."""
        if first_frame < 0 or first_frame >= len(rec.frames) or rec.detected:
            return
        start = rec.frames[first_frame][2] * 2
        host = rec.host
        if math.isfinite(sum(host[start:])):
            return
        bad = next((i for i in range(start, len(host)) if not math.isfinite(host[i])), None)
        if bad is None:
            return  # the sum overflowed; every value is finite
        starts = [f[2] for f in rec.frames]
        fi = bisect.bisect_right(starts, bad // 2) - 1
        self._detected(rec, fi)

    def _ring(self, rec: _Record, fi: int) -> Tuple[Frame, ...]:
        """The last max_frames frames ending with frame `fi` of `rec`, oldest first."""
        n = self.config.max_frames
        frames = rec.materialize(max(0, fi + 1 - n), fi + 1)
        missing = n - len(frames)
        if rec.phase == "forward":
            # the ring spans batch boundaries, like the peer's deque (as many batches as fit)
            for prev in reversed(self._history):
                if missing <= 0 or (self._compat and prev.batch_number in self.config.trace_batches):
                    break  # (the peer's buffer starts empty after a traced batch: already printed)
                if prev is not rec:
                    older = prev.materialize(max(0, len(prev.frames) - missing))
                    frames = older + frames
                    missing -= len(older)
        return frames

    def _keep(self, rec: _Record) -> None:
        hist = self._history
        hist.append(rec)
        total = sum(len(r.frames) for r in hist)
        while len(hist) > 1 and total - len(hist[0].frames) >= self.config.max_frames:
            total -= len(hist.pop(0).frames)

    def _detected(self, rec: _Record, fi: int) -> None:
        rec.detected = True
        frames = self._ring(rec, fi)
        last = frames[-1]
        first = last.first_nonfinite()
        event = NonFiniteEvent(
            batch_number=rec.batch_number, rank=current_rank(), module=last.module,
            module_class=last.module_class, tensor=first.name if first else "",
            kind=merge_kinds(last.kind) or "nan", frames=frames, time=time.time())
        self.detections += 1
        self._fanout.on_event(event)
        if self.config.on_detect == "raise":
            self._fanout.flush(self.config.flush_timeout_s)
            # drop what the aborted batch left behind so a caught exception leaves a clean state
            self._acts_seen.clear()
            raise NonFiniteDetected(self._detection_message(event), event)

    def _detection_message(self, event: NonFiniteEvent) -> str:
        if self._compat:
            return ("DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running further. "
                    "Please scroll up above this traceback to see the activation values prior to this event.")
        where = event.module or "(root)"
        return (f"tensorwatch_otel: {event.kind} in {where} ({event.module_class}) {event.tensor} during "
                f"batch_number={event.batch_number}; the report above shows the frames that led to it")

    def _abort(self) -> None:
        cfg = self.config
        event = AbortAfterBatchEvent(self.batch_number - 1, current_rank(), time.time())
        self._fanout.on_event(event)
        self._fanout.flush(cfg.flush_timeout_s)
        if self._compat:
            msg = (f"DebugUnderflowOverflow: aborting after {self.batch_number} batches due to"
                   f" `abort_after_batch_num={cfg.abort_after_batch}` arg")
        else:
            msg = (f"tensorwatch_otel: aborting after {self.batch_number} batches due to "
                   f"abort_after_batch={cfg.abort_after_batch}")
        raise AbortAfterBatch(msg)

    # ---------------------------------------------------------------- gradients
    def _make_grad_hook(self, info: _ModuleInfo, name: str):
        def hook(p):
            if not self._attached or not self._watches(max(self.batch_number - 1, 0)):
                return
            g = p.grad
            if g is None:
                return
            rec = self._grad_rec
            if rec is None:
                rec = self._grad_rec = _Record(max(self.batch_number - 1, 0), phase="backward")
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            try:
                with torch.no_grad():
                    items: list = []
                    start = len(rec.dtypes)
                    r = measure(g)
                    if r.__class__ is str:
                        items.append((name, r))
                    else:
                        rec.stats += r
                        rec.dtypes.append(g.dtype)
                        items.append(name)
                    rec.frames.append((info, items, start))
            except Exception as exc:
                self._hook_failed(info, exc)
        return hook

    def _end_backward(self) -> None:
        rec, self._grad_rec = self._grad_rec, None
        if rec is None or not rec.frames:
            return
        self._readback(rec)
        self._check(rec, 0)

    # ---------------------------------------------------------------- detect_overflow
    def _overflow_check(self, event) -> None:
        self._fanout.on_event(event)
        if event.kind:
            self._fanout.flush(self.config.flush_timeout_s)


def watch(model: torch.nn.Module, *, sinks: Optional[Sequence[Sink]] = None, max_frames: int = 21,
          trace_batches: Sequence[int] = (), abort_after_batch: Optional[int] = None,
          every_n_batches: int = 1, gradients: bool = False, include=None, exclude=None,
          on_detect: str = "raise", check: str = "batch", strict: bool = False,
          flush_timeout_s: float = 5.0) -> Watcher:
    """Watch every module of `model` for inf/nan and export per-module abs min/max.

    Statistics stay on the device and come back in one transfer per batch (`check="batch"`);
    `check="module"` reads back after every module call (exact and immediate, slower).
    `sinks=None` means a TextReport plus what the environment configures
    (TENSORWATCH_PROMETHEUS_PORT, TENSORWATCH_JSONL, OTEL_EXPORTER_OTLP_*).
    """
    config = WatchConfig.build(max_frames=max_frames, trace_batches=trace_batches,
                               abort_after_batch=abort_after_batch, every_n_batches=every_n_batches,
                               gradients=gradients, include=include, exclude=exclude,
                               on_detect=on_detect, check=check, flush_timeout_s=flush_timeout_s,
                               strict=strict)
    owned: List[Sink] = []
    if sinks is None:
        from .sinks.text import TextReport

        owned = [TextReport()] + _env_sinks()
        sinks = owned
    else:
        sinks = list(sinks)
        for s in sinks:
            if not isinstance(s, Sink) and not (hasattr(s, "on_event") and hasattr(s, "on_batch")):
                raise TypeError(f"sinks: {s!r} is not a sink (see tensorwatch_otel.sinks)")
    return Watcher(model, sinks, config, owned_sinks=owned)


def _env_sinks() -> List[Sink]:
    try:
        from ._env_sinks import sinks_from_env
    except ImportError:  # exporters not installed in this build
        return []
    return list(sinks_from_env())
