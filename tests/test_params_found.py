"""Parameters replaced after watch() are found again: meta-device init then `to_empty()` (the
FSDP2 / big-model recipe), `load_state_dict(assign=True)` and a module swap give the model new
Parameter objects; the step guard, gradients=True, optimizer_state=True and skip accounting
follow the new ones, and a swapped-in module is watched under its path."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from _collect import Collect
from _models import TwoLinear as Net
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch
from tensorwatch_otel.core.events import SkippedStepEvent

INF = float("inf")


def _replaced(how: str, **opts):
    """A watched model whose parameters are all replaced after watch(), and its optimizer."""
    torch.manual_seed(0)
    sink = Collect()
    if how == "to_empty":
        with torch.device("meta"):
            model = Net()
        w = watch(model, sinks=[sink], **opts)
        model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    else:
        model = Net()
        w = watch(model, sinks=[sink], **opts)
        model.load_state_dict(Net().state_dict(), assign=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), sink, w


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before):
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


HOW = ["to_empty", "assign"]


@pytest.mark.parametrize("how", HOW)
def test_default_guard_names_the_inf_gradient_before_the_step(how):
    model, opt, sink, w = _replaced(how)
    with w:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()  # a healthy step first
        opt.zero_grad()
        (model(torch.randn(4, 8)).sum() * INF).backward()
        before = _weights(model)
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
        assert _unchanged(model, before)
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.phase, ev.batch_number) == ("b", "bias.grad", "backward", 1)
    assert sink.of(SkippedStepEvent) == []


@pytest.mark.parametrize("how", HOW)
def test_gradients_true_hooks_the_new_parameters(how):
    model, opt, sink, w = _replaced(how, gradients=True)
    with w:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        grads = {(f.module, t.name) for b in sink.batches if b.phase == "backward" for f in b.frames
                 for t in f.tensors}
        assert {("a", "weight.grad"), ("b", "bias.grad")} <= grads  # parameter gradients are measured
        # inf in a's weight gradient only: no activation gradient carries it
        (model(torch.randn(4, 8)).sum() + model.a.weight.sum() * INF).backward()
        before = _weights(model)
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()  # consumed by the step: a detection, before the weights change
        assert _unchanged(model, before)
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.phase, ev.batch_number) == ("a", "weight.grad", "backward", 1)
    assert sink.of(SkippedStepEvent) == []


@pytest.mark.parametrize("how", HOW)
def test_optimizer_state_of_the_new_parameters_is_measured(how):
    model, opt, sink, w = _replaced(how, optimizer_state=True)
    with w:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        names = {(f.module, t.name) for b in sink.batches if b.phase == "optimizer" for f in b.frames
                 for t in f.tensors}
        assert {("a", "weight.exp_avg_sq"), ("b", "bias.exp_avg")} <= names
        model(torch.randn(4, 8)).sum().backward()
        model.b.weight.grad.fill_(1e22)  # finite: the guard lets it through; exp_avg_sq overflows
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind, ev.phase) == ("b", "weight.exp_avg_sq", "inf", "optimizer")


def test_reset_inf_gradients_of_new_parameters_are_a_skip_not_silence():
    model, opt, sink, w = _replaced("to_empty", gradients=True)
    with w:
        (model(torch.randn(4, 8)).sum() + model.a.weight.sum() * INF).backward()
        opt.zero_grad(set_to_none=True)  # the loop decided not to step
        model(torch.randn(4, 8)).sum().backward()
    assert sink.of(NonFiniteEvent) == []
    (ev,) = sink.of(SkippedStepEvent)
    assert (ev.module, ev.tensor, ev.batch_number) == ("a", "weight.grad", 0)


def test_steady_state_finds_nothing_to_rescan():
    model, opt, sink, w = _replaced("to_empty", gradients=True, optimizer_state=True)
    with w:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        scans = w._session.hooks.index.scans
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert w._session.hooks.index.scans == scans


@pytest.mark.parametrize("gradients", [False, True])
def test_a_swapped_in_module_is_watched_under_its_path(gradients, caplog):
    torch.manual_seed(0)
    model = Net()
    sink = Collect()
    with watch(model, sinks=[sink], gradients=gradients) as w:
        old = model.b
        model.b = nn.Linear(16, 4)  # a new head after watch()
        with torch.no_grad():
            model.b.weight.fill_(0.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with caplog.at_level(logging.INFO, logger="tensorwatch_otel.core.frames.attach"):
            model(torch.randn(4, 8)).sum().backward()
        assert any("b (Linear)" in r.getMessage() and "replaced" in r.getMessage() for r in caplog.records)
        frames = [b for b in sink.batches if b.phase == "forward"][-1].frames
        b = next(f for f in frames if f.module == "b")
        assert next(t for t in b.tensors if t.name == "weight").abs_max == 0.5  # the new module's weight
        opt.step()
        opt.zero_grad()
        n = len(sink.batches)
        old(torch.randn(4, 16))  # the module swapped out is no longer watched
        assert len(sink.batches) == n and w.batch_number == 1
        (model(torch.randn(4, 8)).sum() + model.b.weight.sum() * INF).backward()
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.phase) == ("b", "weight.grad", "backward")


def test_the_kind_of_a_tensor_whose_storage_was_freed_is_not_read():
    # FSDP2 frees an unsharded parameter's storage after its module ran; a detection that asks
    # for its kind later must not read freed memory (it crashed the process)
    from tensorwatch_otel.core.measure.stats import nonfinite_kind_of

    p = nn.Parameter(torch.full((64, 64), INF))
    assert nonfinite_kind_of(p) == "inf"
    p.untyped_storage().resize_(0)
    assert nonfinite_kind_of(p) is None
    assert nonfinite_kind_of(torch.full((4, 4), INF)[1:, 2:]) == "inf"  # a view is read as usual


def test_functional_call_lends_tensors_without_a_rescan():
    torch.manual_seed(0)
    model = Net()
    sink = Collect()
    with watch(model, sinks=[sink]) as w:
        scans = w._session.hooks.index.scans
        for _ in range(3):
            lent = {n: p * 2 for n, p in model.named_parameters()}  # plain tensors, not Parameters
            torch.func.functional_call(model, lent, (torch.randn(4, 8),)).sum().backward()
        assert w._session.hooks.index.scans == scans and w.batch_number == 3
        model(torch.randn(4, 8)).sum().backward()
        assert w._session.hooks.index.scans == scans


def test_a_rescan_that_fails_logs_once_and_training_goes_on(monkeypatch, caplog):
    from tensorwatch_otel.core.frames.attach import HookSet

    placed = HookSet.rescan

    def broken(hooks, first=False):
        if first:  # watch() places the hooks; the rescans after it fail
            return placed(hooks, first=True)
        raise RuntimeError("boom")

    monkeypatch.setattr(HookSet, "rescan", broken)
    model, opt, sink, w = _replaced("to_empty")
    with w, caplog.at_level(logging.ERROR, logger="tensorwatch_otel.core.watcher"):
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert w.batch_number == 3
    said = [r for r in caplog.records if "replaced parameters" in r.getMessage()]
    assert len(said) == 1 and "boom" in said[0].getMessage()
