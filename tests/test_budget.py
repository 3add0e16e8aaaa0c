"""max_overhead= (TENSORWATCH_MAX_OVERHEAD): the watcher times its own work, and measures one batch
in N, N chosen so that its share of the step stays within the budget; detection (the step guard)
stays on every batch.

The policy's tests drive core/batch/sampling.py with a fake clock (deterministic); the real ones train a
small model whose frame recording is made slow on purpose, so their assertions hold on a busy
machine: they test directions and bounds with wide margins, never exact timings.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
import urllib.request

import pytest
import torch

from _collect import Collect
from _models import TwoLinear
from _otel_fixtures import parse_prom, sample
from tensorwatch_otel import DebugUnderflowOverflow, NonFiniteDetected, watch
from tensorwatch_otel.core.batch.sampling import MAX_INTERVAL, OverheadBudget
from tensorwatch_otel.core.config import ConfigError, WatchConfig
from tensorwatch_otel.core.events import SamplingRateEvent
from tensorwatch_otel.core.frames.recorder import FrameRecorder

# mostly waiting (a server's interval, a timeout): scripts/test.sh runs the tests marked `waits`
# beside the CPU-bound parallel pass, in a process of their own
pytestmark = pytest.mark.waits


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def drive(policy, clock, batches, base, measured_cost, unmeasured_cost=0.0, start=0, jitter=0.0, seed=0):
    """`batches` batches through `policy`: each takes `base` seconds of the model's own work plus
    the watcher's (`measured_cost` in a measured batch, `unmeasured_cost` in the others), each
    cost scaled by a factor in [1 - jitter, 1 + jitter]. The measured batch numbers come back."""
    rng = random.Random(seed)
    measured = []
    for b in range(start, start + batches):
        m = policy.watches(b)
        assert policy.watches(b) == m  # asked again about the same batch: the same answer
        if m:
            measured.append(b)
        t0 = clock()
        clock.t += (measured_cost if m else unmeasured_cost) * (1 + rng.uniform(-jitter, jitter))
        policy.spend(t0)
        clock.t += base * (1 + rng.uniform(-jitter, jitter))
    return measured


def policy(budget=0.02, floor=1, traced=(), events=None, limit=MAX_INTERVAL):
    clock = FakeClock()
    p = OverheadBudget(budget, floor, frozenset(traced), emit=(events.append if events is not None else None),
                       rank=0, clock=clock, limit=limit)
    return p, clock


# -- the policy, on a fake clock ----------------------------------------------------------------------

def test_converges_to_the_smallest_interval_within_the_budget():
    events = []
    p, clock = policy(0.02, events=events)
    measured = drive(p, clock, 400, base=1.0, measured_cost=0.2)  # a measured batch: +20% of the step
    need = 10  # 0.2 / (10 * 1.0) = 2%
    assert need <= p.every_n_batches <= 1.5 * need
    gaps = {b - a for a, b in zip(measured[-10:], measured[-9:])}
    assert gaps == {p.every_n_batches}
    assert measured[0] == 0 and measured[1] == 1  # every batch measured until the cost is known
    assert p.overhead is not None and p.overhead <= 0.02
    assert events and isinstance(events[-1], SamplingRateEvent)
    assert events[-1].every_n_batches == p.every_n_batches and events[-1].max_overhead == 0.02
    assert 0 < events[-1].expected_overhead <= 0.02


def test_unmeasured_batches_cost_counts_too():
    """The step guard runs in every batch: its cost leaves less room for measuring."""
    p, clock = policy(0.02)
    drive(p, clock, 400, base=1.0, measured_cost=0.2, unmeasured_cost=0.01)
    # (0.2 + (n - 1) * 0.01) / n <= 0.02  ->  n >= 19
    assert 19 <= p.every_n_batches <= 1.5 * 19 + 1
    assert p.overhead <= 0.02


def test_hysteresis_noise_does_not_move_the_interval():
    events = []
    p, clock = policy(0.02, events=events)
    drive(p, clock, 300, base=1.0, measured_cost=0.2)
    settled, changes = p.every_n_batches, len(events)
    drive(p, clock, 2000, base=1.0, measured_cost=0.2, start=300, jitter=0.15, seed=3)
    assert len(events) - changes <= 1
    assert abs(p.every_n_batches - settled) <= 0.5 * settled


def test_follows_a_lasting_change_of_the_cost_both_ways():
    p, clock = policy(0.02)
    drive(p, clock, 400, base=1.0, measured_cost=0.2)
    assert p.every_n_batches <= 15
    drive(p, clock, 1500, base=1.0, measured_cost=0.8, start=400)  # 4x dearer: 40 at least
    assert 40 <= p.every_n_batches <= 60
    drive(p, clock, 3000, base=1.0, measured_cost=0.1, start=1900)  # cheap again: 5
    assert 5 <= p.every_n_batches <= 8


def test_bounded_and_said_when_even_unmeasured_batches_exceed_the_budget(caplog):
    p, clock = policy(0.02, limit=50)
    drive(p, clock, 200, base=1.0, measured_cost=100.0)
    assert p.every_n_batches == 50  # never longer: statistics never go stale for good
    caplog.set_level(logging.WARNING, logger="tensorwatch_otel")
    q, qclock = policy(0.02, limit=50)
    drive(q, qclock, 300, base=1.0, measured_cost=0.2, unmeasured_cost=0.05)  # 5% with no measuring at all
    assert q.every_n_batches == 50
    said = [r.getMessage() for r in caplog.records if "max_overhead" in r.getMessage()]
    assert len(said) == 1, said


def test_the_warning_names_the_headroom_that_made_it_act(caplog):
    """Unmeasured batches at 1.9% of the step, within max_overhead=0.02 but over the 1.82% left
    once 10% of it is kept as headroom: the interval goes to its limit and the warning says
    which figure 1.9% exceeds, not 'more than max_overhead=0.02'."""
    caplog.set_level(logging.WARNING, logger="tensorwatch_otel")
    p, clock = policy(0.02, limit=50)
    drive(p, clock, 300, base=1.0, measured_cost=0.2, unmeasured_cost=0.019)
    assert p.every_n_batches == 50
    (said,) = [r.getMessage() for r in caplog.records if "max_overhead" in r.getMessage()]
    assert "1.90% of the step" in said and "1.82%" in said and "headroom" in said, said


def test_every_n_batches_is_the_floor():
    p, clock = policy(0.02, floor=5)
    measured = drive(p, clock, 100, base=1.0, measured_cost=0.001)  # far within the budget
    assert p.every_n_batches == 5
    assert measured == list(range(0, 100, 5))


def test_first_and_traced_batches_are_always_measured():
    p, clock = policy(0.02, traced=(37, 38))
    measured = drive(p, clock, 60, base=1.0, measured_cost=1.0)  # one in 50 at least
    assert 0 in measured and 37 in measured and 38 in measured
    assert p.every_n_batches >= 50


def test_a_spike_does_not_move_the_interval():
    """One slow measured batch (a detection's replay, a pause) is one sample among several."""
    events = []
    p, clock = policy(0.02, events=events)
    measured = drive(p, clock, 300, base=1.0, measured_cost=0.2)
    n, changes = p.every_n_batches, len(events)
    nxt = measured[-1] + n
    drive(p, clock, nxt - 300, base=1.0, measured_cost=0.2, start=300)
    drive(p, clock, 1, base=1.0, measured_cost=30.0, start=nxt)  # the spike, in a measured batch
    drive(p, clock, 3 * n, base=1.0, measured_cost=0.2, start=nxt + 1)
    assert (p.every_n_batches, len(events)) == (n, changes)


# -- options -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, 1, 1.5, -0.1, math.nan, math.inf, "0.02", True])
def test_max_overhead_out_of_range_names_the_option(value):
    with pytest.raises(ConfigError, match=r"max_overhead=.*between 0 and 1"):
        WatchConfig.build(max_overhead=value, environ={})


def test_max_overhead_from_the_environment():
    assert WatchConfig.build(environ={"TENSORWATCH_MAX_OVERHEAD": "0.02"}).max_overhead == 0.02
    assert WatchConfig.build(environ={}).max_overhead is None
    assert WatchConfig.build(max_overhead=0.1, environ={"TENSORWATCH_MAX_OVERHEAD": "0.02"}).max_overhead == 0.1
    for raw in ("2%", "0", "1", "nan"):
        with pytest.raises(ConfigError, match=r"TENSORWATCH_MAX_OVERHEAD=.*between 0 and 1"):
            WatchConfig.build(environ={"TENSORWATCH_MAX_OVERHEAD": raw})


def test_dropin_measures_every_batch_whatever_the_environment(monkeypatch):
    monkeypatch.setenv("TENSORWATCH_MAX_OVERHEAD", "0.01")
    model = TwoLinear()
    d = DebugUnderflowOverflow(model)
    assert d._watcher.config.max_overhead is None


# -- a real training loop ------------------------------------------------------------------------------

@pytest.fixture
def slow_frames(monkeypatch):
    """Every frame takes 5 ms more to record: a measured batch of TwoLinear (3 frames) costs
    15 ms or more, against a step made 40 ms long: far over a 5% budget, whose room is 2 ms."""
    frame = FrameRecorder.frame

    def slow(self, *args, **kwargs):
        time.sleep(0.005)
        return frame(self, *args, **kwargs)

    monkeypatch.setattr(FrameRecorder, "frame", slow)


def _train(w, model, opt, batches, bad=None):
    for i in range(batches):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).sum()
        if i == bad:
            loss = loss * math.inf
        loss.backward()
        opt.step()
        time.sleep(0.04)  # the rest of the step: data, logging


