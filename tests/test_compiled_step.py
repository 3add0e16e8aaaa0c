"""A compiled optimizer step (PyTorch's recipe: a function calling `opt.step()` under
torch.compile) next to a compiled watched model (issue 37, item 2): the step guard and
on_detect="skip" hold at every step, not only at the one dynamo traced. Before, dynamo traced
the global step hooks into the compiled step: they ran once, at trace time, and an inf born in
the backward reached the weights, reported a batch late as a forward `weight`. Real inductor."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch
from tensorwatch_otel.core.events import SkippedNonFiniteStepEvent

INF = float("inf")
BATCHES = 7
BAD = (2, 5)  # batches whose backward makes a gradient inf


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(BATCHES)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def _train(model, opt, data, bad=(), take=lambda b: True):
    """The model and its step compiled; batches in `bad` get an inf in a weight's gradient
    (a tensor hook: born in the backward, the forward finite); steps where `take(b)` is False
    are not called (the reference run)."""
    compiled = torch.compile(model)

    @torch.compile
    def step():
        opt.step()

    for b, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(compiled(x), y)
        hook = model[1].weight.register_hook(lambda g: torch.full_like(g, INF)) if b in bad else None
        loss.backward()
        if hook is not None:
            hook.remove()
        if take(b):
            step()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_raise_stops_a_compiled_step_before_the_weights_change():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = _data()
    before = {}

    def keep(b):  # the weights before each step
        before.clear()
        before.update({n: p.detach().clone() for n, p in model.named_parameters()})
        return True

    with pytest.raises(NonFiniteDetected) as ei:
        with watch(model, sinks=[], on_detect="raise"):
            _train(model, opt, data, bad=BAD, take=keep)
    ev = ei.value.event
    # named where it was born, at the step of that batch, not a batch later as a forward weight
    assert (ev.batch_number, ev.module, ev.tensor, ev.phase) == (BAD[0], "1", "weight.grad", "backward")
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all() and torch.equal(p, before[n]), n


def test_skip_skips_every_bad_compiled_step_exactly_as_if_never_called():
    data = _data()
    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    _train(ref, ref_opt, data, take=lambda b: b not in BAD)
    torch._dynamo.reset()

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="skip") as w:
        _train(model, opt, data, bad=BAD)
    assert [e.batch_number for e in sink.of(SkippedNonFiniteStepEvent)] == list(BAD)
    assert [(e.module, e.tensor) for e in sink.of(SkippedNonFiniteStepEvent)] == [("1", "weight.grad")] * 2
    assert w.nonfinite_steps_skipped == len(BAD)
    assert sink.of(NonFiniteEvent) == []
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n  # bit for bit
    assert opt.state[model[0].weight]["step"].item() == BATCHES - len(BAD)


def test_a_step_compiled_into_one_graph_says_loudly_that_it_is_not_checked(caplog):
    # fullgraph=True cannot be split around the watcher's hooks: the compile must still work, and
    # the watcher says (at ERROR, once) that this step goes unchecked
    class PlainSGD(torch.optim.Optimizer):  # torch's own optimizers cannot compile in one graph
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    model = _model()
    opt = PlainSGD(model.parameters())

    @torch.compile(fullgraph=True)
    def step():
        opt.step()

    with caplog.at_level(logging.ERROR, logger="tensorwatch_otel"):
        with watch(model, sinks=[]):
            for x, y in _data()[:3]:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                step()
    said = [r for r in caplog.records if "fullgraph=True" in r.getMessage()]
    assert len(said) == 1 and "not checked" in said[0].getMessage()


@pytest.mark.slow
def test_ddp_skip_with_a_compiled_step_every_rank_skips_and_ends_as_the_run_without_that_step(tmp_path):
    from test_fleet_stop import events_of, launch

    at, batches = 3, 6
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    proc, ref, _ = launch(ref_dir, 2, "--mode", "ddp", "--reference", "--at", str(at), "--batches", str(batches),
                          "--compile-step")
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc, results, _ = launch(tmp_path, 2, "--mode", "ddp", "--on-detect", "skip", "--inject", "grad", "--bad", "1",
                              "--at", str(at), "--batches", str(batches), "--compile-step")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r, res in results.items():
        assert res["batches_done"] == batches and res["weights_finite"], res
        assert [e.batch_number for e in events_of(tmp_path, r) if e.event == "skipped_nonfinite_step"] == [at]
        assert res["weights"] == ref[r]["weights"]  # bit for bit (floats through JSON keep every bit)
