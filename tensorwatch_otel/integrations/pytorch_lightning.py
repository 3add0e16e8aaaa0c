"""pytorch_lightning (the standalone package): the callback of `integrations.lightning` for
Trainers of `pytorch_lightning`, whose Callback class is its own.

Importing this module imports pytorch_lightning; `import tensorwatch_otel` never does.
"""

from __future__ import annotations

from pytorch_lightning.callbacks import Callback

from ._lightning_fit import WatchDuringFit

__all__ = ["TensorwatchCallback"]


class TensorwatchCallback(WatchDuringFit, Callback):
    __doc__ = WatchDuringFit.__doc__
