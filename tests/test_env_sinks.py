"""sinks=None: what TENSORWATCH_* and the standard OTEL_* variables switch on, checked against a
real OTLP receiver over gRPC and HTTP, in-process and in a training process that dies."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from _otel_fixtures import OverflowNet
from otlp_receiver import OtlpReceiver
from tensorwatch_otel.sinks.from_env import sinks_from_env
from tensorwatch_otel.sinks.otel_env import configure_from_env, shutdown_bounded
from tensorwatch_otel._version import __version__

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "TENSORWATCH_")) or k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)
    return monkeypatch


def _close(sinks):
    for s in sinks:
        s.flush(2)
        s.close()


def test_nothing_set_means_no_extra_sinks(clean_env):
    assert sinks_from_env() == []
    assert configure_from_env(0) is None


@pytest.mark.parametrize("bad", ["http", "-1", "70000", "9090x"])
def test_invalid_prometheus_port_names_the_variable(clean_env, bad):
    clean_env.setenv("TENSORWATCH_PROMETHEUS_PORT", bad)
    with pytest.raises(ValueError, match="TENSORWATCH_PROMETHEUS_PORT"):
        sinks_from_env()


def test_prometheus_port_and_local_rank(clean_env):
    from conftest import free_port
    from tensorwatch_otel.sinks.prometheus import PrometheusMetrics

    base = free_port()
    clean_env.setenv("TENSORWATCH_PROMETHEUS_PORT", str(base))
    clean_env.setenv("TENSORWATCH_PROMETHEUS_LINGER_SECONDS", "0")
    [sink] = sinks_from_env()
    try:
        assert isinstance(sink, PrometheusMetrics)
        assert sink.port == base and sink.addr == "127.0.0.1"
    finally:
        _close([sink])


def test_jsonl(clean_env, tmp_path):
    from tensorwatch_otel.sinks.jsonl import JsonlLog

    clean_env.setenv("TENSORWATCH_JSONL", str(tmp_path / "ev.jsonl"))
    [sink] = sinks_from_env()
    assert isinstance(sink, JsonlLog) and sink.path == str(tmp_path / "ev.jsonl")


def test_sdk_disabled_wins(clean_env):
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    clean_env.setenv("OTEL_SDK_DISABLED", "TRUE")
    assert sinks_from_env() == []
    assert configure_from_env(0) is None


def test_invalid_protocol_names_the_variable(clean_env):
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        configure_from_env(0)


def test_resource_rank_service_and_attributes(clean_env):
    from opentelemetry.sdk.trace import TracerProvider

    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    clean_env.setenv("OTEL_SERVICE_NAME", "trainer")
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=ml")
    tp, mp = configure_from_env(5)
    assert isinstance(tp, TracerProvider)
    res = tp.resource.attributes
    assert res["service.name"] == "trainer"
    assert res["service.instance.id"] == "5"
    assert res["team"] == "ml" and res["deployment.environment"] == "test"
    shutdown_bounded([tp, mp], 5)
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=node7-gpu5")
    tp, mp = configure_from_env(5)
    assert tp.resource.attributes["service.instance.id"] == "node7-gpu5"
    shutdown_bounded([tp, mp], 5)


def test_service_name_defaults_to_the_package_not_unknown_service(clean_env):
    # the shipped Jaeger links and dashboard look for service "tensorwatch-otel"
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    tp, mp = configure_from_env(0)
    assert tp.resource.attributes["service.name"] == "tensorwatch-otel"
    shutdown_bounded([tp, mp], 5)
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs")
    tp, mp = configure_from_env(0)
    assert tp.resource.attributes["service.name"] == "from-attrs"
    shutdown_bounded([tp, mp], 5)


def test_signal_switches(clean_env):
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import NoOpTracerProvider

    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    tp, mp = configure_from_env(0)
    assert isinstance(tp, TracerProvider) and isinstance(mp, NoOpMeterProvider)
    shutdown_bounded([tp], 5)
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    tp, mp = configure_from_env(0)
    assert isinstance(tp, NoOpTracerProvider) and isinstance(mp, MeterProvider)
    shutdown_bounded([mp], 5)


def _detection_spans(r):
    return [s for s in r.spans() if s["name"] == "tensorwatch.nonfinite_detected"]


def _check_detection(span, rank="0"):
    assert span["status_code"] == 2  # STATUS_CODE_ERROR
    assert span["scope"] == ("tensorwatch_otel", __version__)
    a = span["attributes"]
    assert (a["tensorwatch.module.path"], a["tensorwatch.module.class"], a["tensorwatch.tensor"]) == \
        ("boom", "Overflow", "output")
    assert a["tensorwatch.nonfinite.kind"] == "inf"
    assert a["tensorwatch.batch_number"] == 1 and a["tensorwatch.rank"] == int(rank)
    assert "Detected inf/nan during batch_number=1" in a["tensorwatch.report"]
    frames = [e for e in span["events"] if e["name"] == "tensorwatch.frame"]
    # ring buffer in order: the end of batch 0, then batch 1 up to the overflow
    assert [f["attributes"]["tensorwatch.module.path"] for f in frames] == \
        ["inp", "boom", "out", "(root)", "inp", "boom"]
    assert [f["attributes"]["tensorwatch.batch_number"] for f in frames] == [0, 0, 0, 0, 1, 1]
    boom = frames[-1]["attributes"]
    assert boom["tensorwatch.tensors"] == ["input[0]", "output"]
    assert boom["tensorwatch.abs_max"][1] == float("inf")
    assert span["resource"]["service.name"] == "tw-test"
    assert span["resource"]["service.instance.id"] == rank
    assert span["resource"]["team"] == "ml"


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_sinks_none_exports_to_a_real_receiver(clean_env, protocol):
    from tensorwatch_otel import NonFiniteDetected, watch

    with OtlpReceiver() as r:
        endpoint = r.grpc_endpoint if protocol == "grpc" else r.http_endpoint
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        clean_env.setenv("OTEL_SERVICE_NAME", "tw-test")
        clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=ml")
        torch.manual_seed(0)
        model = OverflowNet()
        x = torch.randn(2, 8)
        with watch(model, max_frames=6) as w:
            assert any(type(s).__name__ == "OtelTelemetry" for s in w.sinks)
            model(x)
            model.boom.factor = 1e39
            with pytest.raises(NonFiniteDetected):
                model(x)
            # flushed before the exception left the hook: already at the receiver
            [span] = _detection_spans(r)
            _check_detection(span)
            counts = [m for m in r.metrics() if m["name"] == "tensorwatch.nonfinite.events"]
            assert counts and counts[-1]["value"] == 1 and counts[-1]["attributes"]["tensorwatch.tensor"] == "output"
        # detach shut the providers down: the last collection carried the gauges (finite only)
        gauges = r.wait_for(lambda rr: [m for m in rr.metrics() if m["name"] == "tensorwatch.tensor.abs_max"])
        inp = [g for g in gauges if g["attributes"]["tensorwatch.module.path"] == "inp"
               and g["attributes"]["tensorwatch.tensor"] == "weight"]
        assert inp and inp[-1]["value"] == pytest.approx(model.inp.weight.detach().abs().max().item())
        assert all(g["value"] == g["value"] and abs(g["value"]) != float("inf") for g in gauges)
        assert gauges[0]["resource"]["service.instance.id"] == "0"
        assert r.calls["grpc" if protocol == "grpc" else "http"] > 0
        assert r.calls["http" if protocol == "grpc" else "grpc"] == 0


_DIE_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from _otel_fixtures import OverflowNet
    from tensorwatch_otel import watch
    torch.manual_seed(0)
    model = OverflowNet()
    x = torch.randn(2, 8)
    w = watch(model, max_frames=6)  # sinks=None; never detached: the process dies on the raise
    model(x)
    model.boom.factor = 1e39
    model(x)
""")


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_training_process_that_dies_loses_nothing(protocol):
    with OtlpReceiver() as r:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=r.grpc_endpoint if protocol == "grpc" else r.http_endpoint,
                   OTEL_EXPORTER_OTLP_PROTOCOL=protocol, OTEL_SERVICE_NAME="tw-test",
                   OTEL_RESOURCE_ATTRIBUTES="team=ml", RANK="2")
        proc = subprocess.run([sys.executable, "-c", _DIE_SCRIPT.format(tests=TESTS)], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and "NonFiniteDetected" in proc.stderr
        [span] = _detection_spans(r)
        _check_detection(span, rank="2")
        counts = [m for m in r.metrics() if m["name"] == "tensorwatch.nonfinite.events"]
        assert counts and counts[-1]["value"] == 1
        assert counts[-1]["attributes"]["tensorwatch.rank"] == 2
