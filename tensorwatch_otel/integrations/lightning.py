"""Lightning: a Callback that watches the LightningModule a Trainer fits, from fit start to fit
end, so a first inf/nan leaves `Trainer.fit()` as NonFiniteDetected.

Importing this module imports lightning; `import tensorwatch_otel` never does.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from ._lightning_fit import WatchDuringFit

__all__ = ["TensorwatchCallback"]


class TensorwatchCallback(WatchDuringFit, Callback):
    __doc__ = WatchDuringFit.__doc__
