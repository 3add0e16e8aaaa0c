"""`tensorwatch-otel demo` end to end in subprocesses: the injected fp16 overflow is detected at
the asked batch in the right module, the log renders with `report`, metrics are served."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tensorwatch_otel import NonFiniteEvent
from tensorwatch_otel.report.codec import read_events
from tensorwatch_otel.report.text import render_detection
from tensorwatch_otel.cli import main
from tensorwatch_otel.cli._demo_model import OVERFLOW_MODULE

from conftest import free_port

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TENSORWATCH_PROMETHEUS_LINGER_SECONDS": "0"}
for _name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "TENSORWATCH_JSONL",
              "TENSORWATCH_PROMETHEUS_PORT"):
    ENV.pop(_name, None)


def cli(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorwatch_otel", *args], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=timeout)


@pytest.mark.slow
def test_demo_detects_injected_overflow_at_batch_and_report_renders_it(tmp_path, capsys):
    log = tmp_path / "events.jsonl"
    t0 = time.monotonic()
    r = cli("demo", "--steps", "8", "--overflow-at-batch", "5", "--jsonl", str(log))
    wall = time.monotonic() - t0
    assert r.returncode == 3, r.stderr
    assert wall < 60

    events = read_events(str(log))
    detections = [e for e in events if isinstance(e, NonFiniteEvent)]
    assert len(detections) == 1
    ev = detections[0]
    assert (ev.batch_number, ev.module, ev.module_class, ev.tensor, ev.kind) == (
        5, OVERFLOW_MODULE, "Linear", "output", "inf")
    assert ev.frames[-1].module == OVERFLOW_MODULE and len(ev.frames) == 21
    # a real fp16 overflow: the layer's input and weight are finite, its float16 output is not
    stats = {t.name: t for t in ev.frames[-1].tensors}
    assert stats["output"].dtype == "float16" and stats["output"].abs_max == float("inf")
    assert stats["weight"].abs_max < 65504 and stats["input[0]"].abs_max < 100
    # by default the batch before the overflow and the overflow batch are traced
    assert sorted(e.batch_number for e in events if e.event == "batch_trace") == [4, 5]
    raw = [json.loads(line) for line in log.read_text().splitlines()]
    assert [d["event"] for d in raw] == ["batch_trace", "batch_trace", "nonfinite_detected"]

    # the printed report is the peer-format detection report, and `report` renders the log the same
    expected = render_detection(ev)
    assert expected in r.stdout
    capsys.readouterr()
    assert main(["report", str(log), "--event", "nonfinite_detected"]) == 0
    assert capsys.readouterr().out == expected

    # progress: one line per step that ran, the detection named on stderr, the log path printed
    steps = [line for line in r.stderr.splitlines() if line.startswith("step ")]
    assert len(steps) == 6 and "inf/nan detected" in steps[-1] and "batch   5" in steps[-1]
    assert f"inf detected in {OVERFLOW_MODULE} (Linear) output during batch_number=5" in r.stderr
    assert str(log) in r.stderr

    # and `diff` between the two traced batches names the module that overflowed
    assert main(["diff", f"{log}:4", f"{log}:5"]) == 1
    assert f"first divergence: {OVERFLOW_MODULE} (Linear)" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_without_overflow_exits_0_and_a_taken_port_does_not_stop_it(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("demo", "--steps", "6", "--trace", "2", "--prometheus-port", str(port), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"cannot serve Prometheus metrics on 127.0.0.1:{port}" in r.stderr  # logged, training went on
    log = tmp_path / "tensorwatch-demo-events.jsonl"  # the default path, in the current directory
    events = read_events(str(log))
    assert [(e.event, e.batch_number) for e in events] == [("batch_trace", 2)]
    assert "Detected inf/nan" not in r.stdout
    losses = [float(line.split("loss")[1].split()[0]) for line in r.stderr.splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0]


@pytest.mark.slow
def test_demo_serves_the_detection_to_prometheus(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorwatch_otel", "demo", "--steps", "6",
                             "--overflow-at-batch", "3", "--prometheus-port", str(port), "--serve-seconds", "20",
                             "--jsonl", str(tmp_path / "e.jsonl"), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    want = (f'tensorwatch_nonfinite_events_total{{first_rank="0",module="{OVERFLOW_MODULE}",'
            f'module_class="Linear",rank="0",tensor="output"}} 1.0')
    body = ""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                body = ""
            if want in body:
                break
            time.sleep(0.3)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert want in body, err
    assert 'tensorwatch_batch_number{rank="0"} 3.0' in body


@pytest.mark.parametrize("argv, message", [
    (["--steps", "5", "--overflow-at-batch", "5"], "--overflow-at-batch 5: expected a batch number from 0 to 4"),
    (["--overflow-at-batch", "-1"], "--overflow-at-batch -1"),
    (["--steps", "0"], "--steps 0: expected a number of steps >= 1"),
    (["--trace", "3,x"], "--trace '3,x': expected batch numbers separated by commas"),
    (["--prometheus-port", "70000"], "--prometheus-port 70000: expected a port number"),
    (["--serve-seconds", "-1"], "--serve-seconds -1.0"),
    (["--serve-seconds", "inf"], "--serve-seconds inf: expected a finite number of seconds >= 0"),
    (["--otlp-endpoint", "localhost:4318"], "expected a URL"),
])
def test_bad_options_exit_2_with_a_message(argv, message, tmp_path, capsys):
    log = tmp_path / "e.jsonl"
    assert main(["demo", *argv, "--jsonl", str(log)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not log.exists()  # nothing ran


def test_jsonl_that_is_a_directory_is_refused(tmp_path, capsys):
    assert main(["demo", "--jsonl", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_exports_the_detection_over_otlp(tmp_path):
    from otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        r = cli("demo", "--steps", "4", "--overflow-at-batch", "2", "--otlp-endpoint", receiver.http_endpoint,
                "--jsonl", str(tmp_path / "e.jsonl"), "--quiet")
        assert r.returncode == 3, r.stderr
        spans = receiver.wait_for(lambda rc: [s for s in rc.spans() if s["name"] == "tensorwatch.nonfinite_detected"])
    attrs = spans[0]["attributes"]
    assert (attrs["tensorwatch.module.path"], attrs["tensorwatch.tensor"], attrs["tensorwatch.batch_number"]) == (
        OVERFLOW_MODULE, "output", 2)
