"""on_detect="skip": a verdict belongs to the gradients it was made on (issue 37, item 1).

A forward that went non-finite spoils the gradients its backward writes, and only those: the
step that consumes them is skipped. Before, the verdict waited for whatever step came next, so a
loop that drops its own bad batch (`continue` before the backward), a validation forward run with
grad enabled, and Lightning's documented skip (training_step returning None) each lost the next
healthy step. Every scenario here compares the final weights, bit for bit, with the same loop run
unwatched. Real models, real optimizers, a real Lightning Trainer."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from _collect import Collect
from tensorwatch_otel import NonFiniteEvent, watch
from tensorwatch_otel.core.events import SkippedNonFiniteStepEvent

INF = float("inf")
BATCHES = 8
BAD = 3


def _data(n=BATCHES, bad=(BAD,)):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]
    for b in bad:
        data[b][0][0, 0] = INF
    return data


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _both(loop, model_fn=_net, **watch_options):
    """`loop(model, opt)` run unwatched and watched (on_detect="skip") from the same weights:
    (unwatched model, watched model, the watched run's events)."""
    ref = model_fn()
    loop(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    model = model_fn()
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="skip", **watch_options):
        loop(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return ref, model, sink


# -- (a) a loop that drops its own bad batch ---------------------------------------------------

@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_loop_that_continues_past_a_nonfinite_loss_loses_no_healthy_step(set_to_none):
    data = _data()

    def loop(model, opt):
        for x, y in data:
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.mse_loss(model(x), y)
            if not torch.isfinite(loss):
                continue  # the loop's own skip: no backward, no step
            loss.backward()
            opt.step()

    ref, model, sink = _both(loop)
    assert _same(ref, model)
    assert [e.batch_number for e in sink.of(NonFiniteEvent)] == [BAD]  # recorded, as "report" records it
    assert sink.of(SkippedNonFiniteStepEvent) == []  # no step consumed that batch's gradients


# -- (b) a validation forward with grad enabled ------------------------------------------------

def test_a_validation_forward_with_grad_enabled_that_meets_an_inf_skips_no_training_step():
    data = _data(bad=())
    probe = torch.full((2, 8), INF)

    def loop(model, opt):
        for b, (x, y) in enumerate(data):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            if b == BAD:
                model(probe)  # validation without torch.no_grad(): its output is never backwarded

    ref, model, sink = _both(loop)
    assert _same(ref, model)
    assert [e.batch_number for e in sink.of(NonFiniteEvent)] == [BAD + 1]
    assert sink.of(SkippedNonFiniteStepEvent) == []


def test_a_validation_forward_between_backward_and_step_does_not_spoil_that_step():
    data = _data(bad=())
    probe = torch.full((2, 8), INF)

    def loop(model, opt):
        for b, (x, y) in enumerate(data):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            if b == BAD:
                model(probe)  # its graph is never backwarded: the gradients are the training batch's
            opt.step()

    ref, model, sink = _both(loop)
    assert _same(ref, model)
    assert sink.of(SkippedNonFiniteStepEvent) == []


# -- gradients that did take the bad forward ---------------------------------------------------

class _Masked(nn.Module):
    """An inf in the forward that the loss never sees (its column is dropped): the gradients stay
    finite, so only the forward's verdict can say the step is spoilt."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 5)
        self.spike = _Spike()

    def forward(self, x, poison=False):
        return self.spike(self.a(x), poison)[:, 1:]


class _Spike(nn.Module):
    def forward(self, h, poison):
        return torch.where(torch.arange(h.shape[1]) == 0, torch.full_like(h, INF), h) if poison else h


def test_a_spoilt_micro_batch_skips_the_step_of_its_accumulation_window_and_only_that_one():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 8, generator=g) for _ in range(12)]
    spoilt = 5  # in the second window of four

    def loop(model, opt, take=lambda window: True, watched=True):
        for b, x in enumerate(xs):
            model(x, poison=watched and b == spoilt).square().mean().backward()
            if b % 4 == 3:
                if take(b // 4):
                    opt.step()
                opt.zero_grad()

    ref = _Masked()
    loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1), take=lambda w: w != 1, watched=False)
    model = _Masked()
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="skip"):
        loop(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _same(ref, model)
    (skip,) = sink.of(SkippedNonFiniteStepEvent)
    assert (skip.batch_number, skip.module, skip.tensor, skip.phase) == (spoilt, "spike", "output", "forward")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_spoilt_gradients_zeroed_without_a_step_take_their_verdict_with_them(set_to_none):
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 8, generator=g) for _ in range(6)]

    def loop(model, opt, watched=True):
        for b, x in enumerate(xs):
            opt.zero_grad(set_to_none=set_to_none)
            loss = model(x, poison=watched and b == BAD).square().mean()
            loss.backward()
            if b == BAD:
                continue  # the loop drops this batch after its backward: the next zero_grad resets it
            opt.step()

    ref = _Masked()
    loop(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), watched=False)
    model = _Masked()
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="skip"):
        loop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert _same(ref, model)
    assert sink.of(SkippedNonFiniteStepEvent) == []


def test_a_spoilt_step_is_still_skipped_with_a_compiled_model():
    # in a compiled graph the root's output reaches the hook without its autograd node: the
    # verdict then holds once a backward writes the parameters' gradients
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 8, generator=g) for _ in range(5)]

    def loop(model, opt, poison_at, drop_at=None):
        compiled = torch.compile(model)
        for b, x in enumerate(xs):
            opt.zero_grad()
            out = compiled(x + (INF if b in (poison_at, drop_at) else 0.0))
            if b == drop_at:
                continue  # dropped before its backward: no verdict on the next step
            out.square().mean().backward()
            opt.step()

    try:
        model = _net()
        sink = Collect()
        with watch(model, sinks=[sink], on_detect="skip"):
            loop(model, torch.optim.SGD(model.parameters(), lr=0.1), poison_at=1, drop_at=3)
        assert [e.batch_number for e in sink.of(SkippedNonFiniteStepEvent)] == [1]
        assert [e.batch_number for e in sink.of(NonFiniteEvent)] == [1, 3]
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        torch._dynamo.reset()


# -- (c) Lightning's skip: training_step returns None ------------------------------------------

def _lightning_fit(model, callbacks):
    import lightning.pytorch as pl

    g = torch.Generator().manual_seed(0)
    xs = torch.randn(48, 8, generator=g)
    xs[4 * 5, 0] = INF  # batch 5 of 12, inside the second window of four
    ds = torch.utils.data.TensorDataset(xs, torch.randn(48, 1, generator=g))
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=4, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1, num_sanity_val_steps=0, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's "training_step returned None" and CPU notes
        trainer.fit(model, torch.utils.data.DataLoader(ds, batch_size=4))


def test_lightning_training_step_returning_none_under_accumulation_loses_no_step():
    import lightning.pytorch as pl

    from tensorwatch_otel.integrations.lightning import TensorwatchCallback

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.out(torch.relu(self.inp(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self(x), y)
            return loss if torch.isfinite(loss) else None  # Lightning's documented skip

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    ref = Regressor()
    model = copy.deepcopy(ref)
    _lightning_fit(ref, [])
    sink = Collect()
    _lightning_fit(model, [TensorwatchCallback(sinks=[sink], on_detect="skip")])
    assert _same(ref, model)
    assert [e.batch_number for e in sink.of(NonFiniteEvent)] == [5]
    assert sink.of(SkippedNonFiniteStepEvent) == []
