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


# -- item: silent no-ops and mis-aimed errors ------------------------------------------------------
def _net():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def test_include_matching_no_module_is_an_error_naming_it(clean_env):
    with pytest.raises(ConfigError, match=r"include=\['nomatch\.\*'\] matches no module.*e\.g\. \(root\), 0, 1, 2"):
        watch(_net(), sinks=[], include=["nomatch.*"])
    clean_env.setenv("TENSORWATCH_INCLUDE", "nomatch.*")
    with pytest.raises(ConfigError, match=r"TENSORWATCH_INCLUDE=\['nomatch\.\*'\] matches no module"):
        watch(_net(), sinks=[])


def test_unmatched_exclude_or_one_unmatched_include_warns_once(clean_env, caplog):
    caplog.set_level(logging.WARNING, logger="tensorwatch_otel")
    with watch(_net(), sinks=[], include=["0", "typo*"], exclude=["nothing"]) as w:
        assert w.config.include == ("0", "typo*")
    [rec] = [r for r in caplog.records if "match no module" in r.getMessage()]
    assert "include pattern 'typo*'" in rec.getMessage() and "exclude pattern 'nothing'" in rec.getMessage()
    assert "(root), 0, 1, 2" in rec.getMessage()


def test_otel_telemetry_without_sdk_providers_warns_once(clean_env, caplog):
    import tensorwatch_otel.sinks.otel as otel_mod
    from tensorwatch_otel.sinks import OtelTelemetry

    clean_env.setattr(otel_mod, "_told_nowhere", False)
    caplog.set_level(logging.WARNING, logger="tensorwatch_otel")
    OtelTelemetry(), OtelTelemetry()
    told = [r.getMessage() for r in caplog.records if "exports nothing" in r.getMessage()]
    assert len(told) == 1 and "tracer_provider=" in told[0]
    from opentelemetry.sdk.trace import TracerProvider

    caplog.clear()
    clean_env.setattr(otel_mod, "_told_nowhere", False)
    OtelTelemetry(tracer_provider=TracerProvider())
    assert not [r for r in caplog.records if "exports nothing" in r.getMessage()]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_capture_dir_variable_fails_at_watch(clean_env, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    clean_env.setenv("TENSORWATCH_CAPTURE_DIR", str(ro / "caps"))
    with pytest.raises(ConfigError, match="TENSORWATCH_CAPTURE_DIR=.*cannot create files"):
        watch(_net(), sinks=[])


def test_capture_dir_under_a_file_fails_at_watch(clean_env, tmp_path):
    (tmp_path / "f").write_text("x")
    clean_env.setenv("TENSORWATCH_CAPTURE_DIR", str(tmp_path / "f" / "caps"))
    with pytest.raises(ConfigError, match=r"TENSORWATCH_CAPTURE_DIR=.*is a file, not a folder"):
        watch(_net(), sinks=[])
    with pytest.raises(ConfigError, match=r"^capture_dir=.*exists and is not a directory"):
        watch(_net(), sinks=[], capture_dir=str(tmp_path / "f"))
    clean_env.setenv("TENSORWATCH_CAPTURE_DIR", str(tmp_path / "new" / "caps"))  # creatable: fine
    watch(_net(), sinks=[]).detach()


def test_misspelt_variable_warns_once_naming_the_real_one(clean_env, caplog):
    from tensorwatch_otel.core.process import forget_said

    forget_said(("unknown variable", "TENSORWATCH_MAX_FRAME"))
    clean_env.setenv("TENSORWATCH_MAX_FRAME", "3")
    caplog.set_level(logging.WARNING, logger="tensorwatch_otel")
    watch(_net(), sinks=[]).detach()
    watch(_net(), sinks=[]).detach()
    told = [r.getMessage() for r in caplog.records if "TENSORWATCH_MAX_FRAME " in r.getMessage()]
    assert told == ["tensorwatch_otel: TENSORWATCH_MAX_FRAME is not a tensorwatch_otel variable and is "
                    "ignored; did you mean TENSORWATCH_MAX_FRAMES?"]


@pytest.mark.parametrize("value", [True, 1, "yes", object()])
def test_grad_scaler_must_be_a_grad_scaler(clean_env, value):
    with pytest.raises(TypeError, match=r"^grad_scaler=.*expected a torch\.amp\.GradScaler"):
        watch(_net(), sinks=[], grad_scaler=value)
    watch(_net(), sinks=[], grad_scaler=torch.amp.GradScaler("cpu", enabled=False)).detach()


def test_bad_prometheus_addr_variable_is_named(clean_env, port):
    clean_env.setenv("TENSORWATCH_PROMETHEUS_PORT", str(port))
    clean_env.setenv("TENSORWATCH_PROMETHEUS_ADDR", "999.1.1.1")
    with pytest.raises(ConfigError, match=r"^TENSORWATCH_PROMETHEUS_ADDR='999\.1\.1\.1': not an address"):
        watch(_net())


def test_unknown_keyword_lists_the_valid_options(clean_env):
    with pytest.raises(TypeError) as err:
        watch(_net(), max_frame=3)
    msg = str(err.value)
    assert msg.startswith("watch(): unknown watch() option(s) max_frame (did you mean max_frames?); valid: sinks, ")
    assert "rerun_on_detect" in msg
    from tensorwatch_otel.integrations.transformers import TensorwatchCallback

    with pytest.raises(TypeError, match=r"unknown watch\(\) option\(s\) max_frame \(did you mean max_frames\?\)"):
        TensorwatchCallback(max_frame=3)


def test_a_single_sink_for_sinks_says_it_takes_a_list(clean_env):
    from tensorwatch_otel.sinks import TextReport

    with pytest.raises(TypeError, match=r"^sinks: expected a list of sinks, got one TextReport; write "
                                        r"sinks=\[TextReport\(\.\.\.\)\]"):
        watch(_net(), sinks=TextReport())
    with pytest.raises(TypeError, match=r"^sinks: expected a list of sinks .*got int"):
        watch(_net(), sinks=3)


def test_port_mismatch_hint_fires_on_the_instrument_path(clean_env, caplog):
    """opentelemetry-instrument's distro sets OTEL_EXPORTER_OTLP_PROTOCOL=grpc; deploy/README's
    endpoint is the OTLP/HTTP port 4318: the application's providers export nothing, and the hint
    says so once."""
    from opentelemetry.sdk.trace import TracerProvider

    import tensorwatch_otel.sinks._otlp_check as check
    from tensorwatch_otel.sinks.from_env import otel_sink_from_env

    clean_env.setattr(check, "_reported", set())
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    clean_env.setattr("opentelemetry.trace._TRACER_PROVIDER", TracerProvider())  # as the distro does
    caplog.set_level(logging.WARNING, logger="tensorwatch_otel")
    for _ in range(2):
        sink = otel_sink_from_env()
        assert sink is not None
        sink.flush(0.2)  # as a watcher with flush_timeout_s=0.2 detaches: its close waits that long, not 5 s
        sink.close()
    told = [r.getMessage() for r in caplog.records if "port 4318 is OTLP/HTTP's" in r.getMessage()]
    assert len(told) == 1, told
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf" in told[0]


def test_metrics_reference_lists_every_family_metrics_serves(clean_env):
    """A real /metrics after a detection and skipped steps: every metric family it serves, and
    every family the sink can produce, has a row in the series table of docs/reference/metrics.md
    (generated from the catalogue: the sink and the catalogue cannot drift apart)."""
    import re

    from prometheus_client import CollectorRegistry

    from tensorwatch_otel.core.events import SkippedStepEvent, SkipStreakEvent
    from tensorwatch_otel.sinks import PrometheusMetrics

    page = os.path.join(os.path.dirname(__file__), "..", "docs", "reference", "metrics.md")
    readme = open(page, encoding="utf-8").read()
    table = readme[readme.index("| series | type | labels |"):]
    table = table[:table.index("\n\n")]
    documented = set(re.findall(r"`(tensorwatch_[a-z_]+)`", table))
    sink = PrometheusMetrics(port=0, registry=CollectorRegistry(), linger_s=0)
    model = OverflowNet()
    try:
        with watch(model, sinks=[sink], on_detect="report"):
            model(torch.randn(2, 8))
            model.boom.factor = 1e39
            model(torch.randn(2, 8))
        import dataclasses

        for cls in (SkippedStepEvent, SkipStreakEvent):
            kw = {f.name: 0 for f in dataclasses.fields(cls) if f.init and f.default is dataclasses.MISSING
                  and f.default_factory is dataclasses.MISSING}
            sink.on_event(dataclasses.replace(cls(**kw), streak=3, time=1.0))
        with urllib.request.urlopen(sink.url, timeout=5) as resp:
            body = resp.read().decode("utf-8")
    finally:
        sink.close()
    served = {name for (name, _) in parse_prom(body)}
    assert {"tensorwatch_nonfinite_events_total", "tensorwatch_optimizer_skip_streak",
            "tensorwatch_optimizer_steps_skipped_total"} <= served
    missing = sorted(n for n in served if n not in documented)
    assert not missing, f"docs/reference/metrics.md's series table lacks {missing}"
    every = {m.name + ("_total" if m.type == "counter" else "") for m in sink._families(None, 0)}
    assert not sorted(every - documented), sorted(every - documented)
