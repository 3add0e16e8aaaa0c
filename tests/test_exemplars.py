"""Metric -> trace: the nonfinite counter carries the detection's trace id as an OpenMetrics
exemplar, the OpenTelemetry span lives in that trace (the SDK's own exemplar agrees), the
JSON lines name it, and a real Prometheus with exemplar storage returns it."""

from __future__ import annotations

import time
import urllib.parse
import urllib.request

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from _otel_fixtures import batch, detection, linear_frames
from tensorwatch_otel.report.codec import to_dict
from tensorwatch_otel.sinks.otel import OtelTelemetry
from tensorwatch_otel.sinks.prometheus import PrometheusMetrics

# mostly waiting (a server's interval, a timeout): scripts/test.sh runs the tests marked `waits`
# beside the CPU-bound parallel pass, in a process of their own
pytestmark = pytest.mark.waits

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _get(url, accept=None):
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.headers.get("Content-Type", ""), resp.read().decode()


def test_openmetrics_exposition_carries_the_trace_id_exemplar():
    sink = PrometheusMetrics(port=0, registry=CollectorRegistry(), linger_s=0)
    frames = linear_frames(3, bad_at=2)
    sink.on_batch(batch(frames))
    first, second = detection(frames, rank=1), detection(frames, rank=1)
    sink.on_event(first)
    sink.on_event(second)
    ctype, body = _get(sink.url, OPENMETRICS)
    assert ctype.startswith("application/openmetrics-text")
    [fam] = [f for f in text_string_to_metric_families(body) if f.name == "tensorwatch_nonfinite_events"]
    [s] = [s for s in fam.samples if s.name == "tensorwatch_nonfinite_events_total"]
    assert s.value == 2
    assert s.labels == {"module": "layers.2", "module_class": "Linear", "tensor": "output", "rank": "1",
                        "first_rank": "1"}
    assert s.exemplar.labels == {"trace_id": second.trace_id}  # the latest detection
    assert abs(float(s.exemplar.timestamp) - second.time) < 1e-3
    # the classic text format (no exemplars there) still parses and counts
    _, text = _get(sink.url)
    assert 'tensorwatch_nonfinite_events_total{first_rank="1",module="layers.2"' in text
    assert "trace_id=" not in text
    sink.close()


def test_first_rank_label_separates_series():
    import dataclasses

    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg)
    frames = linear_frames(2, bad_at=1)
    sink.on_event(dataclasses.replace(detection(frames, rank=3), first_rank=1))
    from prometheus_client import generate_latest

    from _otel_fixtures import parse_prom, sample
    p = parse_prom(generate_latest(reg).decode())
    assert sample(p, "tensorwatch_nonfinite_events_total", module="layers.1", module_class="Linear",
                  tensor="output", rank="3", first_rank="1") == 1
    sink.close()


def test_otel_span_trace_id_equals_the_exemplar_and_the_event():
    spans = InMemorySpanExporter()
    tp = TracerProvider(shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    sink = OtelTelemetry(tracer_provider=tp, meter_provider=mp)
    ev = detection(linear_frames(3, bad_at=2), rank=2)
    sink.on_event(ev)
    # read before flush(): a collection hands the exemplars over and starts afresh
    data = reader.get_metrics_data()
    sink.flush(5)
    [span] = spans.get_finished_spans()
    assert span.attributes["tensorwatch.first_rank"] == 2
    trace_id = span.context.trace_id
    assert format(trace_id, "032x") == ev.trace_id == to_dict(ev)["trace_id"]
    [dp] = [dp for rm in data.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics if m.name == "tensorwatch.nonfinite.events" for dp in m.data.data_points]
    assert dp.value == 1
    assert [e.trace_id for e in dp.exemplars] == [trace_id]  # the SDK's trace-based exemplar
    sink.close()
    tp.shutdown()
    mp.shutdown()


@pytest.mark.slow
def test_real_prometheus_stores_and_returns_the_exemplar(tmp_path):
    from prom_server import PrometheusServer

    class ExemplarPrometheus(PrometheusServer):
        def _argv(self, workdir, port):
            return super()._argv(workdir, port) + ["--enable-feature=exemplar-storage"]

    sink = PrometheusMetrics(port=0, registry=CollectorRegistry(), linger_s=0)
    frames = linear_frames(3, bad_at=2)
    sink.on_batch(batch(frames))
    ev = detection(frames, rank=0)
    sink.on_event(ev)
    t0 = time.time() - 60
    try:
        with ExemplarPrometheus(tmp_path, scrape_targets=[f"127.0.0.1:{sink.port}"], scrape_interval="1s") as prom:
            prom.wait_for("tensorwatch_nonfinite_events_total", timeout=30)
            deadline = time.monotonic() + 20
            while True:
                q = urllib.parse.urlencode({"query": "tensorwatch_nonfinite_events_total",
                                            "start": t0, "end": time.time() + 60})
                data = prom._api("/api/v1/query_exemplars?" + q)
                found = [e for series in data for e in series["exemplars"]]
                if found or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert found, f"no exemplar stored; log:\n{prom.log_tail()}"
            assert found[0]["labels"] == {"trace_id": ev.trace_id}
            assert data[0]["seriesLabels"]["first_rank"] == "0"
            assert abs(float(found[0]["timestamp"]) - ev.time) < 0.01
    finally:
        sink.close()


def test_stopped_by_rank_in_prometheus_and_otel():
    """A rank stopped by another's detection: its own counter names first_rank, and a span says
    why it stopped; neither counts as a detection of its own."""
    from opentelemetry.trace import StatusCode
    from prometheus_client import generate_latest

    from _otel_fixtures import parse_prom, sample
    from tensorwatch_otel.core.events import StoppedByRankEvent

    ev = StoppedByRankEvent(40, 0, 2, "blocks.3.ffn", "Linear", "output", "inf", time.time(), stopped_at_batch=41)
    reg = CollectorRegistry()
    prom = PrometheusMetrics(registry=reg)
    prom.on_event(ev)
    p = parse_prom(generate_latest(reg).decode())
    assert sample(p, "tensorwatch_stopped_by_rank_events_total", module="blocks.3.ffn", module_class="Linear",
                  tensor="output", rank="0", first_rank="2") == 1
    assert not any(k[0] == "tensorwatch_nonfinite_events_total" for k in p)
    prom.close()

    spans = InMemorySpanExporter()
    tp = TracerProvider(shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    sink = OtelTelemetry(tracer_provider=tp, meter_provider=mp)
    sink.on_event(ev)
    sink.flush(5)
    [span] = spans.get_finished_spans()
    assert span.name == "tensorwatch.stopped_by_rank" and span.status.status_code is StatusCode.ERROR
    a = span.attributes
    assert (a["tensorwatch.rank"], a["tensorwatch.first_rank"], a["tensorwatch.module.path"],
            a["tensorwatch.stopped_at_batch"]) == (0, 2, "blocks.3.ffn", 41)
    pts = {m.name: [dict(dp.attributes) for dp in m.data.data_points]
           for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert pts["tensorwatch.stopped_by_rank.events"][0]["tensorwatch.first_rank"] == 2
    assert "tensorwatch.nonfinite.events" not in pts
    sink.close()
    tp.shutdown()
    mp.shutdown()