def test_expensive_measuring_raises_the_interval_and_every_batch_is_still_guarded(slow_frames):
    torch.manual_seed(0)
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = Collect()
    with watch(model, sinks=[sink], max_overhead=0.05) as w:
        _train(w, model, opt, 80)
        n = w.measure_every_n_batches
        assert n >= 3  # 15 ms of 40 ms at 5%: about 8; a busy machine stretches both
        measured = [s.batch_number for s in sink.batches if s.phase == "forward"]
        assert len(measured) < 80 / 2
        assert w.overhead is not None and w.overhead < 0.25
        _to_just_after_a_measured_batch(w, model, opt, sink)
        bad = w.batch_number  # the batch after a measured one: not measured, the interval being >= 3
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(NonFiniteDetected) as err:
            _train(w, model, opt, 1, bad=0)  # an inf gradient
        assert sink.of(SamplingRateEvent)[-1].every_n_batches == w.measure_every_n_batches
    assert err.value.event.batch_number == bad
    assert bad not in [s.batch_number for s in sink.batches]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step did not run


def _to_just_after_a_measured_batch(w, model, opt, sink):
    for _ in range(2 * w.measure_every_n_batches):
        seen = len(sink.batches)
        _train(w, model, opt, 1)
        if len(sink.batches) > seen:
            return
    raise AssertionError(f"no batch measured in {2 * w.measure_every_n_batches}")


