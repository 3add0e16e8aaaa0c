"""Issue 18 acceptance, as a new user meets it: scenarios the per-item tests did not cover."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from _collect import Collect
from tensorwatch_otel import NonFiniteEvent, watch
from tensorwatch_otel.core.events import SkippedStepEvent


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


# -- item 4: a GradScaler skip inside a fused optimizer is a skip, not a detection -----------

@pytest.mark.parametrize("gradients", [False, True])
def test_fused_adamw_with_grad_scaler_overflow_is_a_skip_not_a_false_alarm(gradients):
    # fused AdamW (transformers' default optimizer for torch >= 2.8) takes the GradScaler's
    # found_inf and skips inside its step: step() runs with the still-scaled, inf gradients
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    assert getattr(opt, "_step_supports_amp_scaling", False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100, growth_interval=3)
    sink = Collect()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    w = watch(model, sinks=[sink], gradients=gradients, grad_scaler=scaler)
    scales = []
    for _ in range(6):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.mse_loss(out.float(), y)).backward()
        scaler.step(opt)  # a false alarm raised NonFiniteDetected here
        scales.append(scaler.get_scale())
        scaler.update()
    w.detach()
    assert all(b < a for a, b in zip(scales, scales[1:]))  # every step overflowed and was skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sink.of(NonFiniteEvent) == []
    events = sink.of(SkippedStepEvent)
    assert [e.batch_number for e in events] == [0, 1, 2, 3, 4, 5]
    assert [e.streak for e in events] == [1, 2, 3, 4, 5, 6]
    assert w.steps_skipped == 6


def test_fused_adamw_with_grad_scaler_healthy_steps_are_taken():
    # the scaler's verdict (finite) replaces the guard's read: steps go through, nothing counted
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    sink = Collect()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with watch(model, sinks=[sink], grad_scaler=scaler) as w:
        for i in range(3):
            out = model(x)
            loss = F.mse_loss(out, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert sink.of(NonFiniteEvent) == [] and w.steps_skipped == 0
    assert opt.state[next(model.parameters())]["step"].item() == 3  # every step taken
    assert all(torch.isfinite(p).all() for p in model.parameters())
