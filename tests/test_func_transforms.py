"""A watched model under torch.func transforms and torch.jit.trace (issue 28): vmap, grad,
functional_call, jvp and functionalize calls are measured through the plain tensors the
transforms wrap (under vmap: every sample at once), and training never breaks; jit.trace leaves
the hooks out of its graph and the traced module runs unwatched."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp, vmap

from _collect import Collect
from _hooks import remaining_hooks
from _models import TwoLinear as Net
from tensorwatch_otel import DebugUnderflowOverflow, NonFiniteDetected, watch


def _forward(sink):
    return [b for b in sink.batches if b.phase == "forward"]


def _table(batch):
    return [(f.module, [(t.name, t.abs_min, t.abs_max, t.note) for t in f.tensors]) for f in batch.frames]


def _same_table(a, b):
    assert [(m, [t[0] for t in ts]) for m, ts in a] == [(m, [t[0] for t in ts]) for m, ts in b]
    for (_, ta), (_, tb) in zip(a, b):
        for (_, mn_a, mx_a, note_a), (_, mn_b, mx_b, note_b) in zip(ta, tb):
            assert note_a == note_b == ""
            assert mn_a == pytest.approx(mn_b, rel=1e-5, abs=1e-7) and mx_a == pytest.approx(mx_b, rel=1e-5)


@pytest.mark.parametrize("gradients", [False, True])
def test_vmap_is_one_batch_measured_over_every_sample(gradients, caplog):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(6, 8)
    sink = Collect()
    w = watch(model, sinks=[sink], gradients=gradients)
    with caplog.at_level(logging.INFO, logger="tensorwatch_otel"):
        want = model(x)
        got = vmap(model)(x)  # per sample: each call sees one row
        again = vmap(model)(x)
    assert torch.allclose(got, want) and torch.allclose(again, want)
    assert w.batch_number == 3
    plain, batched, _ = _forward(sink)
    _same_table(_table(batched), _table(plain))  # the same frames, over all six samples
    said = [r for r in caplog.records if "torch.func" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO  # once
    w.detach()


def test_an_inf_in_one_sample_is_detected_under_vmap():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(6, 8)
    x[3, 5] = math.inf
    w = watch(model, sinks=[Collect()])
    with pytest.raises(NonFiniteDetected) as info:
        vmap(model)(x)
    event = info.value.event
    assert (event.module, event.tensor, event.kind, event.batch_number) == ("a", "input[0]", "inf", 0)
    w.detach()


def _loss(model):
    def loss(params, xi, yi):
        return F.mse_loss(functional_call(model, params, (xi.unsqueeze(0),)), yi.unsqueeze(0))
    return loss


@pytest.mark.parametrize("gradients", [False, True])
def test_per_sample_gradients_with_grad_and_functional_call(gradients):
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(5, 8), torch.randn(5, 4)
    twin = Net()
    twin.load_state_dict(model.state_dict())
    sink = Collect()
    w = watch(model, sinks=[sink], gradients=gradients)
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(_loss(model)), in_dims=(None, 0, 0))(params, x, y)
    one = grad(_loss(model))(params, x[2], y[2])
    for i in range(5):  # the same gradients as one backward per sample of an unwatched twin
        twin.zero_grad()
        F.mse_loss(twin(x[i:i + 1]), y[i:i + 1]).backward()
        for name, p in twin.named_parameters():
            assert torch.allclose(per_sample[name][i], p.grad, atol=1e-6)
            if i == 2:
                assert torch.allclose(one[name], p.grad, atol=1e-6)
    assert w.batch_number == 2
    vmapped, single = _forward(sink)
    for batch in (vmapped, single):
        weights = {(f.module, t.name): (t.abs_min, t.abs_max) for f in batch.frames for t in f.tensors}
        for name, p in model.named_parameters():  # measured through the tensors lent to the call
            module, _, tensor = name.rpartition(".")
            a = p.detach().abs()
            assert weights[(module, tensor)] == pytest.approx((a.min().item(), a.max().item()))
    inputs = {t.name: t.abs_max for t in vmapped.frames[0].tensors}
    assert inputs["input[0]"] == pytest.approx(x.abs().max().item())  # every sample's rows
    model(x).sum().backward()  # and ordinary training goes on, watched
    assert w.batch_number == 3 and len(_forward(sink)) == 3
    w.detach()
    assert remaining_hooks(model) == {}


@pytest.mark.slow
def test_a_table_of_in_graph_statistics_leaves_calls_under_torch_func_alone(monkeypatch):
    """A compiled watched model run earlier in the process made a table of in-graph statistics
    (core/measure/graph_stats.py); a batch begun inside torch.func.grad then stamps it without the
    transform seeing it (before: grad refused the in-place write to a captured tensor)."""
    from tensorwatch_otel.core.measure import graph_stats

    monkeypatch.setattr(graph_stats, "ON", True)
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled_model = Net()
    with watch(compiled_model, sinks=[]):
        torch.compile(compiled_model)(torch.randn(2, 8))
    torch._dynamo.reset()
    assert graph_stats.has_tables()
    model, x, y = Net(), torch.randn(5, 8), torch.randn(5, 4)
    sink = Collect()
    with watch(model, sinks=[sink]):
        params = {k: v.detach() for k, v in model.named_parameters()}
        grad(_loss(model))(params, x[2], y[2])
    assert len(_forward(sink)) == 1


def test_jvp_is_measured_through_its_primal_values():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    sink = Collect()
    w = watch(model, sinks=[sink])
    out, tangent = jvp(model, (x,), (torch.ones_like(x),))
    assert torch.allclose(out, model(x))
    plain, dual = _forward(sink)[1], _forward(sink)[0]
    _same_table(_table(dual), _table(plain))
    w.detach()


def test_functionalize_runs_and_is_measured():
    """Once crashed the process (the CPU kernel read a functional tensor's null data pointer):
    run in a process of its own."""
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        import torch
        from _collect import Collect
        from test_func_transforms import Net
        from tensorwatch_otel import watch
        from tensorwatch_otel.core.measure import cpu_kernel
        cpu_kernel.KERNEL.wait()
        torch.manual_seed(0)
        model, x = Net(), torch.randn(4, 8)
        sink = Collect()
        w = watch(model, sinks=[sink])
        for _ in range(3):
            want = model(x)
        got = torch.func.functionalize(model)(x)
        assert torch.allclose(got, want)
        frames = [b for b in sink.batches if b.phase == "forward"]
        plain, functional = frames[2], frames[3]
        print([[(t.name, t.abs_max, t.note) for t in f.tensors] for f in plain.frames] ==
              [[(t.name, t.abs_max, t.note) for t in f.tensors] for f in functional.frames], w.batch_number)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "4"]


@pytest.mark.parametrize("options", [{}, {"gradients": True}, {"check": "module"}], ids=str)
def test_jit_trace_leaves_the_hooks_out_of_its_graph(options):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    sink = Collect()
    w = watch(model, sinks=[sink], **options)
    model(x)
    unchecked = torch.jit.trace(model, x, check_trace=False)
    assert w.batch_number == 1  # tracing is no batch
    traced = torch.jit.trace(model, x)  # traces again, and checks against an eager call of the model
    assert w.batch_number == 2  # that eager call is a batch, as any call of the model
    for graph in (str(unchecked.inlined_graph), str(traced.inlined_graph)):
        assert "aten::linear" in graph and "aminmax" not in graph and "abs" not in graph
    with torch.no_grad():
        assert torch.equal(traced(x), model(x)) and torch.equal(unchecked(x), traced(x))
    assert w.batch_number == 3  # the traced modules are not watched; the model still is
    assert [b.batch_number for b in _forward(sink)] == [0, 1, 2]
    w.detach()
    assert remaining_hooks(model) == {}


def test_the_dropin_under_vmap_and_jit_trace(capsys):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    debug = DebugUnderflowOverflow(model, trace_batch_nums=[0, 1])
    want = model(x)
    assert torch.allclose(vmap(model)(x), want)
    traced = torch.jit.trace(model, x, check_trace=False)
    assert torch.allclose(traced(x), want)
    assert debug.batch_number == 2
    out = capsys.readouterr().out
    assert out.count("*** Starting batch number=") == 2  # batches 0 (eager) and 1 (vmap)
    debug.detach()
