"""What a hung collector or a lingering metrics endpoint costs at a detection and at exit: an
OTLP endpoint that accepts connections and never answers (a black hole) adds at most
flush_timeout_s, in-process, at interpreter exit and under `opentelemetry-instrument`; Ctrl-C
ends the Prometheus linger at once, without a traceback."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from _blackhole import BlackHole
from _otel_fixtures import OverflowNet, parse_prom, sample
from tensorwatch_otel import NonFiniteDetected, watch

pytestmark = pytest.mark.timing  # wall-clock bounds: run alone, after the parallel tests (scripts/test.sh)

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
T = 1.5  # flush_timeout_s of these tests
SLACK = 1.0  # thread start-up and a loaded machine


@pytest.fixture
def otlp_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "TENSORWATCH_")):
            monkeypatch.delenv(k)
    return monkeypatch


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), OMP_NUM_THREADS="1", **extra)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_detection_leaves_the_with_block_within_flush_timeout(otlp_env, protocol):
    with BlackHole() as bh:
        otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", bh.endpoint)
        otlp_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        model, x = OverflowNet(), torch.randn(2, 8)
        took = None
        with pytest.raises(NonFiniteDetected):
            with watch(model, flush_timeout_s=T, trace_batches=[0]):  # sinks=None: OTLP from the env
                model(x)
                model.boom.factor = 1e39
                t0 = time.perf_counter()
                try:
                    model(x)
                finally:
                    took = time.perf_counter() - t0  # the detection's own flush
        left = time.perf_counter() - t0  # ... and detach(): flush and shutdown of the providers
        assert bh.accepted > 0  # the exporter really reached the black hole
    assert T - 0.2 <= took <= T + SLACK, took
    assert left <= T + SLACK, (took, left)


_CLEAN_RUN = textwrap.dedent("""
    import sys, time, torch
    from _otel_fixtures import OverflowNet
    from tensorwatch_otel import watch
    model, x = OverflowNet(), torch.randn(2, 8)
    if sys.argv[1] == "watched":
        with watch(model, flush_timeout_s=float(sys.argv[2])):
            for _ in range(3):
                model(x)
            print("DETACH", time.time(), flush=True)
    else:
        for _ in range(3):
            model(x)
        print("DETACH", time.time(), flush=True)
""")


def _exit_seconds(mode: str, **env) -> float:
    """Seconds from the end of training (just before detach) to the process's end."""
    proc = subprocess.run([sys.executable, "-c", _CLEAN_RUN, mode, str(T)], env=_env(**env),
                          capture_output=True, text=True, timeout=120)
    end = time.time()
    assert proc.returncode == 0, proc.stderr[-2000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("DETACH")]
    return end - float(line.split()[1])


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_clean_exit_with_a_black_hole_collector_within_flush_timeout(protocol):
    with BlackHole() as bh:
        # each watched run side by side with an unwatched one (a core each): the pair shares the
        # machine's load, and the test waits for two rounds instead of four runs
        hung_env = dict(OTEL_EXPORTER_OTLP_ENDPOINT=bh.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL=protocol)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            rounds = [(pool.submit(_exit_seconds, "unwatched"), pool.submit(_exit_seconds, "watched", **hung_env))
                      for _ in range(2)]
            base, hung = [b.result() for b, _ in rounds], [h.result() for _, h in rounds]
        assert bh.accepted > 0
    assert min(hung) - min(base) <= T + SLACK, (hung, base)


