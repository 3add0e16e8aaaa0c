"""Configuration the user gets wrong, and names the user chooses: one clear error naming the
option or variable (a bad RANK, a misspelt TENSORWATCH_* variable, an unknown watch() keyword,
a lone sink for `sinks`), a warning where nothing would be watched or exported, and labels that
always encode (a module named with a lone surrogate)."""

from __future__ import annotations

import json
import logging
import os
import urllib.request

import pytest
import torch
from torch import nn

from _otel_fixtures import OverflowNet, parse_prom
from tensorwatch_otel import watch
from tensorwatch_otel.core.env import ConfigError


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "TENSORWATCH_")) or k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)
    return monkeypatch


# -- item: one rank parser -------------------------------------------------------------------------
BAD_RANKS = ["../x", "abc", "0,1", "-1"]


def _sink_builders(tmp_path):
    from prometheus_client import CollectorRegistry

    from tensorwatch_otel.sinks import JsonlLog, OtelTelemetry, PrometheusMetrics

    return {
        "JsonlLog": lambda: JsonlLog(str(tmp_path / "e.jsonl")),
        "PrometheusMetrics": lambda: PrometheusMetrics(registry=CollectorRegistry()),
        "OtelTelemetry": lambda: OtelTelemetry(),
        "watch(sinks=None)": lambda: watch(nn.Linear(2, 2)),
    }


@pytest.mark.parametrize("value", BAD_RANKS)
@pytest.mark.parametrize("who", ["JsonlLog", "PrometheusMetrics", "OtelTelemetry", "watch(sinks=None)"])
def test_bad_rank_is_one_clear_error_everywhere(clean_env, tmp_path, value, who):
    clean_env.setenv("RANK", value)
    with pytest.raises(ConfigError) as err:
        _sink_builders(tmp_path)[who]()
    assert str(err.value) == f"RANK={value!r}: expected an integer >= 0"


def test_a_good_rank_is_read_alike(clean_env, tmp_path):
    clean_env.setenv("RANK", " 3 ")
    from tensorwatch_otel.core.rank import current_rank

    assert current_rank() == 3
    with watch(nn.Linear(2, 2), sinks=[]):
        pass


# -- item: labels always encode --------------------------------------------------------------------
LONE = "\ud800"


def _surrogate_model():
    model = OverflowNet()
    model.inp.add_module(LONE, nn.Identity())  # called by nobody: its weights-free frame is absent,

    class Wrap(nn.Module):  # so a called one too
        def __init__(self):
            super().__init__()
            self.add_module(LONE, nn.Linear(8, 8))
            self.net = model

        def forward(self, x):
            return self.net(getattr(self, LONE)(x))

    return Wrap()


def test_lone_surrogate_module_name_prometheus_scrape_still_works(clean_env):
    from prometheus_client import CollectorRegistry

    from tensorwatch_otel.sinks import PrometheusMetrics

    sink = PrometheusMetrics(port=0, registry=CollectorRegistry())
    model = _surrogate_model()
    try:
        with watch(model, sinks=[sink], on_detect="report") as w:
            model(torch.randn(2, 8))
            model.net.boom.factor = 1e39
            model(torch.randn(2, 8))
            assert w.detections == 1
            with urllib.request.urlopen(sink.url, timeout=5) as resp:
                assert resp.status == 200
                body = resp.read().decode("utf-8")  # strict: the whole page is valid UTF-8
    finally:
        sink.linger_s = 0
        sink.close()
    parsed = parse_prom(body)
    modules = {dict(labels).get("module") for (name, labels) in parsed if name == "tensorwatch_tensor_abs_max"}
    # the surrogate is written as its backslash escape; every other series is there
    assert {"\\ud800", "net.inp", "net.boom", "net.out", "(root)"} <= modules
    assert ("tensorwatch_nonfinite_events_total", (("first_rank", "0"), ("module", "net.boom"),
            ("module_class", "Overflow"), ("rank", "0"), ("tensor", "output"))) in parsed


def test_lone_surrogate_module_name_otel_and_jsonl(clean_env, tmp_path):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tensorwatch_otel.sinks import JsonlLog, OtelTelemetry

    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    mp = MeterProvider(metric_readers=[reader])
    path = tmp_path / "e.jsonl"
    model = _surrogate_model()
    with watch(model, sinks=[OtelTelemetry(tp, mp), JsonlLog(str(path))], on_detect="report",
               trace_batches=[0]) as w:
        model(torch.randn(2, 8))
        model.net.boom.factor = 1e39
        model(torch.randn(2, 8))
        assert w.detections == 1 and w.sink_failures == {}
    data = reader.get_metrics_data()
    paths = {dp.attributes["tensorwatch.module.path"] for rm in data.resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics if m.name == "tensorwatch.tensor.abs_max" for dp in m.data.data_points}
    assert {"\\ud800", "net.inp", "net.out"} <= paths
    # every attribute of every span encodes as UTF-8 (an OTLP exporter serialises it as protobuf)
    names = [s.name for s in spans.get_finished_spans()]
    assert names == ["tensorwatch.batch_trace", "tensorwatch.nonfinite_detected"]
    for s in spans.get_finished_spans():
        for e in s.events:
            for v in e.attributes.values():
                for item in (v if isinstance(v, tuple) else (v,)):
                    if isinstance(item, str):
                        item.encode("utf-8")
    raw = path.read_bytes()
    lines = [json.loads(line) for line in raw.decode("utf-8").splitlines()]
    assert [x["event"] for x in lines] == ["batch_trace", "nonfinite_detected"]
    assert lines[0]["frames"][0]["module"] == "\\ud800"  # written as the same escape as the label