def test_rate_in_a_prometheus_scrape_and_in_json_lines(slow_frames, tmp_path):
    from prometheus_client import CollectorRegistry

    from tensorwatch_otel.sinks import JsonlLog, PrometheusMetrics

    torch.manual_seed(0)
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "events.jsonl"
    prom = PrometheusMetrics(port=0, registry=CollectorRegistry(), linger_s=0)
    try:
        seen = Collect()
        with watch(model, sinks=[prom, JsonlLog(str(path)), seen], max_overhead=0.05) as w:
            _train(w, model, opt, 60)
            _to_just_after_a_measured_batch(w, model, opt, seen)  # the gauges: that batch's
            n, overhead = w.measure_every_n_batches, w.overhead
            with urllib.request.urlopen(prom.url, timeout=5) as resp:
                parsed = parse_prom(resp.read().decode("utf-8"))
    finally:
        prom.close()
    assert n >= 3
    assert sample(parsed, "tensorwatch_measure_every_n_batches", rank="0") == n
    assert sample(parsed, "tensorwatch_overhead_ratio", rank="0") == pytest.approx(overhead)
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    rates = [d for d in lines if d["event"] == "sampling_rate"]
    assert rates and rates[-1]["every_n_batches"] == n
    assert all(isinstance(d["every_n_batches"], int) and 0 < d["overhead"] and d["max_overhead"] == 0.05
               for d in rates)
    from tensorwatch_otel.report.codec import from_dict

    event = from_dict(rates[-1])
    assert isinstance(event, SamplingRateEvent) and event.every_n_batches == n


