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
from tensorwatch_otel.sinks.otel_env import configure_from_env, shutdown_bounded
from tensorwatch_otel.sinks._base import Sink
from tensorwatch_otel.sinks.otel import OtelTelemetry

pytestmark = pytest.mark.timing  # slowdowns measured against a twin: run alone (scripts/test.sh)

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


@pytest.mark.waits  # (in-process: beside the other timing tests, tests/conftest.py)
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


@pytest.mark.waits  # (in-process: beside the other timing tests, tests/conftest.py)
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


@pytest.mark.waits  # (in-process: beside the other timing tests, tests/conftest.py)
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


@pytest.mark.waits  # (in-process: beside the other timing tests, tests/conftest.py)
@pytest.mark.slow
def test_after_a_failed_span_export_the_next_wait_but_a_detection_is_tried(otlp_env, monkeypatch):
    """A refusing collector: the failed export starts a wait; ordinary batches meanwhile never
    reach the exporter (the receiver sees no attempt), a batch with a detection span does, and
    after the wait exports go out again (and arrive once the collector takes them)."""
    from tensorwatch_otel.sinks import _otlp_backoff
    from tensorwatch_otel.sinks._otel_spans import DETECTION_SPAN

    monkeypatch.setattr(_otlp_backoff, "BACKOFF_FIRST_S", 1.5)
    otlp_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    otlp_env.setenv("OTEL_METRICS_EXPORTER", "none")
    with OtlpReceiver(mode="refuse") as r:
        otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.http_endpoint)
        tp, _ = configure_from_env(0)
        tracer = tp.get_tracer("t")

        def export(name: str) -> None:
            tracer.start_span(name).end()
            tp.force_flush()

        try:
            export("first")
            refused = r.attempts["http"]
            assert refused >= 1  # tried and refused: a wait of 1.5 s begins
            export("second")
            export("third")
            assert r.attempts["http"] == refused  # dropped before they were encoded or sent
            export(DETECTION_SPAN)
            failed_at = time.monotonic()
            assert r.attempts["http"] > refused  # the detection's span is tried all the same
            r.set_mode("ok")
            export("fourth")  # the second failure in a row doubled the wait: dropped
            time.sleep(max(0.0, failed_at + 3.2 - time.monotonic()))
            export("after")  # the wait is over: it goes out
            assert [s["name"] for s in r.spans()] == ["after"]
        finally:
            shutdown_bounded([tp], 5)


def _thread_cpu() -> dict:
    """CPU seconds of each thread of this process so far, by native thread id (Linux /proc)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread CPU times from Linux /proc")
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_black_hole_collector_takes_no_cpu_from_training_on_a_loaded_machine(otlp_env, protocol):
    """A collector that accepts and never answers, every core busy with other processes: steps of
    a model whose OtelTelemetry exports there against steps of one whose OtelTelemetry has SDK
    providers without exporters (the same sink work, no export), taking turns; and the CPU the
    process's other threads (span processor, metric reader, gRPC's threads, the probe) used
    meanwhile against the training thread's."""
    import subprocess
    import statistics
    import sys
    import threading

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from _blackhole import BlackHole

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    # One intra-op thread: with as many as cores, any runnable thread (another process's as much
    # as an exporter's) stalls torch's parallel regions, so the ratio would measure the machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with BlackHole() as bh:
            otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", bh.endpoint)
            otlp_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
            tp, mp = configure_from_env(0)
            hole = OtelTelemetry(tp, mp, shutdown_on_close=True)
            quiet = OtelTelemetry(TracerProvider(), MeterProvider())
            a, b, x = _pair()
            kw = dict(on_detect="report", trace_batches=range(0, 10_000, 3))  # spans queued all along
            try:
                with watch(a, sinks=[hole], **kw), watch(b, sinks=[quiet], **kw):
                    interleaved_medians(_step(a, x), _step(b, x), rounds=20)  # warm-up: the first exports
                    before = _thread_cpu()
                    ratios = [interleaved_medians(_step(a, x), _step(b, x), rounds=60)[2] for _ in range(7)]
                    after = _thread_cpu()
                    names = {t.native_id: t.name for t in threading.enumerate()}
            finally:
                hole.close()
            assert bh.accepted > 0  # the exporters really reached the black hole
    finally:
        torch.set_num_threads(threads)
        for p in busy:
            p.kill()
            p.wait()
    used = {tid: t - before.get(tid, 0.0) for tid, t in after.items()}
    training = used.pop(threading.main_thread().native_id)
    # the exporters' threads: every other one but the sinks' span workers (both sides have one)
    # and the black hole's; gRPC's own threads are not Python threads and have no name here
    exporting = {names.get(tid, f"native {tid}"): t for tid, t in used.items()
                 if names.get(tid) not in ("tensorwatch-otel-spans", "blackhole")}
    assert statistics.median(ratios) <= 1.3, ratios
    # before the backoff: the span processor's thread alone about 7% (it encoded every batch)
    assert sum(exporting.values()) <= 0.05 * training, (exporting, training)


@pytest.mark.waits  # (in-process: beside the other timing tests, tests/conftest.py)
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


@pytest.mark.waits  # (in-process: beside the other timing tests, tests/conftest.py)
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
