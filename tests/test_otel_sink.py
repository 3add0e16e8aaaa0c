"""OtelTelemetry with the SDK's in-memory exporter and reader: span names, status, attributes,
frame order, splitting, scope, gauges, counter, and no NaN/Inf gauge values."""

from __future__ import annotations

import math

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from _otel_fixtures import OverflowNet, TinyNet, batch, detection, frame, linear_frames, stat
from tensorwatch_otel.core.events import BatchTraceEvent
from tensorwatch_otel._version import __version__
from tensorwatch_otel.sinks.otel import OtelTelemetry


class Otel:
    def __init__(self, max_events=None, max_attribute_length=None):
        self.spans = InMemorySpanExporter()
        limits = SpanLimits(max_events=max_events, max_attribute_length=max_attribute_length) \
            if max_events or max_attribute_length else None
        self.tp = TracerProvider(resource=Resource.create({"service.name": "t"}), span_limits=limits,
                                 shutdown_on_exit=False)
        self.tp.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.mp = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)

    def sink(self, **kw) -> OtelTelemetry:
        return OtelTelemetry(self.tp, self.mp, **kw)

    def finished(self, name=None):
        return [s for s in self.spans.get_finished_spans() if name is None or s.name == name]

    def points(self, name):
        data = self.reader.get_metrics_data()
        out = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name:
                        out.append((sm.scope, m))
        return out

    def close(self):
        self.tp.shutdown()
        self.mp.shutdown()


@pytest.fixture
def otel():
    o = Otel()
    yield o
    o.close()


def values(metric):
    return {tuple(sorted(dp.attributes.items())): dp.value for dp in metric.data.data_points}


def test_detection_span_attributes_status_and_frames(otel):
    sink = otel.sink()
    frames = linear_frames(5, bad_at=4) + ()
    ev = detection(frames, batch=12, rank=3)
    sink.on_event(ev)
    sink.flush(5)
    [span] = otel.finished()
    assert span.name == "tensorwatch.nonfinite_detected"
    assert span.status.status_code is StatusCode.ERROR
    assert span.instrumentation_scope.name == "tensorwatch_otel"
    assert span.instrumentation_scope.version == __version__
    a = span.attributes
    assert a["tensorwatch.module.path"] == "layers.4"
    assert a["tensorwatch.module.class"] == "Linear"
    assert a["tensorwatch.tensor"] == "output"
    assert a["tensorwatch.batch_number"] == 12 and isinstance(a["tensorwatch.batch_number"], int)
    assert a["tensorwatch.rank"] == 3 and isinstance(a["tensorwatch.rank"], int)
    assert a["tensorwatch.nonfinite.kind"] == "inf"
    assert "Detected inf/nan during batch_number=12" in a["tensorwatch.report"]
    assert "layers.4 Linear" in a["tensorwatch.report"]
    events = list(span.events)
    assert [e.name for e in events] == ["tensorwatch.frame"] * 5
    assert [e.attributes["tensorwatch.module.path"] for e in events] == [f"layers.{i}" for i in range(5)]
    assert [e.attributes["tensorwatch.frame.index"] for e in events] == list(range(5))
    ts = [e.timestamp for e in events]
    assert ts == sorted(ts) and len(set(ts)) == 5
    last = events[-1].attributes
    assert list(last["tensorwatch.tensors"]) == ["weight", "bias", "input[0]", "output"]
    assert list(last["tensorwatch.abs_max"]) == [4.5, 0.25, 4.0, math.inf]
    assert list(last["tensorwatch.abs_min"]) == pytest.approx([0.005, 0.0, 0.0, 0.0])
    assert last["tensorwatch.module.class"] == "Linear"


