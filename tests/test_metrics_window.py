"""The metrics window: tensor gauges report the extremes over the batches of the last window_s
seconds (two rotating buckets), so a one-batch spike between two scrapes is seen; scrapes do
not reset it; a steady value reads as itself; the watcher's records (the vectorised path) give
the same numbers as built frames; a real Prometheus sees a one-batch spike in its next scrape."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from _collect import Collect
from _otel_fixtures import batch, frame, parse_prom, stat
from conftest import free_port
from tensorwatch_otel import watch
from tensorwatch_otel.core.frame_stats import BatchStats
from tensorwatch_otel.sinks.otel import OtelTelemetry
from tensorwatch_otel.sinks.prometheus import PrometheusMetrics

# mostly waiting (a server's interval, a timeout): scripts/test.sh runs the tests marked `waits`
# beside the CPU-bound parallel pass, in a process of their own
pytestmark = pytest.mark.waits


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class PromView:
    def __init__(self, **kw):
        self.sink = PrometheusMetrics(registry=CollectorRegistry(), **kw)

    def abs_max(self, module="m", tensor="output"):
        p = parse_prom(generate_latest(self.sink.registry).decode())
        return {dict(k[1])["module"] + "/" + dict(k[1])["tensor"]: v
                for k, v in p.items() if k[0] == "tensorwatch_tensor_abs_max"}.get(f"{module}/{tensor}")


class OtelView:
    def __init__(self, **kw):
        self.reader = InMemoryMetricReader()
        self.mp = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.sink = OtelTelemetry(meter_provider=self.mp, **kw)

    def abs_max(self, module="m", tensor="output"):
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == "tensorwatch.tensor.abs_max":
                        for dp in m.data.data_points:
                            a = dp.attributes
                            if (a["tensorwatch.module.path"], a["tensorwatch.tensor"]) == (module, tensor):
                                return dp.value
        return None


def one(value, n=0):
    return batch((frame("m", "Linear", stat("output", value / 10, value)),), number=n)


@pytest.mark.parametrize("view", [PromView, OtelView])
def test_spike_held_for_the_window_not_reset_by_reads(view):
    v = view(window_s=10)
    clock = v.sink._window._clock = Clock()
    for i in range(30):  # steady: reads as itself
        clock.now += 0.1
        v.sink.on_batch(one(1.0, i))
    assert v.abs_max() == 1.0
    clock.now += 0.1
    v.sink.on_batch(one(100.0, 30))  # one batch spikes
    for i in range(31, 40):
        clock.now += 0.1
        v.sink.on_batch(one(1.0, i))
    assert v.abs_max() == 100.0
    assert v.abs_max() == 100.0  # a second reader sees it too
    # half a window later the spike's bucket is the previous one: still shown
    while clock.now < 1000.0 + 3.1 + 5.0:
        clock.now += 0.1
        v.sink.on_batch(one(1.0))
    assert v.abs_max() == 100.0
    # a whole window after it, it is gone
    while clock.now < 1000.0 + 3.1 + 10.2:
        clock.now += 0.1
        v.sink.on_batch(one(1.0))
    assert v.abs_max() == 1.0
    v.sink.close()


def test_window_zero_is_the_last_batch():
    v = PromView(window_s=0)
    v.sink.on_batch(one(100.0))
    v.sink.on_batch(one(1.0))
    assert v.abs_max() == 1.0
    v.sink.close()


def test_nan_in_the_window_wins_then_expires():
    v = PromView(window_s=2)
    clock = v.sink._window._clock = Clock()
    v.sink.on_batch(one(math.nan))
    clock.now += 0.5
    v.sink.on_batch(one(5.0))
    assert math.isnan(v.abs_max())
    clock.now += 1.0  # rotates: the NaN is in the previous bucket
    v.sink.on_batch(one(5.0))
    assert math.isnan(v.abs_max())
    clock.now += 1.0
    v.sink.on_batch(one(4.0))
    assert v.abs_max() == 5.0
    v.sink.close()


def test_paused_run_keeps_its_last_window():
    v = PromView(window_s=2)
    clock = v.sink._window._clock = Clock()
    v.sink.on_batch(one(7.0))
    clock.now += 3600  # no batch for an hour: buckets rotate on batches only
    assert v.abs_max() == 7.0
    v.sink.on_batch(one(1.0))  # the next batch starts afresh
    assert v.abs_max() == 1.0
    v.sink.close()


def test_window_env_and_invalid(monkeypatch):
    monkeypatch.setenv("TENSORWATCH_METRICS_WINDOW_SECONDS", "12.5")
    s = PrometheusMetrics(registry=CollectorRegistry())
    assert s.window_s == 12.5
    s.close()
    assert PrometheusMetrics(registry=CollectorRegistry(), window_s=3).window_s == 3  # argument first
    assert OtelTelemetry(meter_provider=MeterProvider(shutdown_on_exit=False)).window_s == 12.5
    monkeypatch.setenv("TENSORWATCH_METRICS_WINDOW_SECONDS", "soon")
    with pytest.raises(ValueError, match="TENSORWATCH_METRICS_WINDOW_SECONDS"):
        PrometheusMetrics(registry=CollectorRegistry())
    monkeypatch.delenv("TENSORWATCH_METRICS_WINDOW_SECONDS")
    with pytest.raises(ValueError, match="window_s"):
        PrometheusMetrics(registry=CollectorRegistry(), window_s=-1)
    assert PrometheusMetrics(registry=CollectorRegistry()).window_s == 60.0


def test_otel_default_window_covers_two_export_intervals():
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    reader = PeriodicExportingMetricReader(ConsoleMetricExporter(out=open(os.devnull, "w")),
                                           export_interval_millis=90_000)
    mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    assert OtelTelemetry(meter_provider=mp).window_s == 180.0
    mp.shutdown()
    assert OtelTelemetry(meter_provider=MeterProvider(shutdown_on_exit=False)).window_s == 60.0


class Shared(torch.nn.Module):
    """A module called twice per forward, a root with its own output, an excluded branch."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(6, 6)
        self.skip = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 2).half()

    def forward(self, x, scale=1.0):
        h = self.enc(torch.relu(self.enc(x)) * scale)
        h = h + self.skip(x)
        return self.head(h.half())


