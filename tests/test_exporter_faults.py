"""Exporter faults never break or slow training: an OTLP endpoint nobody listens on, a receiver
that stalls or refuses, a taken metrics port, an event log on a full or impossible path.

Timing is compared side by side: a model watched with the faulty exporter and an identical one
watched without it take turns, so machine load hits both alike."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from _otel_fixtures import OverflowNet, TinyNet, interleaved_medians
from conftest import free_port
from otlp_receiver import OtlpReceiver
from tensorwatch_otel import NonFiniteDetected, watch
from tensorwatch_otel.sinks.otel_env import configure_from_env
from tensorwatch_otel.sinks._base import Sink
from tensorwatch_otel.sinks.otel import OtelTelemetry

# Allowed slowdown of a step with a broken exporter against one without. The exporters work on
# their own threads; on a 2-core box their retries still compete for the CPU a little.
MAX_RATIO = 1.5


@pytest.fixture
def otlp_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "TENSORWATCH_")):
            monkeypatch.delenv(k)
    # export often, so the faulty path is exercised while the steps are timed
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")
    return monkeypatch


def _pair():
    torch.manual_seed(0)
    a, b = TinyNet(d=64, blocks=4), TinyNet(d=64, blocks=4)
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 64)
    return a, b, x


def _step(model, x):
    def run():
        model.zero_grad()
        model(x).sum().backward()
    return run


class _Healthy(Sink):
    """The baseline: a sink that wants batches and events (so the watcher does the same work)
    and exports nowhere."""

    wants_batches = True

    def on_batch(self, stats):
        self.stats = stats

    def on_event(self, event):
        self.event = event


def _assert_not_slower(sink, attempts: int = 3, **watch_kw):
    """Median per-step ratio faulty/healthy <= MAX_RATIO in one of `attempts` measurements: a
    busy CI box can spoil one, while an exporter that blocks the step (seconds per export
    timeout) fails all of them."""
    faulty_model, clean_model, x = _pair()
    seen = []
    with watch(faulty_model, sinks=[sink], on_detect="report", **watch_kw), \
            watch(clean_model, sinks=[_Healthy()], on_detect="report", **watch_kw):
        for _ in range(attempts):
            faulty, clean, ratio = interleaved_medians(_step(faulty_model, x), _step(clean_model, x), rounds=60)
            seen.append((round(ratio, 3), faulty, clean))
            if ratio <= MAX_RATIO:
                return faulty, clean
    raise AssertionError(f"steps with the faulty exporter are slower than {MAX_RATIO}x: "
                         f"(ratio, faulty s, healthy s) per attempt: {seen}")


def _overflow_raise_time(sinks, flush_timeout_s):
    torch.manual_seed(0)
    model = OverflowNet()
    x = torch.randn(2, 8)
    with watch(model, sinks=sinks, flush_timeout_s=flush_timeout_s) as w:
        model(x)
        model.boom.factor = 1e39
        t = time.perf_counter()
        with pytest.raises(NonFiniteDetected):
            model(x)
        return time.perf_counter() - t, w


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_nobody_listening(otlp_env, protocol, caplog):
    otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    otlp_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    tp, mp = configure_from_env(0)
    sink = OtelTelemetry(tp, mp, shutdown_on_close=True)
    caplog.set_level(logging.WARNING)
    try:
        _assert_not_slower(sink, trace_batches=range(0, 10_000, 3))  # spans queued all along
        # the SDK's one-line-per-attempt export errors are let through once, not per attempt
        sdk = {}
        for rec in caplog.records:
            if rec.name.startswith("opentelemetry."):
                sdk[(rec.name, str(rec.msg))] = sdk.get((rec.name, str(rec.msg)), 0) + 1
        assert all(n == 1 for n in sdk.values()), sdk
        with caplog.at_level(logging.WARNING, logger="tensorwatch_otel"):
            took, w = _overflow_raise_time([sink], flush_timeout_s=1.0)
            took2, _ = _overflow_raise_time([sink], flush_timeout_s=1.0)
        assert took < 2.5 and took2 < 2.5, (took, took2)
        ours = [r for r in caplog.records if r.name.startswith("tensorwatch_otel") and "flush" in r.getMessage()]
        assert len(ours) <= 1  # said once, however often it happens
    finally:
        t = time.perf_counter()
        sink.close()
        assert time.perf_counter() - t < 6.5  # shutdown bounded too


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_stalling_receiver(otlp_env, protocol, caplog):
    with OtlpReceiver(mode="stall", stall_s=30) as r:
        otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.grpc_endpoint if protocol == "grpc" else r.http_endpoint)
        otlp_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        tp, mp = configure_from_env(0)
        sink = OtelTelemetry(tp, mp, shutdown_on_close=True)
        try:
            _assert_not_slower(sink, trace_batches=range(0, 10_000, 3))
            with caplog.at_level(logging.WARNING, logger="tensorwatch_otel"):
                took, w = _overflow_raise_time([sink], flush_timeout_s=1.0)
            assert took < 2.5, took
            assert any("did not finish within 1.0 s" in rec.getMessage() for rec in caplog.records
                       if rec.name.startswith("tensorwatch_otel"))
            assert w.sink_failures == {}  # slow is not failed: nothing raised into the fanout
            # once the receiver answers again, what was queued arrives
            r.set_mode("ok")
            r.wait_for(lambda rr: [s for s in rr.spans() if s["name"] == "tensorwatch.nonfinite_detected"],
                       timeout=30)
        finally:
            r.release()
            sink.close()


@pytest.mark.slow
def test_refusing_receiver_grpc(otlp_env):
    with OtlpReceiver(mode="refuse") as r:
        otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.grpc_endpoint)
        otlp_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        tp, mp = configure_from_env(0)
        sink = OtelTelemetry(tp, mp, shutdown_on_close=True)
        try:
            _assert_not_slower(sink, trace_batches=range(0, 10_000, 3))
            took, _ = _overflow_raise_time([sink], flush_timeout_s=1.0)
            assert took < 2.5
            assert r.attempts["grpc"] > 0  # it was really tried
        finally:
            sink.close()


def test_taken_metrics_port_training_goes_on(monkeypatch, caplog):
    import socket

    from prometheus_client import CollectorRegistry

    from tensorwatch_otel.sinks.prometheus import PrometheusMetrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with caplog.at_level(logging.ERROR, logger="tensorwatch_otel"):
            sink = PrometheusMetrics(port=s.getsockname()[1], registry=CollectorRegistry(), linger_s=0)
            faulty, clean = _assert_not_slower(sink)
        assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
        sink.close()


@pytest.mark.parametrize("where", ["full", "impossible"])
def test_event_log_that_cannot_be_written(monkeypatch, tmp_path, caplog, where):
    if where == "full":
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full")
        path = "/dev/full"  # every write fails with ENOSPC, like a full disk
    else:
        # fine when the sink is built (a bad path is rejected then), a file where the folder
        # should be by the first event
        path = str(tmp_path / "file" / "events.jsonl")
    for k in list(os.environ):
        if k.startswith(("OTEL_", "TENSORWATCH_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("TENSORWATCH_JSONL", path)
    torch.manual_seed(0)
    model = OverflowNet()
    x = torch.randn(2, 8)
    with caplog.at_level(logging.ERROR, logger="tensorwatch_otel"):
        with watch(model, on_detect="report") as w:
            if where == "impossible":
                (tmp_path / "file").write_text("")
            model.boom.factor = 1e39
            for _ in range(5):
                model(x)  # five detections, each one a failed write
            model.boom.factor = 1.0
            out = model(x)
            assert torch.isfinite(out).all()
            assert w.batch_number == 6
            assert w.detections == 5
            failures = w.sink_failures
    # logged once per sink method (on_event; flush may fail too on a full disk), then counted
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "JsonlLog.on_event" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    assert failures.get("JsonlLog.on_event") == 5
