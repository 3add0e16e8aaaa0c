"""A replay replays what ran (issue: trust, item 4), or says plainly that the place is uncertain.

- Autocast: the batch's call ran inside the user's autocast region; the replay that localizes a
  detection made at `optimizer.step()` runs outside it, so it re-enters the autocast state held
  with the inputs (an fp16 overflow is named where an fp16 run overflows, not as a gradient).
- torch.compile (real inductor) with dropout: inductor draws its own masks, which an eager replay
  cannot draw; the replay's place and verdict are not used then, and the event says why
  (`uncertain`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch
from tensorwatch_otel.core.batch.rerun import COMPILED_RANDOM
from tensorwatch_otel.core.events import SkippedStepEvent

BAD = 13  # an unsampled batch at every_n_batches=10
BATCHES = 15


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class ClampedExpNet(nn.Module):
    """exp overflows in fp16 (not in fp32) and the clamp hides it from the output; its backward
    (0 * inf) makes b's gradients NaN, so the step guard is the first to see it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.act = Exp()

    def forward(self, x):
        return self.act(self.b(torch.relu(self.a(x)))).clamp(max=1e4)


def _autocast_run(every, scaler=False):
    """fp16 autocast on the CPU around the forward; the loss, backward and step outside it."""
    torch.manual_seed(0)
    model = ClampedExpNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gs = torch.amp.GradScaler("cpu", init_scale=1.0) if scaler else None
    g = torch.Generator().manual_seed(1)
    sink = Collect()
    with watch(model, sinks=[sink], every_n_batches=every, grad_scaler=gs):
        try:
            for i in range(BATCHES):
                x = torch.randn(4, 8, generator=g) * (100 if i == BAD else 1)  # exp(> 11) overflows fp16 only
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = out.float().square().mean()
                if gs is None:
                    loss.backward()
                    opt.step()
                else:
                    gs.scale(loss).backward()
                    gs.step(opt)
                    gs.update()
        except NonFiniteDetected:
            pass
    return sink


def _place(ev):
    return (ev.batch_number, ev.module, ev.tensor, ev.phase, ev.kind)


def test_an_fp16_overflow_found_at_the_step_is_replayed_under_the_batchs_autocast():
    (full,) = _autocast_run(1).of(NonFiniteEvent)
    (sampled,) = _autocast_run(10).of(NonFiniteEvent)
    assert _place(full) == (BAD, "act", "output", "forward", "inf")
    assert _place(sampled) == _place(full)  # before: (BAD, "b", "bias.grad", "backward", "nan"): replayed in fp32
    assert sampled.uncertain is None


def test_with_a_grad_scaler_an_unsampled_batchs_fp16_overflow_is_detected():
    """The GradScaler skips the step whose gradients the fp16 overflow spoilt, so the step guard
    never runs: the scaler's skip in an unsampled batch replays it, while its inputs are held."""
    (full,) = _autocast_run(1, scaler=True).of(NonFiniteEvent)
    assert _place(full) == (BAD, "act", "output", "forward", "inf")
    sink = _autocast_run(10, scaler=True)
    assert [e.batch_number for e in sink.of(SkippedStepEvent)] == []
    assert [_place(e) for e in sink.of(NonFiniteEvent)] == [_place(full)]


class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.act = Exp()

    def forward(self, x):
        return self.act(self.drop(self.lin(x)))


class TwoBranches(nn.Module):
    """Each branch has one element between 44.4 and 88.7 before its dropout: exp overflows in a
    branch exactly when dropout keeps (doubles) that element, so which branch overflows is the
    masks' choice."""

    def __init__(self):
        super().__init__()
        self.left = Branch()
        self.right = Branch()

    def forward(self, x):
        return self.left(x) + self.right(x)


def _compiled_dropout(seed, **kw):
    """A healthy batch 0, then batch 1 from RNG seed `seed`, through inductor: the events."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoBranches().train()
    compiled = torch.compile(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))[2:3]
    sink = Collect()
    with watch(compiled, sinks=[sink], on_detect="report", **kw):
        compiled(x)
        torch.manual_seed(seed)
        compiled(x * 120)
    return sink.of(NonFiniteEvent)


@pytest.mark.slow
def test_a_compiled_models_dropout_is_not_replayed_eagerly_to_name_a_place():
    """Seed 4: inductor's masks overflow the left branch, eager dropout's (from the same RNG
    state) the right one."""
    (full,) = _compiled_dropout(4)
    assert (full.batch_number, full.module, full.tensor) == (1, "left.act", "output")  # what ran, recorded
    (sampled,) = _compiled_dropout(4, every_n_batches=10)
    # before: (1, "right.act", "output"), the other branch, from the eager replay's masks
    assert (sampled.batch_number, sampled.module, sampled.tensor) == (1, "", "output")
    assert sampled.uncertain == COMPILED_RANDOM


@pytest.mark.slow
def test_a_compiled_models_dropout_gives_no_verdict_the_eager_replay_cannot_back():
    """Seed 1: inductor's masks overflow the left branch, eager dropout's none: "compiler" before,
    though the eager model may overflow with inductor's masks."""
    (ev,) = _compiled_dropout(1, rerun_on_detect=True)
    assert (ev.batch_number, ev.module, ev.tensor) == (1, "left.act", "output")
    assert (ev.reproduced, ev.verdict) == (True, None)  # before: (True, "compiler")
    assert ev.uncertain == COMPILED_RANDOM
