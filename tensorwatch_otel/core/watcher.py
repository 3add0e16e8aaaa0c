"""The watcher: forward hooks that record a frame per module call, read the batch's statistics
back in one host transfer when the batch ends, and hand events to the sinks.

A batch is one finished forward of the watched (root) module, as in transformers.debug_utils:
with gradient accumulation every micro-batch forward is a batch; eval forwards count too, and
`generate()` counts one batch per decoding step (every call of the model's forward).
The sinks are given to it (the port in core/ports.py): the core imports no sink.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .behaviour import Behaviour
from .config import WatchConfig
from .errors import AbortAfterBatch, NonFiniteDetected
from .fleet import FleetStop, register_step_hook
from .events import AbortAfterBatchEvent, BatchStats, BatchTraceEvent, Frame, NonFiniteEvent, merge_kinds
from .ports import Sink, SinkFanout
from .rank import current_rank
from .record import History, ModuleInfo, Record
from .recorder import FrameRecorder

log = logging.getLogger(__name__)

_MAX_PENDING = 2_000_000  # stat slots held before an early read-back (no root forward seen)
_WEIGHT_REFRESH = 32  # batches between full weight re-measurements (see _end_batch)

# Watchers alive in this process, for detect_overflow(); weak so a dropped watcher goes away.
ACTIVE: "weakref.WeakSet[Watcher]" = weakref.WeakSet()


class Watcher:
    """Hooks on every (included) module of `model`; see `watch()`. A context manager."""

    def __init__(self, model: torch.nn.Module, sinks: Sequence[Sink], config: WatchConfig,
                 owned_sinks: Sequence[Sink] = (), behaviour: Optional[Behaviour] = None,
                 grad_scaler=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.config = config
        self.behaviour = behaviour or Behaviour()
        self.batch_number = 0
        self.detections = 0
        self._fanout = SinkFanout(sinks, strict=config.strict)
        self._owned = list(owned_sinks)
        self._handles: list = []
        self._lock = threading.Lock()
        self._attached = False
        self._root_depth = 0
        self._recorder = FrameRecorder(model)
        self._rec = Record(0)
        self._history = History(config.max_frames)
        self._grad_rec: Optional[Record] = None
        self.grad_scaler = grad_scaler
        self._active = self._watches(0)
        self._failed_hooks = 0
        self._hook_error_logged = False
        self._fleet = FleetStop(self._record_durable, lambda: self.batch_number)
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
            info = ModuleInfo(path, module, is_root, recorded)
            if is_root:
                self._handles.append(module.register_forward_pre_hook(self._root_pre_hook))
            self._handles.append(module.register_forward_hook(
                self._make_hook(info), with_kwargs=True, always_call=True))
            if cfg.gradients and recorded:
                for name, p in module.named_parameters(recurse=False):
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(
                            self._make_grad_hook(info, name + ".grad")))
        self._handles.append(register_step_hook(self._fleet))
        self._attached = True
        ACTIVE.add(self)

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
        ACTIVE.discard(self)
        self._fanout.flush(self.config.flush_timeout_s)
        for s in self._owned:
            try:
                s.close()
            except Exception as exc:  # closing must not raise into user code
                log.warning("tensorwatch_otel: closing %s failed: %s", type(s).__name__, exc)
        self._recorder.clear()

    close = detach

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self._fleet.at_exit()  # multi-rank: a stop held for a later stop point is raised now
        finally:
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
    def _make_hook(self, info: ModuleInfo):
        record = self.behaviour.record
        recorder = self._recorder

        def hook(module, args, kwargs, output):
            if self._active and info.recorded and torch._C._current_graph_task_id() == -1 \
                    and not torch.compiler.is_compiling():
                # -1: not inside backward, so this is no checkpoint recomputation
                rec = self._rec
                try:
                    with torch.no_grad():
                        record(recorder, rec, info, args, kwargs, output)
                except Exception as exc:  # a frame we cannot take must not stop training
                    self._hook_failed(info, exc)
                if self.config.check == "module":
                    rec.readback()
                    try:
                        self._check(rec, len(rec.frames) - 1)
                    finally:  # a detection in the root's own frame must still end the batch
                        if info.is_root:
                            self._root_depth = max(self._root_depth - 1, 0)
                            if self._root_depth == 0:
                                self._end_batch()
                    if info.is_root:
                        return
                elif len(rec.stats) > _MAX_PENDING:
                    rec.readback()
            if info.is_root:
                self._root_depth -= 1
                if self._root_depth <= 0:
                    self._root_depth = 0
                    self._end_batch()
        return hook

    def _root_pre_hook(self, module, args):
        if self._root_depth == 0:
            try:  # multi-rank: the stop published by a rank may be raised here
                self._fleet.at_batch_start()
            except NonFiniteDetected:
                self._active = False  # the batch never runs: the always-called hook records nothing
                raise
        self._root_depth += 1

    def _hook_failed(self, info: ModuleInfo, exc: Exception) -> None:
        self._failed_hooks += 1
        if not self._hook_error_logged:
            self._hook_error_logged = True
            log.error("tensorwatch_otel: could not record %s (%s): %s: %s; training goes on, "
                      "further failures are counted", info.path or "(root)", info.cls,
                      type(exc).__name__, exc)

    # ---------------------------------------------------------------- batch end
    def _end_batch(self) -> None:
        rec = self._rec
        b = self.batch_number
        self.batch_number = b + 1
        self._rec = Record(b + 1)
        self._active = self._attached and self._watches(b + 1)
        self._recorder.end_batch()
        if self.batch_number % _WEIGHT_REFRESH == 0:
            # writes through `.data` do not move _version: every weight is measured afresh now and then
            self._recorder.invalidate_weights()
        if rec.frames:
            rec.readback()
            try:
                self._finish(rec)
            finally:  # a batch that raised NonFiniteDetected still precedes the next ring
                self._history.keep(rec)
        cfg = self.config
        if cfg.abort_after_batch is not None and self.batch_number > cfg.abort_after_batch:
            self._abort()

    def _finish(self, rec: Record) -> None:
        cfg = self.config
        traced = rec.batch_number in cfg.trace_batches
        rank = current_rank()
        if self._fanout.wants_batches:
            self._fanout.on_batch(BatchStats(rec.batch_number, rank, time.time(), rec))
        if traced:
            self._fanout.on_event(BatchTraceEvent(rec.batch_number, rank, rec.materialize(), time.time()))
        if cfg.check == "batch" and (self.behaviour.detect_in_traced_batches or not traced):
            self._check(rec, 0)

    def _check(self, rec: Record, first_frame: int) -> None:
        """Detect inf/nan in frames[first_frame:] of `rec` (their stats are on the host)."""
        if rec.detected:
            return
        fi = rec.first_nonfinite_frame(first_frame)
        if fi is not None:
            self._detected(rec, fi)

    def _ring(self, rec: Record, fi: int) -> Tuple[Frame, ...]:
        traced = self.config.trace_batches
        stops_at = self.behaviour.ring_stops_at
        return self._history.ring(rec, fi, lambda prev: stops_at(prev, traced))

    def _detected(self, rec: Record, fi: int) -> None:
        rec.detected = True
        frames = self._ring(rec, fi)
        last = frames[-1]
        first = last.first_nonfinite()
        event = NonFiniteEvent(
            batch_number=rec.batch_number, rank=current_rank(), module=last.module,
            module_class=last.module_class, tensor=first.name if first else "",
            kind=merge_kinds(last.kind) or "nan", frames=frames, time=time.time())
        raising = self.config.on_detect == "raise"
        if raising and self._fleet.active():
            event = self._fleet.publish(event)  # multi-rank: first_rank is whoever published first
        self.detections += 1
        self._fanout.on_event(event)
        if raising:
            self._fanout.flush(self.config.flush_timeout_s)
            # drop what the aborted batch left behind so a caught exception leaves a clean state
            self._recorder.acts_seen.clear()
            exc = NonFiniteDetected(self.behaviour.detection_message(event), event)
            if not self._fleet.defer(exc):  # multi-rank: raised at the ranks' common stop point
                raise exc

    def _abort(self) -> None:
        cfg = self.config
        event = AbortAfterBatchEvent(self.batch_number - 1, current_rank(), time.time())
        self._fanout.on_event(event)
        self._fanout.flush(cfg.flush_timeout_s)
        raise AbortAfterBatch(self.behaviour.abort_message(self.batch_number, cfg.abort_after_batch))

    # ---------------------------------------------------------------- gradients
    def _make_grad_hook(self, info: ModuleInfo, name: str):
        def hook(p):
            if not self._attached or not self._watches(max(self.batch_number - 1, 0)):
                return
            g = p.grad
            if g is None:
                return
            rec = self._grad_rec
            if rec is None:
                rec = self._grad_rec = Record(max(self.batch_number - 1, 0), phase="backward")
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            try:
                with torch.no_grad():
                    self._recorder.one(rec, info, g, name)
            except Exception as exc:
                self._hook_failed(info, exc)
        return hook

    def _end_backward(self) -> None:
        rec, self._grad_rec = self._grad_rec, None
        if rec is None or not rec.frames:
            return
        rec.readback()
        self._check(rec, 0)

    def _record_durable(self, event) -> None:
        self._fanout.on_event(event)
        self._fanout.flush(self.config.flush_timeout_s)

    # ---------------------------------------------------------------- detect_overflow
    def overflow_check(self, event) -> None:
        """Hand a detect_overflow() finding to the sinks (durable before returning)."""
        self._fanout.on_event(event)
        if event.kind:
            self._fanout.flush(self.config.flush_timeout_s)