@pytest.mark.slow
def test_clean_run_under_opentelemetry_instrument_with_a_black_hole():
    """The distro's providers export over gRPC to a hung collector: the watched run exits within
    flush_timeout_s of the same run with tensorwatch_otel's instrumentation turned off."""
    pytest.importorskip("opentelemetry.distro")
    pytest.importorskip("lightning")
    sys.path.insert(0, str(TESTS))
    from test_integrations_instrumentor import _instrument_command, _need_entry_point

    _need_entry_point()

    def run(disabled: bool, endpoint: str) -> float:
        """Seconds from the end of training (Lightning's "fit stopped" line) to the process's
        end: the same run's import and training times, which vary a lot on a loaded machine,
        are left out."""
        env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                   OTEL_LOGS_EXPORTER="none", OTEL_SERVICE_NAME="black-hole",
                   OUT_DIR=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tw-out-unused"),
                   TENSORWATCH_FLUSH_TIMEOUT_SECONDS=str(T))
        if disabled:
            env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = "tensorwatch_otel"
        proc = subprocess.Popen(_instrument_command() + [sys.executable, str(TESTS / "_zero_code_train.py"),
                                                          "lightning", "env"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=str(ROOT))  # opentelemetry-instrument puts the cwd first on PYTHONPATH
        stopped, out = None, []
        for line in proc.stdout:
            out.append(line)
            if "Trainer.fit` stopped" in line:
                stopped = time.perf_counter()
        proc.wait(timeout=300)
        end = time.perf_counter()
        assert proc.returncode == 0 and stopped is not None, "".join(out)[-3000:]
        return end - stopped

    with BlackHole() as bh:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # side by side, as above
            off_run, on_run = pool.submit(run, True, bh.endpoint), pool.submit(run, False, bh.endpoint)
            off, on = off_run.result(), on_run.result()
        assert bh.accepted > 0
    assert on - off <= T + 2 * SLACK, (on, off)  # before: about 30 s more


_LINGER = textwrap.dedent("""
    import logging, torch
    from prometheus_client import CollectorRegistry
    from _otel_fixtures import OverflowNet
    from tensorwatch_otel import watch
    from tensorwatch_otel.sinks import PrometheusMetrics
    logging.basicConfig(level=logging.WARNING)
    sink = PrometheusMetrics(port=0, registry=CollectorRegistry())  # linger_s from the environment
    model, x = OverflowNet(), torch.randn(2, 8)
    with watch(model, sinks=[sink], on_detect="report"):
        model(x)
        model.boom.factor = 1e39
        model(x)
    # the end of the script: the exit handler waits for a scrape that never comes
""")


@pytest.mark.waits  # (one process waiting in its linger, bounds of seconds: beside the other waiting tests)
def test_ctrl_c_ends_the_prometheus_linger_at_once_without_traceback():
    # (Ctrl-C as in a terminal: a suite started in the background by a non-interactive shell has
    # SIGINT ignored, which its children inherit, and Python then installs no KeyboardInterrupt)
    proc = subprocess.Popen([sys.executable, "-c", _LINGER], env=_env(TENSORWATCH_PROMETHEUS_LINGER_SECONDS="60"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    took, _, text = _signal_once(proc, "waiting up to 60 s for Prometheus", signal.SIGINT)
    assert took < 3.0, took
    assert "Traceback" not in text, text[-3000:]
    assert "ended by Ctrl-C" in text


# ---------------------------------------------------------------- preemption: SIGTERM
# SLURM and Kubernetes send SIGTERM and SIGKILL 30 s later (KillWait, terminationGracePeriodSeconds):
# a linger that outlives the grace period loses the application's own exit work to the SIGKILL.
_PREEMPTED = textwrap.dedent("""
    import logging, signal, sys, time, torch
    from prometheus_client import CollectorRegistry
    from _otel_fixtures import OverflowNet
    from tensorwatch_otel import watch
    from tensorwatch_otel.sinks import PrometheusMetrics
    logging.basicConfig(level=logging.WARNING)
    if sys.argv[1] == "handler":  # the application's preemption handler: exit with 128 + SIGTERM
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    sink = PrometheusMetrics(port=0, registry=CollectorRegistry())  # linger_s from the environment
    model, x = OverflowNet(), torch.randn(2, 8)
    with watch(model, sinks=[sink], on_detect="report"):
        model(x)
        model.boom.factor = 1e39
        model(x)  # detection 1
        print("PORT", sink.port, flush=True)
        sys.stdin.readline()  # the test scrapes detection 1
        model(x)  # detection 2: no scrape has seen it
        print("PENDING", flush=True)
        if sys.argv[2] == "training":
            model.boom.factor = 1.0
            while True:  # training goes on until the scheduler preempts it
                model(x)
                time.sleep(0.01)
    # sys.argv[2] == "exit": the end of the script; the exit handler waits for a scrape
""")


def _preempted(handler: str, when: str):
    """Runs _PREEMPTED until its second detection is pending; (process, port, stderr lines so far).
    Detection 1 is scraped on the way: the endpoint serves the detections as designed."""
    proc = subprocess.Popen([sys.executable, "-c", _PREEMPTED, handler, when],
                            env=_env(TENSORWATCH_PROMETHEUS_LINGER_SECONDS="60"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline().split()[1])
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert sample(parse_prom(body), "tensorwatch_nonfinite_events_total", module="boom",
                  module_class="Overflow", tensor="output", rank="0", first_rank="0") == 1
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "PENDING"
    return proc, port


def _signal_once(proc, wait_for: str = "", sig: int = signal.SIGTERM):
    """`sig` (once `wait_for` is on stderr); (seconds to the process's end, return code, stderr)."""
    err = []
    try:
        if wait_for:
            for line in proc.stderr:
                err.append(line)
                if wait_for in line:
                    break
            else:
                raise AssertionError("".join(err)[-3000:])
        time.sleep(0.3)
        t = time.perf_counter()
        proc.send_signal(sig)
        rest = proc.communicate(timeout=20)[1]
        took = time.perf_counter() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    return took, proc.returncode, "".join(err) + rest


@pytest.mark.slow
@pytest.mark.waits  # (as the Ctrl-C test)
def test_sigterm_with_the_applications_handler_ends_the_linger_during_training():
    proc, _ = _preempted("handler", "training")
    took, code, err = _signal_once(proc)
    assert took < 10, (took, err[-3000:])
    assert code == 143, err[-3000:]  # the application's handler ran and chose the status
    assert "Traceback" not in err, err[-3000:]
    assert "SIGTERM" in err and "not waiting for Prometheus" in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.waits
def test_sigterm_with_the_applications_handler_ends_the_exit_linger():
    proc, _ = _preempted("handler", "exit")
    took, code, err = _signal_once(proc, wait_for="waiting up to 60 s for Prometheus")
    assert took < 10, (took, err[-3000:])
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert "ended by SIGTERM" in err, err[-3000:]
    assert "SIGTERM ends the wait" in err  # the wait's own line says so


@pytest.mark.slow
@pytest.mark.waits
@pytest.mark.parametrize("when", ["training", "exit"])
def test_sigterm_without_a_handler_kills_at_once(when):
    """No handler: SIGTERM's default action ends the process there and then, linger or not."""
    proc, _ = _preempted("none", when)
    took, code, err = _signal_once(proc, wait_for="waiting up to 60 s" if when == "exit" else "")
    assert took < 5, (took, err[-3000:])
    assert code == -signal.SIGTERM, err[-3000:]