def test_root_and_tensors_without_stats(otel):
    sink = otel.sink()
    fr = frame("", "Net", stat("input[0]", None, None, note="None"), stat("output", 0.0, float("nan")))
    sink.on_event(detection((fr,)))
    sink.flush(5)
    [span] = otel.finished()
    assert span.attributes["tensorwatch.module.path"] == "(root)"
    assert span.attributes["tensorwatch.nonfinite.kind"] == "nan"
    e = span.events[0].attributes
    assert list(e["tensorwatch.tensors"]) == ["output"]
    assert math.isnan(e["tensorwatch.abs_max"][0])
    assert list(e["tensorwatch.notes"]) == ["input[0]: None"]


def test_batch_trace_split_over_event_limit():
    o = Otel(max_events=4)
    try:
        sink = o.sink()
        frames = linear_frames(10)
        sink.on_event(BatchTraceEvent(2, 0, frames, 1.7e9))
        sink.flush(5)
        spans = o.finished("tensorwatch.batch_trace")
        assert len(spans) == 3
        spans.sort(key=lambda s: s.attributes["tensorwatch.trace.part"])
        assert [s.attributes["tensorwatch.trace.part"] for s in spans] == [1, 2, 3]
        assert all(s.attributes["tensorwatch.trace.parts"] == 3 for s in spans)
        assert all(s.attributes["tensorwatch.batch_number"] == 2 for s in spans)
        assert [len(s.events) for s in spans] == [4, 4, 2]
        paths = [e.attributes["tensorwatch.module.path"] for s in spans for e in s.events]
        assert paths == [f"layers.{i}" for i in range(10)]
        # one trace: later parts are children of the first
        assert len({s.context.trace_id for s in spans}) == 1
        assert spans[1].parent.span_id == spans[0].context.span_id
        assert all(s.dropped_events == 0 for s in spans)
    finally:
        o.close()


def test_detection_over_event_limit_keeps_latest_frames():
    o = Otel(max_events=3)
    try:
        sink = o.sink()
        sink.on_event(detection(linear_frames(5, bad_at=4)))
        sink.flush(5)
        [span] = o.finished()
        assert [e.attributes["tensorwatch.module.path"] for e in span.events] == ["layers.2", "layers.3", "layers.4"]
        assert span.attributes["tensorwatch.frames.omitted"] == 2
        assert "layers.0 Linear" in span.attributes["tensorwatch.report"]
    finally:
        o.close()


def test_a_report_over_the_attribute_length_limit_keeps_its_end():
    """OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT: the SDK would cut the report at its end, where the
    detection is; the sink bounds it first, keeping the frames nearest the detection."""
    from tensorwatch_otel.report.text import render_detection

    o = Otel(max_attribute_length=600)
    try:
        sink = o.sink()
        event = detection(linear_frames(12, bad_at=11))
        assert len(render_detection(event)) > 600
        sink.on_event(event)
        sink.flush(5)
        [span] = o.finished()
        report = span.attributes["tensorwatch.report"]
        assert len(report) <= 600 and "layers.11 Linear" in report and "layers.0 Linear" not in report
        cut = span.attributes["tensorwatch.report.frames_omitted"]
        assert 0 < cut < 12 and f"{cut} earlier frames left out" in report
        assert report.endswith(render_detection(event)[-100:])
    finally:
        o.close()


