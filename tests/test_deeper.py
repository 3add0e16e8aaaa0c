"""Deeper than the forward: optimizer state watched after each step (the exp_avg_sq that goes
inf on a finite 1e20 gradient), and the offending batch captured and replayed into a detection."""

from __future__ import annotations

import os

import torch
from torch import nn

import pytest
from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, load_capture, watch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(8, 2)

    def forward(self, x, *, scale=1.0):
        return self.b(self.drop(torch.relu(self.a(x)))) * scale


def test_optimizer_state_inf_from_a_huge_finite_gradient_is_detected_and_named():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sink = Collect()
    with watch(model, sinks=[sink], optimizer_state=True, gradients=True):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()  # healthy step: state measured, finite
        opt.zero_grad()
        assert sink.of(NonFiniteEvent) == []
        model(torch.randn(3, 4)).sum().backward()
        # finite, but (1 - beta2) * g * g is not: 1e-3 * 1e44 > 3.4e38, the float32 max
        model.b.weight.grad.fill_(1e22)
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind, ev.phase) == ("b", "weight.exp_avg_sq", "inf", "optimizer")
    assert torch.isinf(opt.state[model.b.weight]["exp_avg_sq"]).all()
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the weights are still finite
    assert all(f.phase == "optimizer" for f in ev.frames)
    names = {t.name for f in ev.frames for t in f.tensors}
    assert {"weight.exp_avg", "weight.exp_avg_sq", "bias.exp_avg"} <= names


def test_optimizer_state_off_by_default_costs_no_read():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report"):
        model(torch.randn(3, 4)).sum().backward()
        model.b.weight.grad.fill_(1e22)
        opt.step()
    assert sink.of(NonFiniteEvent) == []


def test_capture_written_on_detection_and_replayed_into_a_detection(tmp_path):
    torch.manual_seed(0)
    model = Net()
    cap_dir = tmp_path / "captures"
    sink = Collect()
    inputs = [torch.randn(3, 4) for _ in range(4)]
    inputs[2][0, 0] = float("inf")
    with watch(model, sinks=[sink], capture_dir=str(cap_dir)):
        model(inputs[0], scale=2.0)
        model(inputs[1], scale=2.0)
        assert not cap_dir.exists() or os.listdir(cap_dir) == []  # nothing written without a detection
        rng_at_start = torch.get_rng_state()
        with pytest.raises(NonFiniteDetected) as ei:
            model(inputs[2], scale=3.0)
    ev = ei.value.event
    assert ev.capture and os.path.isfile(ev.capture) and ev.batch_number == 2
    assert os.listdir(cap_dir) == [os.path.basename(ev.capture)]
    cap = load_capture(ev.capture)
    assert cap.batch_number == 2 and cap.kwargs == {"scale": 3.0}
    assert torch.equal(cap.args[0], inputs[2])
    torch.manual_seed(123)
    cap.restore_rng()
    assert torch.equal(torch.get_rng_state(), rng_at_start)
    # the replay recipe: same weights, restored RNG, check="module": the same place again
    with watch(model, sinks=[Collect()], check="module"):
        with pytest.raises(NonFiniteDetected) as again:
            model(*cap.args, **cap.kwargs)
    assert (again.value.event.module, again.value.event.tensor) == (ev.module, ev.tensor)


def test_load_capture_rejects_other_files(tmp_path):
    p = tmp_path / "x.pt"
    torch.save({"hello": 1}, p)
    with pytest.raises(ValueError, match="not a tensorwatch_otel capture"):
        load_capture(str(p))