@pytest.mark.parametrize("kw", [{}, {"exclude": ["skip"]}, {"max_series": 5}])
def test_records_give_the_same_numbers_as_built_frames(kw):
    """The vectorised fold of the watcher's records equals the per-row fold of the same batches'
    frames (module called twice, fp16 range, filters, the series cap), over a window of
    batches with a spike in one of them."""
    torch.manual_seed(0)
    model = Shared()
    keep = Collect()
    x = torch.randn(4, 6)
    with torch.no_grad(), watch(model, sinks=[keep], on_detect="report"):
        for scale in (1.0, 50.0, 1.0, 0.5):
            model(x, scale)
    fast, slow = PromView(**kw), PromView(**kw)
    for st in keep.batches:
        assert not isinstance(st._frames, tuple)  # the watcher hands its record over
        fast.sink.on_batch(st)
        slow.sink.on_batch(BatchStats(st.batch_number, st.rank, st.time, tuple(st.frames)))
    a = parse_prom(generate_latest(fast.sink.registry).decode())
    b = parse_prom(generate_latest(slow.sink.registry).decode())
    gauges = ("tensorwatch_tensor_abs_max", "tensorwatch_tensor_abs_min", "tensorwatch_tensor_range_used_ratio",
              "tensorwatch_series_dropped")
    pick = {k: v for k, v in a.items() if k[0] in gauges}
    assert pick == {k: v for k, v in b.items() if k[0] in gauges}
    amax = {dict(k[1])["module"] + "/" + dict(k[1])["tensor"]: v for k, v in a.items()
            if k[0] == "tensorwatch_tensor_abs_max"}
    if not kw:
        # enc's second call saw the x50 input: the window keeps the spike of batch 1
        with torch.no_grad():
            spike = float(model.enc(torch.relu(model.enc(x)) * 50.0).abs().max())
        assert amax["enc/output"] == pytest.approx(spike, rel=1e-6)
        ru = {dict(k[1])["module"] + "/" + dict(k[1])["tensor"]: (dict(k[1])["dtype"], v) for k, v in a.items()
              if k[0] == "tensorwatch_tensor_range_used_ratio"}
        assert ru["head/output"][0] == "float16"
        assert ru["head/output"][1] == pytest.approx(amax["head/output"] / 65504)
    if "exclude" in kw:
        assert not any(m.startswith("skip/") for m in amax)
    if "max_series" in kw:
        assert len(amax) == 5
    fast.sink.close()
    slow.sink.close()


# ---------------------------------------------------------------- a real Prometheus
_SPIKE_SCRIPT = textwrap.dedent("""
    import json, os, sys, time, torch
    sys.path.insert(0, {tests!r})
    from _otel_fixtures import OverflowNet
    from tensorwatch_otel import watch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = OverflowNet()
    x = torch.randn(4, 8)
    w = watch(model)  # TENSORWATCH_PROMETHEUS_PORT in the environment
    with torch.no_grad():
        spiked = False
        for step in range(100000):
            if not spiked and os.path.exists({trigger!r}):  # the test saw steady scrapes first
                spiked = True
                model.boom.factor = 1e4  # one batch, then back
                model(x)
                print(json.dumps({{"spike_time": time.time()}}), flush=True)
                model.boom.factor = 1.0
            else:
                model(x)
            time.sleep(0.005)  # ~150 batches between two 1 s scrapes
""")


@pytest.mark.slow
def test_real_prometheus_sees_a_one_batch_spike_in_its_next_scrape(tmp_path):
    from prom_server import PrometheusServer

    port = free_port()
    env = dict(os.environ, TENSORWATCH_PROMETHEUS_PORT=str(port), TENSORWATCH_PROMETHEUS_LINGER_SECONDS="0")
    trigger = tmp_path / "spike-now"
    script = _SPIKE_SCRIPT.format(tests=os.path.dirname(__file__), trigger=str(trigger))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        with PrometheusServer(tmp_path, scrape_targets=[f"127.0.0.1:{port}"], scrape_interval="1s") as prom:
            sel = 'tensorwatch_tensor_abs_max{module="boom",tensor="output"}'
            prom.wait_for(f"count_over_time({sel}[1m])", lambda r: r and float(r[0]["value"][1]) >= 2, timeout=60)
            trigger.write_text("")
            spike_time = json.loads(proc.stdout.readline())["spike_time"]
            time.sleep(3)
            [series] = prom.query(f"{sel}[60s]")
            samples = [(float(t), float(v)) for t, v in series["values"]]
            before = [v for t, v in samples if t < spike_time - 0.5]
            after = [(t, v) for t, v in samples if t > spike_time + 0.05]
            assert before and after, samples
            steady = max(before)
            # the first scrape after the spike already shows it (x1e4), and later ones still do
            assert after[0][1] > 1000 * steady, (spike_time, samples)
            assert all(v > 1000 * steady for _, v in after), samples
    finally:
        proc.kill()
        proc.wait()