def test_gauges_read_latest_batch_and_skip_nonfinite(otel):
    sink = otel.sink(window_s=0)  # the last batch only (the window has tests of its own)
    a = frame("enc", "Linear", stat("weight", 0.5, 2.0), stat("output", 0.0, float("inf")))
    b = frame("enc", "Linear", stat("weight", 0.25, 1.0), stat("output", float("nan"), float("nan")))
    sink.on_batch(batch(linear_frames(2), number=0, rank=1))
    sink.on_batch(batch((a, b, frame("", "Net", stat("output", 0.1, 3.0, dtype="float32"))), number=1, rank=1))
    [(scope, amax)] = otel.points("tensorwatch.tensor.abs_max")
    assert scope.name == "tensorwatch_otel" and scope.version == __version__
    got = values(amax)
    base = (("tensorwatch.module.class", "Linear"), ("tensorwatch.module.path", "enc"), ("tensorwatch.rank", 1))
    assert got[tuple(sorted(base + (("tensorwatch.tensor", "weight"),)))] == 2.0
    # abs max of enc.output is inf: no gauge point at all (never a NaN/Inf value)
    assert tuple(sorted(base + (("tensorwatch.tensor", "output"),))) not in got
    root = (("tensorwatch.module.class", "Net"), ("tensorwatch.module.path", "(root)"), ("tensorwatch.rank", 1),
            ("tensorwatch.tensor", "output"))
    assert got[root] == 3.0
    assert len(got) == 2  # layers.* belonged to the earlier batch
    for name in ("tensorwatch.tensor.abs_max", "tensorwatch.tensor.abs_min", "tensorwatch.tensor.range_used"):
        for _, m in otel.points(name):
            assert all(math.isfinite(dp.value) for dp in m.data.data_points), name
    [(_, amin)] = otel.points("tensorwatch.tensor.abs_min")
    assert values(amin)[tuple(sorted(base + (("tensorwatch.tensor", "weight"),)))] == 0.25
    [(_, ru)] = otel.points("tensorwatch.tensor.range_used")
    rv = values(ru)
    assert rv[tuple(sorted(base + (("tensorwatch.tensor", "weight"), ("tensorwatch.dtype", "float16"))))] == \
        pytest.approx(2.0 / 65504)
    [(_, bn)] = otel.points("tensorwatch.batch_number")
    assert values(bn) == {(("tensorwatch.rank", 1),): 1}
    [(_, bt)] = otel.points("tensorwatch.batches")
    assert values(bt) == {(("tensorwatch.rank", 1),): 2}


def test_counter_per_detection(otel):
    sink = otel.sink()
    frames = linear_frames(3, bad_at=2)
    sink.on_event(detection(frames, rank=0))
    sink.on_event(detection(frames, rank=0))
    sink.flush(5)
    [(_, m)] = otel.points("tensorwatch.nonfinite.events")
    assert m.unit == "{event}"
    assert m.data.is_monotonic
    assert values(m) == {(("tensorwatch.first_rank", 0), ("tensorwatch.module.class", "Linear"),
                          ("tensorwatch.module.path", "layers.2"), ("tensorwatch.rank", 0),
                          ("tensorwatch.tensor", "output")): 2}
    assert len(otel.finished("tensorwatch.nonfinite_detected")) == 2


def test_series_cap(otel, caplog):
    sink = otel.sink(max_series=6)
    sink.on_batch(batch(linear_frames(3)))
    with caplog.at_level("WARNING", logger="tensorwatch_otel"):
        [(_, m)] = otel.points("tensorwatch.tensor.abs_max")
        otel.points("tensorwatch.tensor.abs_max")
    assert len(m.data.data_points) == 6
    assert sum("series cap" in r.getMessage() for r in caplog.records) == 1


def test_global_providers_are_used_when_none_given(otel, monkeypatch):
    from opentelemetry import metrics, trace

    monkeypatch.setattr(trace, "get_tracer_provider", lambda: otel.tp)
    monkeypatch.setattr(metrics, "get_meter_provider", lambda: otel.mp)
    sink = OtelTelemetry()
    sink.on_event(detection(linear_frames(2, bad_at=1)))
    sink.flush(5)
    assert len(otel.finished("tensorwatch.nonfinite_detected")) == 1


def test_span_is_in_the_event_trace_and_links_the_training_step_span(otel):
    """The detection span's trace id is the event's (the one the exemplar and the JSON lines
    carry); the training step's span, when one is current, is a link."""
    sink = otel.sink()
    tracer = otel.tp.get_tracer("train")
    ev = detection(linear_frames(2, bad_at=1))
    with tracer.start_as_current_span("train_step") as step:
        sink.on_event(ev)
    sink.flush(5)
    [span] = otel.finished("tensorwatch.nonfinite_detected")
    assert format(span.context.trace_id, "032x") == ev.trace_id
    assert span.parent.trace_id == span.context.trace_id and span.parent.is_remote
    [link] = span.links
    assert link.context.span_id == step.get_span_context().span_id
    assert link.context.trace_id == step.get_span_context().trace_id


