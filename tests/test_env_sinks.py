"""sinks=None: what TENSORWATCH_* and the standard OTEL_* variables switch on, checked against a
real OTLP receiver over gRPC and HTTP, in-process and in a training process that dies."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import uuid

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
    assert res["tensorwatch.rank"] == 5
    # unique per process, not the rank: rank 5 of two jobs must not share one
    assert uuid.UUID(res["service.instance.id"]).version == 4
    assert mp._sdk_config.resource.attributes["service.instance.id"] == res["service.instance.id"]
    assert res["team"] == "ml" and res["deployment.environment"] == "test"
    shutdown_bounded([tp, mp], 5)
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=node7-gpu5")
    tp, mp = configure_from_env(5)
    assert tp.resource.attributes["service.instance.id"] == "node7-gpu5"
    shutdown_bounded([tp, mp], 5)


def test_service_instance_id_differs_between_processes_of_the_same_rank():
    code = ("import os; os.environ['OTEL_EXPORTER_OTLP_ENDPOINT'] = 'http://127.0.0.1:4318'\n"
            "from tensorwatch_otel.sinks.otel_env import make_resource\n"
            "a = make_resource(0).attributes; print(a['service.instance.id'], a['tensorwatch.rank'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
    ids = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        instance, rank = out.stdout.split()
        assert rank == "0"
        ids.append(instance)
    assert ids[0] != ids[1]


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
    assert span["resource"]["tensorwatch.rank"] == int(rank)
    assert uuid.UUID(span["resource"]["service.instance.id"]).version == 4
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
        assert gauges[0]["resource"]["tensorwatch.rank"] == 0
        assert gauges[0]["resource"]["service.instance.id"] == span["resource"]["service.instance.id"]
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


# ---------------------------------------------------------------- protocol, port and URL
@pytest.mark.parametrize("env, signal, protocol, var", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4318"}, "traces", "http/protobuf", None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4317"}, "traces", "grpc", None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:9999"}, "metrics", "http/protobuf", None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"}, "traces", "grpc", None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     "traces", "http/protobuf", "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4318",
      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://traces.example:4317"}, "traces", "grpc", None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4317", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
      "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "metrics", "http/protobuf", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"),
])
def test_protocol_is_the_variable_else_follows_the_grpc_port(env, signal, protocol, var):
    from tensorwatch_otel.sinks._otlp_check import resolve

    t = resolve(signal, env)
    assert (t.protocol, t.protocol_var) == (protocol, var)


@pytest.mark.parametrize("var, value", [
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4318"),  # the HTTP exporter needs the scheme
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://localhost:4318"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:99999"),
    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http//collector:4318/v1/metrics"),
])
def test_endpoint_that_is_not_a_url_is_one_line_and_no_pipeline(clean_env, caplog, var, value):
    from tensorwatch_otel import watch
    from tensorwatch_otel.sinks.otel_env import OtlpConfigError

    # the traces endpoint is fine: a bad metrics one must still leave nothing half built
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    clean_env.setenv(var, value)
    with pytest.raises(OtlpConfigError, match=var):
        configure_from_env(0)
    threads_before = {t.name for t in threading.enumerate()}
    caplog.set_level(logging.DEBUG, logger="tensorwatch_otel")
    model = torch.nn.Linear(4, 4)
    with watch(model) as w:  # sinks=None: no exception, training goes on without OTLP
        assert [type(s).__name__ for s in w.sinks] == ["TextReport"]
        model(torch.randn(2, 4))
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and errors[0].exc_info is None
    line = errors[0].getMessage()
    assert "\n" not in line and f"{var}={value!r}" in line and "not a URL" in line and "off for this run" in line
    assert not {t.name for t in threading.enumerate()} - threads_before


def _export_once(tp, mp):
    tp.get_tracer("t").start_span("s").end()
    mp.get_meter("t").create_counter("c").add(1)
    tp.force_flush()
    mp.force_flush()


@pytest.mark.waits
@pytest.mark.parametrize("protocol, wrong_port, advice", [
    ("http/protobuf", "grpc", "speaks gRPC (HTTP/2), not OTLP/HTTP"),
    ("grpc", "http", "speaks HTTP/1.1 (OTLP/HTTP), not gRPC"),
])
def test_protocol_port_mismatch_is_one_line_naming_the_variable(clean_env, caplog, protocol, wrong_port, advice):
    from tensorwatch_otel.sinks import _otlp_check

    clean_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    with OtlpReceiver() as r:
        endpoint = r.grpc_endpoint if wrong_port == "grpc" else r.http_endpoint
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        if protocol == "grpc":  # explicit; http/protobuf is the default on a port other than 4317
            clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        caplog.set_level(logging.WARNING, logger="tensorwatch_otel")
        tp, mp = configure_from_env(0)
        try:
            _export_once(tp, mp)  # traces and metrics both fail
            _export_once(tp, mp)
        finally:
            shutdown_bounded([tp, mp], 5)
        assert r.calls == {"grpc": 0, "http": 0}
    ours = [r for r in caplog.records if r.name == _otlp_check.__name__]
    assert len(ours) == 1, [r.getMessage() for r in ours]
    line = ours[0].getMessage()
    assert advice in line and "OTEL_EXPORTER_OTLP_PROTOCOL" in line and endpoint in line and "\n" not in line
    other = "grpc" if protocol == "http/protobuf" else "http/protobuf"
    assert f"set OTEL_EXPORTER_OTLP_PROTOCOL={other}" in line


def test_close_exporters_now_reaches_both_exporters(clean_env):
    """Both exporters of an env-built pipeline are found and closed (the metric exporter was
    missed on SDKs that keep the readers in MeterProvider._metric_readers)."""
    from tensorwatch_otel.sinks.otel_env import _exporters, close_exporters_now

    with OtlpReceiver() as r:
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.http_endpoint)
        tp, mp = configure_from_env(0)
        try:
            found = [type(e).__name__ for p in (tp, mp) for e in _exporters(p)]
            assert found == ["CheckedSpanExporter", "CheckedMetricExporter"]
            close_exporters_now([tp, mp])
            from opentelemetry.sdk.metrics.export import MetricExportResult

            # a closed OTLP exporter refuses to export
            assert _exporters(mp)[0].export(None) is MetricExportResult.FAILURE
        finally:
            shutdown_bounded([tp, mp], 5)


_SHORT_RUN = textwrap.dedent("""
    import logging, torch
    logging.basicConfig(level=logging.WARNING)
    from tensorwatch_otel import watch
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with watch(model, flush_timeout_s=1.0):  # sinks=None: OTLP from the environment
        for _ in range(3):
            model(torch.randn(4, 8))
