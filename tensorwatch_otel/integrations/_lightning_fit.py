"""The Lightning callback's behaviour, shared by the `lightning` and `pytorch_lightning` packages
(each has its own Callback class); imports neither."""

from __future__ import annotations

from typing import Any, Optional

try:
    from typing_extensions import override
except ImportError:  # pragma: no cover - Lightning depends on typing_extensions
    def override(f):
        return f

from .._watch import watch
from ..core.watcher import BatchScope, Watcher
from ._options import check_watch_options


class WatchDuringFit:
    """Watch the LightningModule with `watch(pl_module, **watch_options)` while `fit()` runs.

    - Attaches at `on_fit_start`: after `configure_model()` and the strategy's set-up, so layers
      made or replaced there (sharding, SyncBatchNorm) are the ones watched; module paths are
      those of the LightningModule, on every rank.
    - Detaches at `on_fit_end`, `teardown` and `on_exception`: no hook is left on the module
      once `fit()` has returned or raised (a detection included).
    - Each training step is one batch (`Watcher.batch()`, from `on_train_batch_start` to
      `on_train_batch_end`): every forward `training_step` makes, the root's or its submodules'
      called directly, with the step's backward and optimizer step. With gradient accumulation
      each micro-batch is a batch. A detection still raises as the forward call that produced
      it returns, before the backward.
    - Sanity-check and validation forwards inside `fit()` are watched batches too (each
      outermost call one batch).
    - With a GradScaler (`precision="16-mixed"` on GPU), it is passed as
      `watch(..., grad_scaler=...)` unless given.

    Options are those of `watch()`, checked when the callback is built. `watcher` is the live
    Watcher during `fit()`, else None.
    """

    def __init__(self, **watch_options: Any):
        super().__init__()
        self.watch_options = check_watch_options("TensorwatchCallback", watch_options)
        self.watcher: Optional[Watcher] = None
        self._step: Optional[BatchScope] = None  # the training step's batch, while it runs

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        self.detach()
        options = dict(self.watch_options)
        if options.get("grad_scaler") is None:
            scaler = getattr(getattr(trainer.strategy, "precision_plugin", None), "scaler", None)
            if scaler is not None:
                options["grad_scaler"] = scaler
        self.watcher = watch(pl_module, **options)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._end_step()
        if self.watcher is not None:
            scope = self.watcher.batch()
            scope.__enter__()
            self._step = scope

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._end_step()  # a detection or abort_after_batch at the batch's end leaves fit() here

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._end_step()  # on_train_batch_start returned -1: no on_train_batch_end came

    @override
    def on_validation_start(self, trainer, pl_module) -> None:
        self._end_step()

    @override
    def on_fit_end(self, trainer, pl_module) -> None:
        self.detach()

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.detach()

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.detach()

    def _end_step(self, failed: bool = False) -> None:
        scope, self._step = self._step, None
        if scope is not None:
            # failed: fit() is leaving on an exception (or without the step's end); the batch
            # is recorded, and a detection in it is not raised over that exit
            scope.__exit__(*((BaseException, None, None) if failed else (None, None, None)))

    def detach(self) -> None:
        """Remove the hooks and flush (and close the sinks the watcher made). Idempotent."""
        self._end_step(failed=True)
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            watcher.detach()
