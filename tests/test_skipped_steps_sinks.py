"""Skipped optimizer steps in every sink, fed the core's event objects directly: the Prometheus
counter (there from zero) and grad scale gauge, the OpenTelemetry counter and gauge, and the
text report's one line per streak (none per single skip)."""

from __future__ import annotations

import io

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from _otel_fixtures import batch, linear_frames, parse_prom, sample
from tensorwatch_otel.core.events import BatchStats, SkippedStepEvent, SkipStreakEvent
from tensorwatch_otel.sinks import TextReport
from tensorwatch_otel.sinks.otel import OtelTelemetry
from tensorwatch_otel.sinks.prometheus import PrometheusMetrics


def skip(b, streak, scale, rank=0, t=None):
    return SkippedStepEvent(b, rank, streak, scale, "fc", "Linear", "weight.grad", "inf",
                            float(b) if t is None else t)


def test_prometheus_counter_from_zero_and_grad_scale():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg)
    p = parse_prom(generate_latest(reg).decode())
    assert sample(p, "tensorwatch_optimizer_steps_skipped_total", rank="0") == 0  # before anything
    assert sample(p, "tensorwatch_optimizer_skip_streaks_total", rank="0") == 0
    assert not any(k[0] == "tensorwatch_grad_scale" for k in p)  # no scaler known yet
    sink.on_event(skip(3, 1, 32768.0))
    sink.on_event(skip(4, 2, 16384.0))
    sink.on_event(SkipStreakEvent(4, 0, 2, 16384.0, 4.5))
    p = parse_prom(generate_latest(reg).decode())
    assert sample(p, "tensorwatch_optimizer_steps_skipped_total", rank="0") == 2  # the streak is no skip
    assert sample(p, "tensorwatch_grad_scale", rank="0") == 16384.0
    assert sample(p, "tensorwatch_optimizer_skip_streaks_total", rank="0") == 1
    assert sample(p, "tensorwatch_optimizer_skip_streak", rank="0") == 2
    # the batch statistics carry the core's count and the scale: the larger count wins, a
    # count the events already reported is not added twice
    sink.on_batch(BatchStats(5, 0, 10.0, linear_frames(1), grad_scale=8192.0, steps_skipped=2))
    p = parse_prom(generate_latest(reg).decode())
    assert sample(p, "tensorwatch_optimizer_steps_skipped_total", rank="0") == 2
    assert sample(p, "tensorwatch_grad_scale", rank="0") == 8192.0
    sink.on_batch(BatchStats(6, 0, 11.0, linear_frames(1), grad_scale=8192.0, steps_skipped=3))
    p = parse_prom(generate_latest(reg).decode())
    assert sample(p, "tensorwatch_optimizer_steps_skipped_total", rank="0") == 3
    sink.close()


def _points(reader, name):
    data = reader.get_metrics_data()
    out = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    out.update({tuple(sorted(dp.attributes.items())): dp.value for dp in m.data.data_points})
                    unit = m.unit
    return out, (unit if out else None)


def test_otel_counter_and_grad_scale_gauge():
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    sink = OtelTelemetry(meter_provider=mp)
    got, unit = _points(reader, "tensorwatch.optimizer.steps_skipped")
    assert got == {(("tensorwatch.rank", 0),): 0} and unit == "{step}"
    assert _points(reader, "tensorwatch.grad_scale")[0] == {}
    sink.on_event(skip(3, 1, 32768.0, rank=0))
    sink.on_event(skip(4, 2, 16384.0, rank=0))
    sink.on_event(SkipStreakEvent(4, 0, 2, 16384.0, 4.5))
    assert _points(reader, "tensorwatch.optimizer.steps_skipped")[0] == {(("tensorwatch.rank", 0),): 2}
    assert _points(reader, "tensorwatch.grad_scale")[0] == {(("tensorwatch.rank", 0),): 16384.0}
    assert _points(reader, "tensorwatch.optimizer.skip_streaks")[0] == {(("tensorwatch.rank", 0),): 1}
    assert _points(reader, "tensorwatch.optimizer.skip_streak")[0] == {(("tensorwatch.rank", 0),): 2}
    sink.on_batch(BatchStats(5, 0, 10.0, linear_frames(1), grad_scale=4096.0, steps_skipped=3))
    assert _points(reader, "tensorwatch.optimizer.steps_skipped")[0] == {(("tensorwatch.rank", 0),): 3}
    assert _points(reader, "tensorwatch.grad_scale")[0] == {(("tensorwatch.rank", 0),): 4096.0}
    sink.close()
    mp.shutdown()


def test_otel_streak_span():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    spans = InMemorySpanExporter()
    tp = TracerProvider(shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(spans))
    sink = OtelTelemetry(tracer_provider=tp, meter_provider=MeterProvider(shutdown_on_exit=False))
    sink.on_event(skip(3, 1, 2.0))  # single skips make no span
    sink.on_event(SkipStreakEvent(9, 2, 5, 0.5, 9.0))
    sink.flush(5)
    [span] = spans.get_finished_spans()
    assert span.name == "tensorwatch.skipped_steps_streak" and span.status.status_code is StatusCode.ERROR
    assert (span.attributes["tensorwatch.optimizer.skip_streak"], span.attributes["tensorwatch.grad_scale"],
            span.attributes["tensorwatch.rank"], span.attributes["tensorwatch.batch_number"]) == (5, 0.5, 2, 9)
    sink.close()
    tp.shutdown()


def test_text_report_one_line_per_streak():
    out = io.StringIO()
    sink = TextReport(stream=out)
    for b in range(1, 4):
        sink.on_event(skip(b, b, 2.0 ** (16 - b)))
    assert out.getvalue() == ""  # a skip alone is routine for a GradScaler
    sink.on_event(SkipStreakEvent(3, 0, 3, 8192.0, 3.5))
    lines = out.getvalue().splitlines()
    assert lines == ["tensorwatch: 3 optimizer steps in a row skipped (inf/nan gradients) up to "
                     "batch_number=3 on rank 0, loss scale now 8192"]
    sink.on_event(SkipStreakEvent(6, 1, 6, None, 6.5))
    assert out.getvalue().splitlines()[-1].endswith("batch_number=6 on rank 1")


def test_window_keeps_working_with_skip_only_batches():
    """A batch whose statistics carry only the scaler's numbers still counts as a batch."""
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg)
    sink.on_batch(batch(linear_frames(2), number=0))
    sink.on_batch(BatchStats(1, 0, 1.0, (), grad_scale=2.0, steps_skipped=1))
    p = parse_prom(generate_latest(reg).decode())
    assert sample(p, "tensorwatch_batches_total", rank="0") == 2
    assert sample(p, "tensorwatch_optimizer_steps_skipped_total", rank="0") == 1
    assert sample(p, "tensorwatch_tensor_abs_max", module="layers.1", module_class="Linear", tensor="weight",
                  rank="0") == 1.5
    sink.close()