def test_rate_in_opentelemetry_gauges(slow_frames):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    from tensorwatch_otel.sinks import OtelTelemetry

    reader = InMemoryMetricReader()
    sink = OtelTelemetry(TracerProvider(), MeterProvider(metric_readers=[reader]))
    torch.manual_seed(0)
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, sinks=[sink], max_overhead=0.05) as w:
        _train(w, model, opt, 60)
        data = reader.get_metrics_data()
    points = {m.name: [p.value for p in m.data.data_points]
              for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert points["tensorwatch.measure_every_n_batches"][0] >= 3
    assert 0 < points["tensorwatch.overhead"][0] < 1
    sink.close()


def test_without_a_budget_nothing_is_timed_and_every_n_batches_is_exported():
    sink = Collect()
    model = TwoLinear()
    with watch(model, sinks=[sink], every_n_batches=3) as w:
        for _ in range(7):
            model(torch.randn(2, 8))
        assert (w.measure_every_n_batches, w.overhead) == (3, None)
    assert [s.batch_number for s in sink.batches] == [0, 3, 6]
    assert all((s.every_n_batches, s.overhead) == (3, None) for s in sink.batches)
    assert not sink.of(SamplingRateEvent)


@pytest.fixture
def slow_steps(monkeypatch):
    """The watcher's work at every optimizer step (the step guard's) takes 5 ms more: more than a
    5% budget of a 40 ms step allows even in an unmeasured batch, so the interval goes to its
    limit at the first measured batch after unmeasured ones."""
    from tensorwatch_otel.core.steps.monitor import StepMonitor

    before = StepMonitor.before_step

    def slow(self, *args, **kwargs):
        time.sleep(0.005)
        return before(self, *args, **kwargs)

    monkeypatch.setattr(StepMonitor, "before_step", slow)


def test_the_exported_rate_is_the_watchers_as_soon_as_it_changes(slow_frames, slow_steps):
    """The interval went from about 10 to 1000 at the end of a measured batch: the Prometheus and
    OpenTelemetry gauges say 1000 at once, as Watcher.measure_every_n_batches and the
    SamplingRateEvent do, not the interval of the last measured batch for the next 1000 batches."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from tensorwatch_otel.sinks import OtelTelemetry, PrometheusMetrics

    torch.manual_seed(0)
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prom = PrometheusMetrics(port=0, registry=CollectorRegistry(), linger_s=0)
    reader = InMemoryMetricReader()
    otel = OtelTelemetry(TracerProvider(), MeterProvider(metric_readers=[reader]))
    seen = Collect()
    try:
        with watch(model, sinks=[prom, otel, seen], max_overhead=0.05) as w:
            for _ in range(60):
                _train(w, model, opt, 1)
                if w.measure_every_n_batches == MAX_INTERVAL:
                    break
            assert w.measure_every_n_batches == MAX_INTERVAL, w.measure_every_n_batches
            _train(w, model, opt, 2)  # two unmeasured batches after the change
            measured = [s.every_n_batches for s in seen.batches if s.phase == "forward"]
            assert measured[-1] < MAX_INTERVAL  # the last measured batch carried the interval before
            with urllib.request.urlopen(prom.url, timeout=5) as resp:
                parsed = parse_prom(resp.read().decode("utf-8"))
            data = reader.get_metrics_data()
        rates = seen.of(SamplingRateEvent)
        assert rates[-1].every_n_batches == MAX_INTERVAL
        assert sample(parsed, "tensorwatch_measure_every_n_batches", rank="0") == MAX_INTERVAL
        points = {m.name: [p.value for p in m.data.data_points]
                  for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        assert points["tensorwatch.measure_every_n_batches"] == [MAX_INTERVAL]
    finally:
        prom.close()
        otel.close()


@pytest.mark.slow
def test_a_compiled_model_whose_graphs_measure_inside_says_the_budget_cannot_bound_them(caplog, monkeypatch):
    """Issue 37, item 6: a compiled model's in-graph statistics run in every batch inside its
    graphs, untimed: max_overhead cannot bound them, and the watcher says so once, naming how to
    bound them, instead of reporting a share that leaves them out."""
    import logging

    from tensorwatch_otel.core.measure import graph_stats

    class Root(torch.nn.Module):  # a root of one's own (an nn.Sequential root keeps the ops)
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    monkeypatch.setattr(graph_stats, "ON", True)
    torch._dynamo.reset()
    torch.manual_seed(0)
    root = Root()
    with caplog.at_level(logging.WARNING, logger="tensorwatch_otel"):
        with watch(root, sinks=[], max_overhead=0.02):
            compiled = torch.compile(root)
            for _ in range(3):
                compiled(torch.randn(4, 8))
    said = [r.getMessage() for r in caplog.records if "max_overhead cannot bound" in r.getMessage()]
    assert len(said) == 1 and "TENSORWATCH_GRAPH_STATS=0" in said[0]
    torch._dynamo.reset()
