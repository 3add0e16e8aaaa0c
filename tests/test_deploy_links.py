"""The links in the alerts' annotations, on a real Prometheus: with the external labels of
deploy/README.md "Links in alerts" set, `runbook_url` is an absolute link to the runbook and
`jaeger_search` searches the configured Jaeger for the configured service."""

from __future__ import annotations

import shutil
import time
import urllib.parse
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from _otel_fixtures import OverflowNet
from prom_server import PrometheusServer
from tensorwatch_otel import watch
from tensorwatch_otel.sinks import PrometheusMetrics

# mostly waiting (a server's interval, a timeout): scripts/test.sh runs the tests marked `waits`
# beside the CPU-bound parallel pass, in a process of their own
pytestmark = pytest.mark.waits

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "rules" / "tensorwatch.yml"
DOCS = "https://git.example.org/ml/tensorwatch-otel/-/blob/main"


class _Labelled(PrometheusServer):
    def config(self):
        cfg = super().config()
        cfg["global"]["external_labels"] = {"tensorwatch_docs_url": DOCS, "jaeger_url": "https://jaeger.example.org",
                                            "jaeger_service": "llm pretrain"}
        return cfg


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed")
def test_alert_links_come_from_external_labels(tmp_path):
    sink = PrometheusMetrics(port=0, registry=CollectorRegistry(), linger_s=0)
    model = OverflowNet()
    try:
        with watch(model, sinks=[sink], on_detect="report"):
            model(torch.randn(2, 8))
            model.boom.factor = 1e39
            model(torch.randn(2, 8))
        with _Labelled(tmp_path, scrape_targets=[f"127.0.0.1:{sink.port}"], rule_files=[RULES]) as prom:
            deadline = time.monotonic() + 60
            while True:
                alerts = [a for a in prom.alerts() if a["labels"]["alertname"] == "TensorwatchNonFinite"]
                if alerts or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    finally:
        sink.close()
    [alert] = alerts
    ann = alert["annotations"]
    assert ann["runbook_url"] == DOCS + "/deploy/README.md#tensorwatchnonfinite"
    assert ann["runbook"] == "deploy/README.md#tensorwatchnonfinite (tensorwatch-otel repository)"
    url = urllib.parse.urlsplit(ann["jaeger_search"])
    query = urllib.parse.parse_qs(url.query)
    assert (url.scheme, url.netloc, url.path) == ("https", "jaeger.example.org", "/search")
    assert query["service"] == ["llm pretrain"] and query["operation"] == ["tensorwatch.nonfinite_detected"]
    assert '"tensorwatch.module.path":"boom"' in query["tags"][0]