""")
RUNS = max(4, 2 * (os.cpu_count() or 2))


@pytest.mark.slow
@pytest.mark.parametrize("protocol, wrong_port, advice", [
    ("http/protobuf", "grpc", "speaks gRPC (HTTP/2), not OTLP/HTTP"),
    ("grpc", "http", "speaks HTTP/1.1 (OTLP/HTTP), not gRPC"),
])
def test_protocol_port_mismatch_hint_prints_before_exit_on_a_loaded_machine(protocol, wrong_port, advice):
    """A short run (its only exports: the flush at detach and the shutdown) with the protocol the
    port does not speak: the hint is in its output every time, with both cores busy. Before, it
    came only once the exporter's retries ended (up to its 10 s timeout), after the process had
    gone: never in a short run, sometimes in a longer one. The runs go at once, two per core:
    each has a fraction of a core, as on a loaded machine (a busy loop per core beside them
    took two cores from the rest of the suite for half a minute)."""
    runs: list = []
    try:
        with OtlpReceiver() as r:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
            env.update(OTEL_EXPORTER_OTLP_ENDPOINT=r.grpc_endpoint if wrong_port == "grpc" else r.http_endpoint,
                       OTEL_EXPORTER_OTLP_PROTOCOL=protocol, OMP_NUM_THREADS="1")
            # the runs at once: each shares the cores with all the others
            runs = [subprocess.Popen([sys.executable, "-c", _SHORT_RUN], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True) for _ in range(RUNS)]
            missed = []
            for proc in runs:
                _, stderr = proc.communicate(timeout=180)
                assert proc.returncode == 0, stderr[-3000:]
                hints = [line for line in stderr.splitlines() if advice in line]
                if len(hints) != 1:
                    missed.append(stderr[-3000:])
            assert r.calls == {"grpc": 0, "http": 0}
    finally:
        for proc in runs:  # (a failed assertion above leaves none running)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not missed, f"the hint printed once in {RUNS - len(missed)} of {RUNS} runs; a run without it:\n{missed[0]}"


def test_matching_protocol_logs_no_mismatch(clean_env, caplog):
    from tensorwatch_otel.sinks import _otlp_check

    with OtlpReceiver() as r:
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.http_endpoint)  # no protocol: http/protobuf
        caplog.set_level(logging.DEBUG, logger="tensorwatch_otel")
        tp, mp = configure_from_env(0)
        _export_once(tp, mp)
        shutdown_bounded([tp, mp], 5)
        assert r.calls["http"] >= 2 and r.calls["grpc"] == 0
    assert not [r for r in caplog.records if r.name == _otlp_check.__name__]


def test_documented_endpoint_on_4317_without_protocol_reaches_the_collector(clean_env):
    # deploy/README.md's first versions said OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4317 with no
    # protocol: that has to export (over gRPC), not retry http/protobuf against a gRPC port.
    try:
        receiver = OtlpReceiver(grpc_port=4317).start()
    except RuntimeError:
        pytest.skip("port 4317 is taken on this machine")
    try:
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317")
        tp, mp = configure_from_env(0)
        _export_once(tp, mp)
        shutdown_bounded([tp, mp], 5)
        assert receiver.calls["grpc"] >= 2 and receiver.calls["http"] == 0
        assert [s["name"] for s in receiver.spans()] == ["s"]
    finally:
        receiver.stop()


# ---------------------------------------------------------------- the application's own SDK
_APP_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from _otel_fixtures import OverflowNet
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    scenario = sys.argv[1]
    res = Resource.create({{"service.name": "app-svc", "service.instance.id": "app-1"}})
    out = {{}}
    if scenario == "otlp":  # the application exports both signals over OTLP itself
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        tp = TracerProvider(resource=res)
        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        mp = MeterProvider(resource=res, metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())])
    else:  # in memory; "traces": the application has a tracer provider only
        spans = InMemorySpanExporter()
        tp = TracerProvider(resource=res)
        tp.add_span_processor(SimpleSpanProcessor(spans))
        reader = InMemoryMetricReader()
        mp = MeterProvider(resource=res, metric_readers=[reader]) if scenario == "memory" else None
    trace.set_tracer_provider(tp)
    if mp is not None:
        metrics.set_meter_provider(mp)

    from tensorwatch_otel import NonFiniteDetected, watch
    torch.manual_seed(0)
    model = OverflowNet()
    x = torch.randn(2, 8)
    with watch(model, max_frames=6) as w:  # sinks=None
        out["sinks"] = [type(s).__name__ for s in w.sinks]
        model(x)
        model.boom.factor = 1e39
        try:
            model(x)
        except NonFiniteDetected:
            out["raised"] = True
    # detached: the application's providers are still its own and still work
    trace.get_tracer("app").start_span("after-detach").end()
    tp.force_flush()
    if scenario == "otlp":
        mp.force_flush()
        tp.shutdown()
        mp.shutdown()
    else:
        out["spans"] = [[s.name, s.resource.attributes["service.name"]] for s in spans.get_finished_spans()]
    if scenario == "memory":
        data = reader.get_metrics_data()
        out["metrics"] = [[m.name, rm.resource.attributes["service.name"], [p.value for p in m.data.data_points]]
                          for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    print("RESULT " + json.dumps(out))
""")


