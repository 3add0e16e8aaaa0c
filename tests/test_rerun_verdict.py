"""rerun_on_detect on a compiled model says who is to blame: the batch is replayed eagerly and
through the compiled callable, and the event's `verdict` is "model" (the eager replay
reproduces the inf/nan), "compiler" (only the compiled replay does) or "transient" (neither).
An eager model gets no verdict. Compiles use the "eager" backend (dynamo traces the model, as
every backend does, and runs the graph without generating code), so each test takes a second.

The "compiler" case needs a graph that computes something the eager model does not: a module
that multiplies by inf only while `torch.compiler.is_compiling()` is true stands in for a
miscompile (a test double; no real compiler bug is needed to show which replay reproduces)."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from torch import nn

from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch
from tensorwatch_otel.core.batch.capture import BatchCapture
from tensorwatch_otel.core.config import WatchConfig
from tensorwatch_otel.core.batch.rerun import rerun_verdict
from tensorwatch_otel.core.watcher import Watcher


class Miscompiled(nn.Module):
    """Finite eagerly; its compiled graph multiplies by inf (a miscompile's test double)."""

    def forward(self, x):
        if torch.compiler.is_compiling():
            return x * math.inf
        return x


class FirstCallFault(nn.Module):
    """inf on its first call only (a counter the captured batch does not hold): transient."""

    def __init__(self):
        super().__init__()
        self.fault = True

    def forward(self, x):
        if self.fault:
            self.fault = False
            return x * math.inf
        return x


def _net(middle: nn.Module, bad_weight: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), middle, nn.Linear(4, 2))
    if bad_weight:
        with torch.no_grad():
            net[0].weight[0, 0] = math.inf
    return net


def _detect(compiled: nn.Module, **kw) -> NonFiniteEvent:
    with watch(compiled, sinks=[Collect()], rerun_on_detect=True, **kw):
        with pytest.raises(NonFiniteDetected) as ei:
            compiled(torch.randn(3, 4))
    return ei.value.event


@pytest.mark.parametrize("middle, bad_weight, verdict, reproduced", [
    (nn.ReLU(), True, "model", True),
    (Miscompiled(), False, "compiler", True),
    (FirstCallFault(), False, "transient", False),
], ids=["weights-model", "miscompile-compiler", "first-call-transient"])
def test_a_compiled_models_detection_says_which_replay_reproduces_it(middle, bad_weight, verdict, reproduced):
    torch._dynamo.reset()
    net = _net(middle, bad_weight)
    ev = _detect(torch.compile(net, backend="eager"))
    assert (ev.verdict, ev.reproduced) == (verdict, reproduced)
    assert ev.host  # named whenever a replay ran
    back = pickle.loads(pickle.dumps(ev))  # frames may hold nan (!= itself): compare the fields
    assert (back.verdict, back.reproduced, back.host) == (ev.verdict, ev.reproduced, ev.host)
    assert back.trace_id == ev.trace_id


def test_the_replays_leave_the_model_and_the_callers_inputs_as_they_were():
    torch._dynamo.reset()
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Miscompiled())
    compiled = torch.compile(net, backend="eager")
    x = torch.randn(3, 4)
    x_before = x.clone()
    with watch(compiled, sinks=[Collect()], rerun_on_detect=True) as w:
        with pytest.raises(NonFiniteDetected) as ei:
            compiled(x)
        assert w.batch_number == 1  # the replays are no batches of their own
    stats = net[1].running_mean.clone(), net[1].num_batches_tracked.clone()
    assert ei.value.event.verdict == "compiler"
    assert int(stats[1]) == 1  # the training forward's update only, not the two replays'
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)


def test_an_eager_model_has_no_verdict():
    net = _net(nn.ReLU(), bad_weight=True)
    ev = _detect(net)
    assert (ev.reproduced, ev.verdict) == (True, None)


def _probe(model, sink):
    return Watcher(model, [sink], WatchConfig.build(check="module", on_detect="report", max_frames=1,
                                                    guard_steps=False, environ={}))


def _held(x: torch.Tensor) -> BatchCapture:
    held = BatchCapture("", 0)
    held.hold(0, (x,), {})
    return held


@pytest.mark.parametrize("how", ["watch-compiled", "compile-in-place", "compiled-after-watch", "compiled-block"])
@pytest.mark.parametrize("middle, verdict", [(Miscompiled, "compiler"), (nn.ReLU, "model")])
def test_the_verdict_holds_for_every_way_of_compiling(how, middle, verdict):
    """The replays themselves, for the ways of compiling a watched model: the compiled
    replay runs the callable the user runs, the eager one the model with every compile ignored."""
    torch._dynamo.reset()
    net = _net(middle(), bad_weight=verdict == "model")
    x = torch.randn(3, 4)
    if how == "watch-compiled":
        watched = user = torch.compile(net, backend="eager")
    elif how == "compile-in-place":
        net.compile(backend="eager")
        watched = user = net
    elif how == "compiled-block":  # each block compiled on its own (torchtitan's way)
        net[1] = torch.compile(net[1], backend="eager")
        watched = user = net
    else:
        watched, user = net, torch.compile(net, backend="eager")
    assert not torch.isfinite(user(x)).all()  # the run the detection saw
    got = rerun_verdict(watched, _held(x), 0, "", "output", _probe)
    assert got == (True, verdict)
    if how != "compiled-after-watch":
        assert not torch.isfinite(user(x)).all()  # still compiled after the eager replay


def test_no_compiled_callable_no_verdict():
    net = _net(Miscompiled())
    x = torch.randn(3, 4)
    assert rerun_verdict(net, _held(x), 0, "", "output", _probe) == (False, None)


def test_the_verdict_reaches_json_lines_and_the_span(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tensorwatch_otel.report.codec import read_events
    from tensorwatch_otel.sinks import JsonlLog, OtelTelemetry

    torch._dynamo.reset()
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    log_path = tmp_path / "events.jsonl"
    compiled = torch.compile(_net(Miscompiled()), backend="eager")
    with watch(compiled, sinks=[JsonlLog(str(log_path)), OtelTelemetry(tracer_provider=tp)], rerun_on_detect=True):
        with pytest.raises(NonFiniteDetected) as ei:
            compiled(torch.randn(3, 4))
    assert ei.value.event.verdict == "compiler"
    (back,) = [e for e in read_events(str(log_path)) if isinstance(e, NonFiniteEvent)]
    assert (back.verdict, back.reproduced) == ("compiler", True)
    assert json.loads(log_path.read_text().splitlines()[-1])["verdict"] == "compiler"
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "tensorwatch.nonfinite_detected"]
    assert span.attributes["tensorwatch.verdict"] == "compiler"
    assert span.attributes["tensorwatch.reproduced"] is True
    tp.shutdown()


def test_an_eager_models_detection_carries_no_verdict_field_or_attribute(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tensorwatch_otel.sinks import JsonlLog, OtelTelemetry

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    log_path = tmp_path / "events.jsonl"
    net = _net(nn.ReLU(), bad_weight=True)
    with watch(net, sinks=[JsonlLog(str(log_path)), OtelTelemetry(tracer_provider=tp)], rerun_on_detect=True):
        with pytest.raises(NonFiniteDetected):
            net(torch.randn(3, 4))
    text = log_path.read_text()
    line = json.loads(text.splitlines()[-1])
    assert line["reproduced"] is True and "verdict" not in line
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "tensorwatch.nonfinite_detected"]
    assert "tensorwatch.verdict" not in span.attributes
    tp.shutdown()