class _Blow(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by 1e39 (inf in float32)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1e39


class Blow(nn.Module):
    def forward(self, x):
        return _Blow.apply(x)


class BlowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.blow = Blow()
        self.relu = nn.ReLU(inplace=True)  # an in-place op right after a hooked output
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        return self.b(self.relu(self.blow(self.a(x))))


def test_backward_detection_names_the_module_whose_backward_made_the_inf():
    torch.manual_seed(0)
    model = BlowNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, sinks=[Collect()], gradients=True):
        model(torch.randn(3, 4)).square().sum().backward()
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
    ev = ei.value.event
    # 1e39 is inf in float32; where ReLU zeroed the gradient, 0 * inf is NaN: the abs max reads NaN
    assert (ev.module, ev.module_class, ev.tensor, ev.phase) == ("blow", "Blow", "input[0].grad", "backward")
    assert ev.kind in ("inf", "nan", "inf,nan")
    assert not torch.isfinite(model.a.bias.grad).all()
    # the ring holds the backward frames before it, in backward order, all finite
    order = [(f.module, f.tensors[0].name) for f in ev.frames]
    assert order[-1] == ("blow", "input[0].grad")
    assert ("b", "output.grad") in order and ("blow", "output.grad") in order
    assert order.index(("b", "output.grad")) < order.index(("blow", "output.grad"))
    assert all(not f.kind for f in ev.frames[:-1])


def test_activation_gradients_finite_run_is_quiet_and_hooks_do_not_pile_up():
    torch.manual_seed(0)
    model = BlowNet()
    model.blow = nn.Identity()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = Collect()
    with watch(model, sinks=[sink], gradients=True):
        for _ in range(5):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert sink.of(NonFiniteEvent) == []


class Flaky(nn.Module):
    """Overflows only while `fault` is set: a transient (device-like) fault, not a numeric one."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fault = False

    def forward(self, x):
        y = self.lin(x)
        if self.fault:
            self.fault = False  # gone on the next call, like a flipped bit
            y = y * float("inf")
        return y


def test_rerun_tells_numbers_from_a_transient_fault():
    torch.manual_seed(0)
    model = nn.Sequential(Flaky(), nn.Dropout(0.3), nn.Linear(4, 2))
    with watch(model, sinks=[Collect()], rerun_on_detect=True):
        model(torch.randn(2, 4))
        model[0].fault = True
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.randn(2, 4))
    ev = ei.value.event
    assert ev.module == "0.lin" or ev.module == "0"
    assert ev.reproduced is False and ev.host

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Linear(4, 2))
    bn = nn.BatchNorm1d(2)
    model.append(bn)
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    with watch(model, sinks=[Collect()], rerun_on_detect=True) as w:
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.randn(3, 4))
        assert w.batch_number == 1  # the replay is no batch of its own
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.reproduced) == ("0", "weight", True)


def test_capture_phase_and_rerun_reach_json_lines_and_the_span(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tensorwatch_otel.report.codec import read_events
    from tensorwatch_otel.sinks import JsonlLog, OtelTelemetry

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    log_path = tmp_path / "events.jsonl"
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    with watch(model, sinks=[JsonlLog(str(log_path)), OtelTelemetry(tracer_provider=tp)],
               capture_dir=str(tmp_path / "cap"), rerun_on_detect=True):
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.randn(2, 4))
    ev = ei.value.event
    (back,) = [e for e in read_events(str(log_path)) if isinstance(e, NonFiniteEvent)]
    assert (back.capture, back.phase, back.reproduced, back.host) == (ev.capture, "forward", True, ev.host)
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "tensorwatch.nonfinite_detected"]
    assert span.attributes["tensorwatch.capture"] == ev.capture
    assert span.attributes["tensorwatch.phase"] == "forward"
    assert span.attributes["tensorwatch.reproduced"] is True
    tp.shutdown()


def test_gradients_and_optimizer_state_reach_the_metrics_without_counting_as_batches():
    from prometheus_client import CollectorRegistry

    from tensorwatch_otel.sinks import PrometheusMetrics

    registry = CollectorRegistry()
    sink = PrometheusMetrics(registry=registry)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch(model, sinks=[sink], gradients=True, optimizer_state=True):
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    value = registry.get_sample_value
    assert value("tensorwatch_batches_total", {"rank": "0"}) == 3
    # the gauges hold the extremes of the window's batches: at least the last step's value
    got = value("tensorwatch_tensor_abs_max", {"module": "b", "module_class": "Linear",
                                               "tensor": "weight.exp_avg_sq", "rank": "0"})
    assert got >= opt.state[model.b.weight]["exp_avg_sq"].abs().max().item() > 0
    assert value("tensorwatch_tensor_abs_max", {"module": "b", "module_class": "Linear",
                                                "tensor": "output.grad", "rank": "0"}) == 1.0
    sink.close()
