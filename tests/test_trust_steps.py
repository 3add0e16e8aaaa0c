"""Optimizer steps on the real stack: GradScaler skips are skipped steps, not detections; a bad
gradient is a detection only when a step consumes it; weights are live after fused optimizers,
casts and `.data` writes."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import pytest
from _collect import Collect
from _models import TwoLinear as Net
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch
from tensorwatch_otel.cli._demo_model import DemoConfig, Trainer
from tensorwatch_otel.core.events import SkippedStepEvent, SkipStreakEvent
from tensorwatch_otel.report.text import render_detection


def amm(t):
    a = t.detach().abs().float()
    return a.min().item(), a.max().item()


def stats_of(frame):
    return {t.name: (t.abs_min, t.abs_max, t.dtype) for t in frame.tensors}


def _scaler_run(steps, init_scale, gradients=True, max_skipped_steps=None, grad_scaler=True):
    """fp16 autocast + torch.amp.GradScaler on a real model; counts the steps the scaler skipped."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3)
    sink = Collect()
    taken = []
    orig_step = opt.step

    def counting_step(*a, **k):
        taken.append(1)
        return orig_step(*a, **k)

    opt.step = counting_step
    w = watch(model, sinks=[sink], gradients=gradients, max_skipped_steps=max_skipped_steps,
              grad_scaler=scaler if grad_scaler else None)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    model(x)  # the next batch sees the last step's outcome
    w.detach()
    return sink, steps - len(taken), scaler


def test_gradscaler_skips_are_counted_not_detected():
    # a huge initial scale: the scaled gradients overflow and the scaler skips steps by design
    sink, skipped, scaler = _scaler_run(steps=12, init_scale=2.0 ** 40)
    assert skipped >= 3  # the scaler really skipped (halving its way down from 2**40)
    assert sink.of(NonFiniteEvent) == []  # a healthy run is not killed
    events = sink.of(SkippedStepEvent)
    assert len(events) == skipped
    assert [e.streak for e in events][:3] == [1, 2, 3]
    assert all(e.kind in ("inf", "nan", "inf,nan") and e.tensor.endswith(".grad") for e in events)
    assert sink.batches[-1].steps_skipped == skipped
    assert sink.batches[-1].grad_scale == scaler.get_scale()


def test_gradscaler_skips_counted_from_the_scale_without_gradients():
    sink, skipped, scaler = _scaler_run(steps=12, init_scale=2.0 ** 40, gradients=False)
    assert skipped >= 3
    assert len(sink.of(SkippedStepEvent)) == skipped
    assert sink.of(NonFiniteEvent) == []
    scales = [b.grad_scale for b in sink.batches]
    assert scales[0] == 2.0 ** 40 and scales[-1] == scaler.get_scale()


def test_long_skip_streak_is_an_event_of_its_own():
    sink, skipped, _ = _scaler_run(steps=12, init_scale=2.0 ** 60, max_skipped_steps=4)
    assert skipped >= 4
    streaks = sink.of(SkipStreakEvent)
    assert len(streaks) == 1 and streaks[0].streak == 4


def test_demo_trainer_with_its_scaler_runs_healthy_with_gradients():
    t = Trainer(DemoConfig(), seed=0)
    t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=5)
    sink = Collect()
    with watch(t.model, sinks=[sink], gradients=True):
        for _ in range(30):
            t.step()
    assert sink.of(NonFiniteEvent) == []
    assert len(sink.of(SkippedStepEvent)) >= 1


def test_bad_gradient_consumed_by_a_step_is_a_detection_headed_backward():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    with watch(model, sinks=[sink], gradients=True):
        loss = model(torch.randn(4, 8)).sum() * float("inf")
        loss.backward()
        assert sink.of(NonFiniteEvent) == []
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
    ev = ei.value.event
    assert ev.phase == "backward" and ev.tensor.endswith(".grad")
    text = render_detection(ev)
    assert f"Last {len(ev.frames)} backward frames:" in text and "forward frames" not in text


def test_gradients_reset_without_a_step_are_a_skip():
    torch.manual_seed(0)
    model = Net()
    sink = Collect()
    with watch(model, sinks=[sink], gradients=True):
        (model(torch.randn(4, 8)).sum() * float("nan")).backward()
        model.zero_grad(set_to_none=True)  # the loop decided not to step
        model(torch.randn(4, 8)).sum().backward()
    assert sink.of(NonFiniteEvent) == []
    (ev,) = sink.of(SkippedStepEvent)
    assert ev.kind == "nan" and ev.batch_number == 0


@pytest.mark.parametrize("fused", [True, False])
def test_weights_live_after_every_optimizer_step(fused):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)
    sink = Collect()
    stale = 0
    with watch(model, sinks=[sink]):
        for _ in range(10):
            live = amm(model.a.weight)
            model(torch.randn(4, 8)).square().sum().backward()
            opt.step()
            opt.zero_grad()
            got = stats_of(sink.batches[-1].frames[0])["weight"][:2]
            stale += got != live
    assert stale == 0


def test_weight_made_inf_by_half_is_blamed_on_the_weight_as_float16():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    sink = Collect()
    with torch.no_grad():
        model[1].weight[0, 0] = 1.0e5  # finite in float32, inf in float16
    w = watch(model, sinks=[sink], on_detect="report")
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)  # weights measured (and cached) in float32
    model.half()  # the same Parameter objects, cast in place: no _version moves
    with torch.no_grad():
        model(x.half())
    w.detach()
    (ev,) = sink.of(NonFiniteEvent)
    assert (ev.module, ev.tensor, ev.kind) == ("1", "weight", "inf")
    assert stats_of(ev.frames[-1])["weight"][2] == "float16"


def test_nan_written_into_a_weight_by_the_optimizer_is_blamed_on_the_weight():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report", guard_steps=False)
    model(torch.randn(4, 8)).sum().backward()
    model.b.weight.grad[0, 0] = float("nan")  # gradients are not checked: the step writes the NaN
    opt.step()
    model(torch.randn(4, 8))
    w.detach()
    (ev,) = sink.of(NonFiniteEvent)
    assert (ev.module, ev.tensor, ev.kind) == ("b", "weight", "nan")


def test_weight_changed_through_data_in_a_training_batch_is_live():
    model = nn.Linear(2, 2)
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report"):
        model(torch.ones(1, 2))
        model.weight.data.mul_(100)
        model(torch.ones(1, 2))
    assert stats_of(sink.batches[1].frames[0])["weight"][:2] == amm(model.weight)
