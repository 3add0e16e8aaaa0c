"""deploy/ end to end on this machine: a real training run with an injected fp16 overflow,
scraped by a real Prometheus running the shipped rules, alerting through a real Alertmanager
with the shipped routing to a webhook receiver in this test; then every dashboard query."""

from __future__ import annotations

import copy
import http.server
import importlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

yaml = pytest.importorskip("yaml")

from prom_server import AlertmanagerServer, PrometheusServer  # noqa: E402
from conftest import free_port  # noqa: E402
from test_deploy_static import DEFAULT_VARIABLES, prometheus_queries  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # waits: see tests/test_deploy_static.py

# The overflow batch: early enough to keep the test short, late enough that Prometheus has
# scraped healthy batches first (so rate()/range panels have history before the inf).
STEPS, OVERFLOW_AT = 40, 25
SERVE_SECONDS = 60  # the demo outlives the test; the fixture terminates it
ALERT_TIMEOUT = 45.0


def _require_demo() -> None:
    """Skip only while the pieces this test drives do not exist yet."""
    for mod in ("tensorwatch_otel.cli.demo", "tensorwatch_otel.sinks.prometheus"):
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            pytest.skip(f"{mod} not importable yet: {exc}")
    for tool in ("prometheus", "prometheus-alertmanager"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed")


class _Webhook:
    """A tiny Alertmanager webhook receiver on 127.0.0.1: keeps each POST with its arrival time."""

    def __init__(self) -> None:
        self.received: List[Tuple[float, Dict[str, Any]]] = []
        self._cond = threading.Condition()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                arrived = time.time()
                self.send_response(200)
                self.end_headers()
                with outer._cond:
                    outer.received.append((arrived, json.loads(body)))
                    outer._cond.notify_all()

            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/alerts"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "_Webhook":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def wait_for_alert(self, alertname: str, status: str, timeout: float) -> Tuple[float, Dict[str, Any]]:
        """(arrival time, alert) of the first alert with this name and status."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for arrived, payload in self.received:
                    for alert in payload.get("alerts", []):
                        if alert["labels"].get("alertname") == alertname and alert["status"] == status:
                            return arrived, alert
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {status} {alertname} at the webhook after {timeout:.0f}s; "
                                         f"received: {json.dumps(self.received)[:3000]}")
                self._cond.wait(left)


def _alertmanager_config(webhook_url: str) -> str:
    """The shipped alertmanager.yml with only the webhook URL pointed at this test."""
    cfg = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    for receiver in cfg["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = webhook_url
    return yaml.safe_dump(cfg)


def _rank_scrape_config(tmp_path: Path, demo_port: int) -> Dict[str, Any]:
    """The shipped `tensorwatch` scrape job (intervals and all), its file_sd pointed at a
    targets file in the shipped format naming the demo's port."""
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = copy.deepcopy(next(j for j in prom["scrape_configs"] if j["job_name"] == "tensorwatch"))
    example = yaml.safe_load((DEPLOY / "prometheus" / "targets" / "tensorwatch-ranks.yml").read_text())
    example[0]["targets"] = [f"127.0.0.1:{demo_port}"]
    targets = tmp_path / "targets.yml"
    targets.write_text(yaml.safe_dump(example))
    job["file_sd_configs"] = [{"files": [str(targets)], "refresh_interval": "5s"}]
    return job


def _detection(jsonl: Path) -> Optional[Dict[str, Any]]:
    if not jsonl.exists():
        return None
    for line in jsonl.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:  # a line still being written
            continue
        if event.get("event") == "nonfinite_detected":
            return event
    return None


def _timestamp(rfc3339: str) -> float:
    """Seconds since the epoch from an RFC 3339 time (Python 3.9+ friendly: no 'Z', <= 6 digits)."""
    text = rfc3339.replace("Z", "+00:00")
    head, sep, rest = text.partition(".")
    if sep:  # Alertmanager writes nanoseconds; fromisoformat takes at most microseconds
        digits = len(rest) - len(rest.lstrip("0123456789"))
        text = f"{head}.{rest[:min(digits, 6)]}{rest[digits:]}"
    return datetime.fromisoformat(text).timestamp()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def demo_run(tmp_path):
    """Start `python -m tensorwatch_otel demo` with an overflow; yields (port, jsonl, proc, log)."""
    _require_demo()
    port = free_port()
    jsonl = tmp_path / "events.jsonl"
    log = tmp_path / "demo.log"
    argv = [sys.executable, "-m", "tensorwatch_otel", "demo", "--steps", str(STEPS),
            "--overflow-at-batch", str(OVERFLOW_AT), "--prometheus-port", str(port),
            "--serve-seconds", str(SERVE_SECONDS), "--jsonl", str(jsonl), "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)  # no collector here: keep the run on one path
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    # The precision panels (underflow/overflow shares) need target dtypes; watch() reads them here.
    env["TENSORWATCH_TARGET_DTYPES"] = "float8_e4m3fn,float16"
    # The watcher-cost panel's share needs a budget; one this large keeps every batch measured.
    env["TENSORWATCH_MAX_OVERHEAD"] = "0.9"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=tmp_path, env=env)
    try:
        yield port, jsonl, proc, log
    finally:
        _stop(proc)


def test_first_inf_pages_through_the_shipped_stack(tmp_path, demo_run, record_property):
    port, jsonl, proc, log = demo_run
    with _Webhook() as hook, \
            AlertmanagerServer(tmp_path, _alertmanager_config(hook.url)) as am, \
            PrometheusServer(tmp_path, rule_files=sorted((DEPLOY / "prometheus" / "rules").glob("*.yml")),
                             alertmanager_url=am.url,
                             extra_scrape_configs=[_rank_scrape_config(tmp_path, port)]) as prom:
        def context() -> str:
            return (f"\ndemo exit={proc.poll()} log tail:\n{log.read_text(errors='replace')[-3000:]}"
                    f"\ntargets: {json.dumps(prom.targets())[:1500]}")

        try:
            arrived, alert = hook.wait_for_alert("TensorwatchNonFinite", "firing", ALERT_TIMEOUT)
        except AssertionError as exc:
            raise AssertionError(str(exc) + context()) from None

        event = _detection(jsonl)
        assert event is not None, "the demo raised no nonfinite_detected event" + context()
        labels = alert["labels"]
        # The page names exactly what the detector found: module, tensor and rank of the first
        # non-finite frame, plus the routing labels.
        assert labels["module"] == (event["module"] or "(root)"), (labels, event["module"])
        assert labels["module_class"] == event["module_class"]
        assert labels["tensor"] == event["tensor"]
        assert labels["rank"] == str(event["rank"]) == "0"
        assert labels["severity"] == "page"
        assert labels["job"] == "tensorwatch"
        assert "tensorwatch.nonfinite_detected" in alert["annotations"]["jaeger_search"]
        assert event["module"] in alert["annotations"]["summary"]
        # The demo injects its overflow into blocks.1.mlp.fc1 (see `demo --help`).
        assert labels["module"].startswith("blocks.1.mlp"), labels

        detected = _timestamp(event["time"])
        delay = arrived - detected
        # startsAt is when Prometheus' rule first saw the series (scrape + evaluation); the rest
        # is Alertmanager (group_wait) and delivery.
        to_rule = _timestamp(alert["startsAt"]) - detected
        record_property("alert_delay_s", round(delay, 2))
        sys.stderr.write(f"\nTensorwatchNonFinite reached the webhook {delay:.2f}s after detection "
                         f"(rule active after {to_rule:.2f}s)\n")
        # Budget: scrape 5s + rule group 5s + group_wait 1s + slack.
        assert 0 <= delay < 15, delay

        # The dashboard, fed by this run: every Prometheus query returns data.
        dash = json.loads((DEPLOY / "grafana" / "dashboards" / "tensorwatch.json").read_text())
        variables = dict(DEFAULT_VARIABLES, job="tensorwatch", rank="0", __rate_interval="30s")
        failures = []
        for where, promql in prometheus_queries(dash, variables):
            try:
                # rate() over 30s needs two scrapes of the run; allow those few seconds.
                prom.wait_for(promql, timeout=12)
            except AssertionError as exc:
                failures.append(f"{where}: {promql}\n  {str(exc).splitlines()[0]}")
        assert not failures, "dashboard queries without data:\n" + "\n".join(failures)
