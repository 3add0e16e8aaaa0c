"""transformers: a TrainerCallback that watches the model a Trainer trains, from train begin to
train end, so a first inf/nan leaves `Trainer.train()` as NonFiniteDetected.

Importing this module imports transformers; `import tensorwatch_otel` never does.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Optional

from transformers import Trainer, TrainerCallback
from transformers.debug_utils import DebugOption, DebugUnderflowOverflow

from .._watch import watch
from ..core.watcher import Watcher
from ._options import check_watch_options

__all__ = ["TensorwatchCallback"]

log = logging.getLogger(__name__)

_GUARD = "__tensorwatch_guard__"
_STACK_DEPTH = 16  # frames searched for the Trainer that calls a callback event


class TensorwatchCallback(TrainerCallback):
    """Watch the trained model with `watch(model, **watch_options)` while `train()` runs.

    - Attaches at `on_train_begin` to the model the Trainer trains (its `model`, the user's
      module: hooks on it fire whatever wraps it, DDP, DeepSpeed or accelerate's autocast, and
      module paths are those of the user's model), on every rank.
    - Detaches at `on_train_end`, and when `train()` raises (a detection included): no hook is
      left on the model once `train()` has returned or raised. (transformers has no event for a
      raise: `train()` is wrapped for that; a callback added with `add_callback()` after the
      Trainer was built is covered from its second `train()` on.)
    - Forwards of evaluation loops run inside `train()` (`eval_strategy`) are watched batches
      too: an inf/nan in an eval forward is a detection. `trainer.evaluate()` and
      `trainer.predict()` called outside `train()` are not watched.
    - When the Trainer's optimizer steps through a GradScaler (fp16 on GPU: accelerate's
      `accelerator.scaler`), it is passed as `watch(..., grad_scaler=...)` unless given.
    - `TrainingArguments(debug="underflow_overflow")` is served by this watcher alone: the hooks
      of the transformers DebugUnderflowOverflow that `train()` placed are taken off the model
      before it runs (one report, NonFiniteDetected, the sinks); the arguments stay as given.

    Options are those of `watch()` (`sinks`, `gradients`, `include`, `on_detect`, ...), checked
    when the callback is built. `watcher` is the live Watcher during training, else None.
    """

    def __init__(self, **watch_options: Any):
        self.watch_options = check_watch_options("TensorwatchCallback", watch_options)
        self.watcher: Optional[Watcher] = None

    # -- TrainerCallback events ---------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        guard_train(_calling_trainer(self))

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.detach()  # a retried inner loop (auto_find_batch_size) starts a fresh watcher
        trainer = _calling_trainer(self)
        guard_train(trainer)
        if model is None and trainer is not None:
            model = trainer.model
        if model is None:
            log.warning("tensorwatch_otel: on_train_begin without a model; nothing is watched")
            return
        if DebugOption.UNDERFLOW_OVERFLOW in (getattr(args, "debug", None) or ()):
            _serve_debug_flag(model)
        options = dict(self.watch_options)
        if options.get("grad_scaler") is None:
            scaler = _grad_scaler(trainer, optimizer)
            if scaler is not None:
                options["grad_scaler"] = scaler
        self.watcher = watch(model, **options)

    def on_train_end(self, args, state, control, **kwargs):
        self.detach()

    # -- lifetime -----------------------------------------------------------------------------
    def detach(self) -> None:
        """Remove the hooks and flush (and close the sinks the watcher made). Idempotent."""
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            watcher.detach()


def _serve_debug_flag(model: Any) -> None:
    """Take the forward hooks of transformers' own DebugUnderflowOverflow off `model`: `train()`
    places them for `debug="underflow_overflow"` (and never removes them) before on_train_begin.
    Run beside ours, its hook raises its ValueError first, torch then only warns about our
    always-called hook's NonFiniteDetected, and both checkers print a report."""
    removed = 0
    for m in model.modules():
        hooks = m._forward_hooks
        for key in [k for k, h in hooks.items() if isinstance(getattr(h, "__self__", None), DebugUnderflowOverflow)]:
            del hooks[key]  # what its RemovableHandle (which the Trainer dropped) would do
            m._forward_hooks_with_kwargs.pop(key, None)
            m._forward_hooks_always_called.pop(key, None)
            removed += 1
    if removed:
        log.info("tensorwatch_otel: TrainingArguments(debug='underflow_overflow') is served by this "
                 "watcher: transformers' DebugUnderflowOverflow hooks were taken off (%d)", removed)


def _grad_scaler(trainer: Optional[Trainer], optimizer: Any) -> Any:
    """The GradScaler the Trainer's optimizer steps through, or None (fp32, bf16, CPU)."""
    scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer
    if scaler is None and trainer is not None:
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
    return scaler


def _calling_trainer(callback: TensorwatchCallback) -> Optional[Trainer]:
    """The Trainer whose event this is: callbacks are not given their Trainer, so look for the
    caller's `self` (Trainer.__init__ or its training loop) a few frames up."""
    frame = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            break
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            handler = getattr(obj, "callback_handler", None)
            if handler is not None and any(cb is callback for cb in handler.callbacks):
                return obj
        frame = frame.f_back
    return None


def guard_train(trainer: Optional[Trainer]) -> None:
    """Make `trainer.train()` detach every TensorwatchCallback of the trainer when it returns or
    raises: transformers calls no callback event when training raises.

    A callback given to `Trainer(callbacks=[...])` guards every `train()` (from `on_init_end`).
    One added later with `add_callback()` is found at its first `on_train_begin`, inside that
    `train()` call: that call relies on `on_train_end`, the following ones are guarded."""
    if trainer is None or getattr(trainer.train, _GUARD, False):
        return
    # A strong reference: `Trainer(...).train()` must not lose its trainer halfway (the cycle
    # trainer -> train -> trainer goes with the garbage collector, as the Trainer's own do).
    inner = trainer.train

    @functools.wraps(inner)
    def train(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        finally:
            for cb in list(trainer.callback_handler.callbacks):
                if isinstance(cb, TensorwatchCallback):
                    cb.detach()

    setattr(train, _GUARD, True)
    trainer.train = train
