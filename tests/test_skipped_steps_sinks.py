"""Skipped optimizer steps in every sink, fed the core's event objects directly: the Prometheus
counter (there from zero) and grad scale gauge, the OpenTelemetry counter and gauge, and the
text report's one line per streak (none per single skip); the steps on_detect="skip" skipped:
their own counters, a span and a text line each, JSON lines and the report command."""

from __future__ import annotations

import io

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from _otel_fixtures import batch, linear_frames, parse_prom, sample
from tensorwatch_otel.core.events import SkippedStepEvent, SkipStreakEvent
from tensorwatch_otel.core.frame_stats import BatchStats
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


# -- steps on_detect="skip" skipped (SkippedNonFiniteStepEvent) -------------------------------

def nonfinite_skip(b, streak=1, rank=0, module="fc", tensor="weight.grad", phase="backward"):
    from tensorwatch_otel.core.events import SkippedNonFiniteStepEvent

    return SkippedNonFiniteStepEvent(b, rank, module, "Linear" if module else "", tensor, "inf" if module else "",
                                     float(b), streak, phase)


def test_prometheus_skipped_nonfinite_steps_counter_from_zero():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg)
    p = parse_prom(generate_latest(reg).decode())
    assert sample(p, "tensorwatch_skipped_nonfinite_steps_total", rank="0") == 0  # there before any skip
    sink.on_event(nonfinite_skip(7))
    sink.on_event(nonfinite_skip(8, streak=2))
    sink.on_event(skip(9, 1, 2.0))  # a GradScaler's skip is counted apart
    p = parse_prom(generate_latest(reg).decode())
    assert sample(p, "tensorwatch_skipped_nonfinite_steps_total", rank="0") == 2
    assert sample(p, "tensorwatch_optimizer_steps_skipped_total", rank="0") == 1
    sink.close()


def test_otel_skipped_nonfinite_steps_counter_and_one_span_each():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    spans = InMemorySpanExporter()
    tp = TracerProvider(shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(spans))
    sink = OtelTelemetry(tracer_provider=tp, meter_provider=mp)
    got, unit = _points(reader, "tensorwatch.skipped_nonfinite_steps")
    assert got == {(("tensorwatch.rank", 0),): 0} and unit == "{step}"
    sink.on_event(nonfinite_skip(7, module="", tensor="", phase="backward"))  # another rank's shard
    sink.on_event(nonfinite_skip(23, streak=1, module="a", tensor="input[0]", phase="forward"))
    sink.flush(5)
    assert _points(reader, "tensorwatch.skipped_nonfinite_steps")[0] == {(("tensorwatch.rank", 0),): 2}
    first, second = sorted(spans.get_finished_spans(), key=lambda s: s.attributes["tensorwatch.batch_number"])
    assert {first.name, second.name} == {"tensorwatch.skipped_nonfinite_step"}
    assert second.status.status_code is StatusCode.UNSET  # skipped on purpose: training goes on
    assert (second.attributes["tensorwatch.module.path"], second.attributes["tensorwatch.tensor"],
            second.attributes["tensorwatch.nonfinite.kind"], second.attributes["tensorwatch.phase"],
            second.attributes["tensorwatch.rank"], second.attributes["tensorwatch.optimizer.skip_streak"]) == \
        ("a", "input[0]", "inf", "forward", 0, 1)
    assert (first.attributes["tensorwatch.module.path"], first.attributes["tensorwatch.tensor"]) == ("", "")
    sink.close()
    tp.shutdown()
    mp.shutdown()


def test_text_report_one_line_per_skipped_nonfinite_step():
    out = io.StringIO()
    sink = TextReport(stream=out)
    sink.on_event(nonfinite_skip(7, module="a", tensor="input[0]", phase="forward"))
    sink.on_event(nonfinite_skip(8, streak=2))
    sink.on_event(nonfinite_skip(9, streak=3, rank=1, module="", tensor=""))
    assert out.getvalue().splitlines() == [
        "tensorwatch_otel: optimizer step skipped for batch_number=7 on rank 0: inf in a Linear input[0] "
        "(the batch's forward) (1 in a row); weights and optimizer state unchanged",
        "tensorwatch_otel: optimizer step skipped for batch_number=8 on rank 0: inf in fc Linear weight.grad "
        "(2 in a row); weights and optimizer state unchanged",
        "tensorwatch_otel: optimizer step skipped for batch_number=9 on rank 1: inf/nan in another rank's shard "
        "of the gradients (3 in a row); weights and optimizer state unchanged"]


def test_skipped_nonfinite_step_round_trips_through_json_lines_and_the_report_command(tmp_path, capsys):
    import json

    from tensorwatch_otel.cli import main
    from tensorwatch_otel.report.codec import from_dict, read_events, to_line
    from tensorwatch_otel.sinks import JsonlLog

    ev = nonfinite_skip(41, streak=3, module="b", tensor="bias.grad")
    line = to_line(ev)
    d = json.loads(line)
    assert (d["event"], d["batch_number"], d["rank"], d["module"], d["module_class"], d["tensor"], d["kind"],
            d["streak"], d["phase"]) == ("skipped_nonfinite_step", 41, 0, "b", "Linear", "bias.grad", "inf", 3,
                                         "backward")
    assert from_dict(d) == ev
    path = tmp_path / "run.jsonl"
    log = JsonlLog(str(path))
    log.on_event(ev)
    log.close()
    assert read_events(str(path)) == [ev]
    assert main(["report", str(path)]) == 0
    assert capsys.readouterr().out == (
        "tensorwatch_otel: optimizer step skipped for batch_number=41 on rank 0: inf in b Linear bias.grad "
        "(3 in a row); weights and optimizer state unchanged\n")
