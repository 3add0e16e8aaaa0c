"""A real Lightning Trainer for the integration tests: a tiny regressor whose Scale module
overflows float32 at a chosen step, a tiny data loader, CPU without logger or checkpoints."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn


class Scale(nn.Module):
    """Multiplies by `factor`: 1e39 overflows float32 to inf at this module."""

    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


class Regressor(pl.LightningModule):
    """training_step calls the module itself (`self(x)`), the usual Lightning pattern;
    `overflow_at` sets the Scale factor at that global step."""

    def __init__(self, overflow_at=None, call_root=True):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.boom = Scale()
        self.out = nn.Linear(8, 1)
        self.overflow_at = overflow_at
        self.call_root = call_root

    def forward(self, x):
        return self.out(self.boom(self.inp(x)))

    def training_step(self, batch, batch_idx):
        if self.global_step == self.overflow_at:
            self.boom.factor = 1e39
        x, y = batch
        pred = self(x) if self.call_root else self.out(self.boom(self.inp(x)))
        return nn.functional.mse_loss(pred, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def trainer(callbacks, **kw):
    args = dict(max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, accelerator="cpu", devices=1, num_sanity_val_steps=0,
                limit_val_batches=0)
    args.update(kw)
    return pl.Trainer(callbacks=list(callbacks), **args)