def _run_app(scenario, receiver):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
    # tensorwatch_otel's own pipeline would go to the same receiver: it must not be built
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.http_endpoint, OTEL_SERVICE_NAME="tw-own",
               OTEL_BSP_SCHEDULE_DELAY="50")
    proc = subprocess.run([sys.executable, "-c", _APP_SCRIPT.format(tests=TESTS), scenario], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def test_sinks_none_exports_once_through_the_applications_otlp_pipeline():
    with OtlpReceiver() as r:
        out = _run_app("otlp", r)
        assert out["raised"] and out["sinks"] == ["TextReport", "OtelTelemetry"]
        spans = r.spans()
        assert len(_detection_spans(r)) == 1
        assert sorted(s["name"] for s in spans) == ["after-detach", "tensorwatch.nonfinite_detected"]
        resources = {(s["resource"]["service.name"], s["resource"]["service.instance.id"]) for s in spans}
        points = [m for m in r.metrics() if m["name"].startswith("tensorwatch.")]
        resources |= {(m["resource"]["service.name"], m["resource"]["service.instance.id"]) for m in points}
        assert resources == {("app-svc", "app-1")}
        # cumulative: each collection (flush at the detection, at detach, the application's own
        # flush and shutdown) carries the same count 1 from the one pipeline
        counts = [m for m in points if m["name"] == "tensorwatch.nonfinite.events"]
        assert counts and {m["value"] for m in counts} == {1}


def test_sinks_none_exports_through_in_memory_application_providers_and_not_over_otlp():
    with OtlpReceiver() as r:
        out = _run_app("memory", r)
        assert r.attempts == {"grpc": 0, "http": 0}
    assert [s for s in out["spans"] if s[0] == "tensorwatch.nonfinite_detected"] == \
        [["tensorwatch.nonfinite_detected", "app-svc"]]
    assert ["after-detach", "app-svc"] in out["spans"]
    counts = [m for m in out["metrics"] if m[0] == "tensorwatch.nonfinite.events"]
    assert counts == [["tensorwatch.nonfinite.events", "app-svc", [1]]]
    assert {m[1] for m in out["metrics"]} == {"app-svc"}


def test_application_with_a_tracer_provider_only_gets_our_metrics_pipeline_not_a_second_trace_one():
    with OtlpReceiver() as r:
        out = _run_app("traces", r)
        assert r.spans() == []  # spans went through the application's provider only
        points = r.wait_for(lambda rr: [m for m in rr.metrics() if m["name"] == "tensorwatch.nonfinite.events"])
        assert {m["resource"]["service.name"] for m in points} == {"tw-own"}
    assert [s for s in out["spans"] if s[0] == "tensorwatch.nonfinite_detected"] == \
        [["tensorwatch.nonfinite_detected", "app-svc"]]


def test_documented_endpoints_match_the_collectors_protocol_per_port():
    # every OTEL_EXPORTER_OTLP_ENDPOINT the deploy docs give, resolved as a run would, must speak
    # the protocol the shipped collector serves on that port
    import re

    import yaml
    from tensorwatch_otel.sinks._otlp_check import resolve

    root = os.path.dirname(TESTS)
    with open(os.path.join(root, "deploy", "otel-collector", "config.yaml"), encoding="utf-8") as fh:
        receivers = yaml.safe_load(fh)["receivers"]["otlp"]["protocols"]
    served = {int(receivers["grpc"]["endpoint"].rsplit(":", 1)[1]): "grpc",
              int(receivers["http"]["endpoint"].rsplit(":", 1)[1]): "http/protobuf"}
    found = []
    for doc in ("deploy/README.md", "deploy/docker-compose.yaml", "deploy/otel-collector/config.yaml",
                "docs/deploy.md", "docs/integrations.md", "docs/telemetry.md"):
        with open(os.path.join(root, doc), encoding="utf-8") as fh:
            for url in re.findall(r"OTEL_EXPORTER_OTLP_ENDPOINT=(http://[A-Za-z0-9.:_-]+)", fh.read()):
                t = resolve("traces", {"OTEL_EXPORTER_OTLP_ENDPOINT": url})
                if t.port in served:
                    found.append(doc)
                    assert t.protocol == served[t.port], (doc, url)
    assert "deploy/README.md" in found


_INSTRUMENTED_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from _otel_fixtures import OverflowNet
    from tensorwatch_otel import NonFiniteDetected, watch
    torch.manual_seed(0)
    model = OverflowNet()
    x = torch.randn(2, 8)
    with watch(model, max_frames=6) as w:  # sinks=None, no OpenTelemetry code in the script
        print("SINKS", [type(s).__name__ for s in w.sinks])
        model(x)
        model.boom.factor = 1e39
        try:
            model(x)
        except NonFiniteDetected:
            print("RAISED")
""")


@pytest.mark.slow
def test_opentelemetry_instrument_run_exports_once_under_the_applications_resource():
    pytest.importorskip("opentelemetry.distro")
    with OtlpReceiver() as r:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=r.http_endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                   OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="otlp", OTEL_LOGS_EXPORTER="none",
                   OTEL_SERVICE_NAME="instrumented-app", OTEL_RESOURCE_ATTRIBUTES="service.instance.id=app-7")
        script = _INSTRUMENTED_SCRIPT.format(tests=TESTS)
        proc = subprocess.run(["opentelemetry-instrument", sys.executable, "-c", script],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "RAISED" in proc.stdout and "'OtelTelemetry'" in proc.stdout
        [span] = _detection_spans(r)
        points = r.wait_for(lambda rr: [m for m in rr.metrics() if m["name"].startswith("tensorwatch.")])
        resources = {(x["resource"]["service.name"], x["resource"]["service.instance.id"]) for x in [span] + points}
        assert resources == {("instrumented-app", "app-7")}
        # the resource opentelemetry-instrument built (it adds telemetry.auto.version), not ours
        assert "tensorwatch.rank" not in span["resource"]
        assert all("telemetry.auto.version" in x["resource"] for x in [span] + points)


def test_pipeline_that_fails_half_way_is_taken_down_and_logged(clean_env, caplog):
    from tensorwatch_otel import watch

    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    clean_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "-5")  # the SDK refuses it after the tracer provider exists
    with pytest.raises(ValueError):
        configure_from_env(0)
    from tensorwatch_otel.core.measure.cpu_kernel import KERNEL
    KERNEL.wait(120)  # the process's one kernel build (a thread of its own) is not the pipeline's
    threads_before = {t.name for t in threading.enumerate()}
    caplog.set_level(logging.WARNING, logger="tensorwatch_otel")
    model = torch.nn.Linear(4, 4)
    with watch(model) as w:
        assert [type(s).__name__ for s in w.sinks] == ["TextReport"]
        model(torch.randn(2, 4))
    [line] = [r.getMessage() for r in caplog.records if r.name.startswith("tensorwatch_otel")]
    assert "setting up OTLP export failed (ValueError" in line and "off for this run" in line
    assert not {t.name for t in threading.enumerate()} - threads_before


class _Heads(torch.nn.Module):
    """A block whose output is a dict of 16 tensors under long names: each frame of it is about
    6 KB of report text."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        return {f"{'per_head_projection_' * 16}{i}": h * (i + 1) for i in range(16)}


class _Tower(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Heads() for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(sum(block(x).values()) / 16)
        return x


def test_a_detection_whose_ring_exceeds_the_collectors_limit_still_reaches_it(clean_env, tmp_path, caplog):
    """A ring of 2000 frames: about 7 MiB of report, more than a collector's default 4 MiB gRPC
    message. The span arrives with the report bounded (the frames nearest the detection kept, how
    many earlier ones were cut said in the report and in an attribute); the JSON lines event log
    holds every frame; nothing is logged about a slow collector."""
    from tensorwatch_otel import NonFiniteDetected, watch
    from tensorwatch_otel.report.text import render_detection
    from tensorwatch_otel.sinks import JsonlLog
    from tensorwatch_otel.sinks.otel import OtelTelemetry

    path = tmp_path / "events.jsonl"
    with OtlpReceiver() as r:  # gRPC with its default 4 MiB limit on a message
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.grpc_endpoint)
        clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        clean_env.setenv("OTEL_METRICS_EXPORTER", "none")
        tp, mp = configure_from_env(0)
        sink = OtelTelemetry(tp, mp, shutdown_on_close=True)
        torch.manual_seed(0)
        model = _Tower(100)  # 201 frames a batch (block, its Linear; the root)
        x = torch.randn(2, 4)
        caplog.set_level(logging.WARNING)
        with torch.no_grad(), watch(model, sinks=[sink, JsonlLog(str(path))], max_frames=2000):
            for _ in range(10):
                model(x)
            model.blocks[60].proj.weight[0, 0] = float("inf")
            with pytest.raises(NonFiniteDetected) as info:
                model(x)
            [span] = r.wait_for(_detection_spans, timeout=10)
        event = info.value.event
        assert len(event.frames) == 2000
        assert len(render_detection(event).encode()) > 4 << 20  # the whole report would not fit
        a = span["attributes"]
        report = a["tensorwatch.report"]
        assert len(report.encode()) <= 1 << 20
        cut = a["tensorwatch.report.frames_omitted"]
        assert 0 < cut < 2000
        assert f"{cut} earlier frames left out" in report
        assert report.rstrip().endswith(render_detection(event).rstrip()[-2000:])  # ends at the detection
        assert (a["tensorwatch.module.path"], a["tensorwatch.tensor"]) == ("blocks.60.proj", "weight")
        assert span["events"][-1]["attributes"]["tensorwatch.module.path"] == "blocks.60.proj"
        [logged] = [json.loads(line) for line in path.read_text().splitlines()
                    if json.loads(line)["event"] == "nonfinite_detected"]
        assert len(logged["frames"]) == 2000  # the whole ring
        assert not [rec for rec in caplog.records if "slow or unreachable" in rec.getMessage()
                    or "RESOURCE_EXHAUSTED" in rec.getMessage()]
