"""Issue 18 acceptance, as a new user meets it: scenarios the per-item tests did not cover."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from _collect import Collect
from _models import TwoLinear as Net
from tensorwatch_otel import NonFiniteEvent, watch
from tensorwatch_otel.core.events import SkippedStepEvent


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
        for _ in range(3):
            out = model(x)
            loss = F.mse_loss(out, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert sink.of(NonFiniteEvent) == [] and w.steps_skipped == 0
    assert opt.state[next(model.parameters())]["step"].item() == 3  # every step taken
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- item 4: a step that runs its own closure (Lightning's automatic optimization) ------------

@pytest.mark.parametrize("gradients", [False, True])
def test_a_closure_step_is_checked_after_its_closure_before_the_weights_change(gradients):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    sink = Collect()
    state = {"poison": False}

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        if state["poison"]:
            loss = loss * float("inf")  # born in the loss, outside every module
        loss.backward()
        return loss

    with watch(model, sinks=[sink], gradients=gradients):
        opt.step(closure)
        opt.step(closure)
        state["poison"] = True
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(Exception) as ei:
            opt.step(closure)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # not written
    ev = ei.value.event
    assert (ev.phase, ev.batch_number) == ("backward", 2)
    assert ev.tensor.endswith(".grad")
    assert sink.of(NonFiniteEvent) == [ev]


def test_lightning_inf_in_the_loss_stops_before_the_weights_change():
    import warnings

    from _lit import Regressor, loader, trainer
    from tensorwatch_otel import NonFiniteDetected
    from tensorwatch_otel.integrations.lightning import TensorwatchCallback

    class LossInf(Regressor):
        def training_step(self, batch, i):
            loss = super().training_step(batch, i)
            if self.global_step == 2:
                self.before = {n: p.detach().clone() for n, p in self.named_parameters()}
                loss = loss * float("inf")
            return loss

    model = LossInf()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NonFiniteDetected) as ei:
            trainer([TensorwatchCallback()]).fit(model, loader())
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.phase, ev.batch_number) == ("out", "bias.grad", "backward", 2)
    assert all(torch.equal(p, model.before[n]) for n, p in model.named_parameters())


# -- item 10: patterns that leave nothing watched fail at watch(), never silently -------------

@pytest.mark.parametrize("patterns", [dict(exclude=["*"]), dict(include=["a", "b"], exclude=["a", "b"]),
                                      dict(include=["a*"], exclude=["a"])])
def test_include_and_exclude_that_leave_no_module_watched_is_a_config_error(patterns):
    from tensorwatch_otel.core.config import ConfigError

    model = Net()
    with pytest.raises(ConfigError, match="nothing would be watched"):
        watch(model, sinks=[], **patterns)
    assert not model._forward_hooks and not model.a._forward_hooks  # nothing left attached


def test_exclude_of_most_modules_still_watches_the_rest():
    model = Net()
    with watch(model, sinks=[], exclude=["(root)", "a"]):
        with torch.no_grad():
            model.b.weight[0, 0] = float("inf")
        with pytest.raises(Exception) as ei:
            model(torch.ones(1, 8))
    assert (ei.value.event.module, ei.value.event.tensor) == ("b", "weight")


def test_lightning_16_mixed_with_fused_adamw_skips_overflows_without_a_false_alarm():
    import warnings

    from lightning.pytorch.plugins import MixedPrecision

    from _lit import Regressor, loader, trainer
    from tensorwatch_otel.integrations.lightning import TensorwatchCallback

    class Fused(Regressor):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    model = Fused()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)  # the first steps overflow
    sink = Collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer([TensorwatchCallback(grad_scaler=scaler, sinks=[sink])], max_steps=6,
                plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]).fit(model, loader())
    assert sink.of(NonFiniteEvent) == []  # the healthy run was stopped at batch 0 before the fix
    assert len(sink.of(SkippedStepEvent)) == 6 and scaler.get_scale() == 2.0 ** 94
    assert all(torch.isfinite(p).all() for p in model.parameters())