def test_detection_inside_a_step_span_joins_its_trace(otel):
    """An event made while the application's span is open takes that trace id (the OTel sink
    tells the core): the detection span is the step's child, exemplar and log name that trace."""
    sink = otel.sink()
    reader_ctx = None
    with otel.tp.get_tracer("train").start_as_current_span("train_step") as step:
        ev = detection(linear_frames(2, bad_at=1))  # the watcher makes it on the training thread
        sink.on_event(ev)
        reader_ctx = step.get_span_context()
    data = otel.reader.get_metrics_data()
    sink.flush(5)
    [span] = otel.finished("tensorwatch.nonfinite_detected")
    assert ev.trace_id == format(reader_ctx.trace_id, "032x") == format(span.context.trace_id, "032x")
    assert span.parent.span_id == reader_ctx.span_id and not span.links
    [dp] = [dp for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
            if m.name == "tensorwatch.nonfinite.events" for dp in m.data.data_points]
    assert [e.trace_id for e in dp.exemplars] == [reader_ctx.trace_id]


def test_span_without_trace_id_is_a_child_of_the_step(otel):
    """An event read back from an old log has no trace id: the span is made as before."""
    import dataclasses

    sink = otel.sink()
    ev = dataclasses.replace(detection(linear_frames(2, bad_at=1)), trace_id="")
    with otel.tp.get_tracer("train").start_as_current_span("train_step") as step:
        sink.on_event(ev)
    sink.flush(5)
    [span] = otel.finished("tensorwatch.nonfinite_detected")
    assert span.parent.span_id == step.get_span_context().span_id


@pytest.mark.timing
def test_on_event_returns_fast_even_with_slow_exporter():
    import time

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Slow(SpanExporter):
        def export(self, spans):
            time.sleep(0.5)
            return SpanExportResult.SUCCESS

    tp = TracerProvider(shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(Slow()))  # synchronous: the worst case
    sink = OtelTelemetry(tp, MeterProvider(shutdown_on_exit=False))
    frames = linear_frames(3, bad_at=2)
    t = time.perf_counter()
    for _ in range(5):
        sink.on_event(detection(frames))
    assert time.perf_counter() - t < 0.1
    t = time.perf_counter()
    sink.flush(0.3)  # bounded although the queued spans need 2.5 s
    assert time.perf_counter() - t < 0.8
    sink.close()


def test_watch_end_to_end_detection_span(otel):
    from tensorwatch_otel import NonFiniteDetected, watch

    torch.manual_seed(0)
    model = OverflowNet()
    sink = otel.sink()
    x = torch.randn(2, 8)
    w = watch(model, sinks=[sink], max_frames=3)
    try:
        model(x)
        model.boom.factor = 1e39
        with pytest.raises(NonFiniteDetected) as err:
            model(x)
        # spans are exported by the time the exception leaves the hook: no extra flush here
        [span] = otel.finished("tensorwatch.nonfinite_detected")
        assert err.value.event.module == "boom"
        a = span.attributes
        assert (a["tensorwatch.module.path"], a["tensorwatch.module.class"], a["tensorwatch.tensor"]) == \
            ("boom", "Overflow", "output")
        assert a["tensorwatch.batch_number"] == 1
        assert a["tensorwatch.nonfinite.kind"] == "inf"
        assert [e.attributes["tensorwatch.module.path"] for e in span.events][-1] == "boom"
        assert len(span.events) == 3
        [(_, m)] = otel.points("tensorwatch.nonfinite.events")
        assert sum(dp.value for dp in m.data.data_points) == 1
    finally:
        w.detach()


def test_watch_end_to_end_gauges_and_trace(otel):
    from tensorwatch_otel import watch

    torch.manual_seed(0)
    model = TinyNet()
    sink = otel.sink()
    x = torch.randn(3, 16)
    with watch(model, sinks=[sink], trace_batches=[1]):
        for _ in range(3):
            model(x)
    [span] = otel.finished("tensorwatch.batch_trace")
    assert span.attributes["tensorwatch.batch_number"] == 1
    paths = [e.attributes["tensorwatch.module.path"] for e in span.events]
    assert paths[-1] == "(root)" and "blocks.0.ff" in paths
    [(_, m)] = otel.points("tensorwatch.tensor.abs_max")
    got = values(m)
    key = (("tensorwatch.module.class", "Linear"), ("tensorwatch.module.path", "head"), ("tensorwatch.rank", 0),
           ("tensorwatch.tensor", "weight"))
    assert got[key] == pytest.approx(model.head.weight.detach().abs().max().item())


def test_every_span_name_and_attribute_comes_from_the_catalogue(otel):
    """Each event type the core makes, through the sink: every span name is in catalogue.SPANS,
    every span, span event and metric attribute in ATTRIBUTES or SPAN_ATTRIBUTES (the
    target_dtypes arrays by their prefix), so the reference page generated from the catalogue
    lists everything a backend receives."""
    import time as _time

    from tensorwatch_otel.core import events as ev
    from tensorwatch_otel.core.frame_stats import TensorStat
    from tensorwatch_otel.sinks import catalogue as cat

    frames = linear_frames(3, bad_at=2)
    shares = frame("s", "Linear", TensorStat("w", 0.1, 1.0, "float32", "", 0.1, {"float16": 0.5},
                                              {"float16": 0.0}))
    now = _time.time()
    events = [
        ev.NonFiniteEvent(0, 0, "layers.2", "Linear", "output", "inf", frames + (shares,), now, capture="c",
                          reproduced=True, host="h", verdict="model"),
        ev.BatchTraceEvent(1, 0, frames, now),
        ev.OverflowCheckEvent(2, 0, "ctx", "nan", stat("x", 0.0, float("nan")), now),
        ev.AbortAfterBatchEvent(3, 0, now),
        ev.StoppedByRankEvent(4, 0, 1, "a", "Linear", "weight", "inf", now, stopped_at_batch=5),
        ev.SkippedStepEvent(5, 0, 1, 1024.0, "a", "Linear", "weight.grad", "inf", now),
        ev.SkipStreakEvent(6, 0, 3, 2.0, now),
        ev.SkippedNonFiniteStepEvent(7, 0, "a", "Linear", "weight.grad", "nan", now),
        ev.SamplingRateEvent(8, 0, 4, 0.03, 0.01, 0.02, now),
    ]
    sink = otel.sink()
    for e in events:
        sink.on_event(e)
    sink.flush()
    known = set(cat.ATTRIBUTES.values()) | {a for a, _ in cat.SPAN_ATTRIBUTES.values()}
    prefixes = (cat.span_attribute("underflow") + ".", cat.span_attribute("overflow") + ".")
    spans = otel.finished()
    assert {s.name for s in spans} == {name for name, _ in cat.SPANS.values()}
    seen = set()
    for s in spans:
        seen.update(s.attributes)
        for e in s.events:
            assert e.name == cat.FRAME_EVENT
            seen.update(e.attributes)
        for link in s.links:
            seen.update(link.attributes)
    data = otel.reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    seen.update(p.attributes)
    stray = {a for a in seen if a not in known and not a.startswith(prefixes)}
    assert not stray, f"attributes not in sinks/catalogue.py: {sorted(stray)}"
    assert {cat.span_attribute(k) for k in ("report", "capture", "verdict", "ctx", "stopped_at_batch",
                                            "skip_streak", "grad_scale", "frame_index")} <= seen
