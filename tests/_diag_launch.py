"""Helpers for the diagnostics tests: launching `nettest` under a real torchrun, and a tiny OTLP/HTTP receiver."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Dict, List, Optional

from conftest import free_port


@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    wall_s: float


def clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "TENSORWATCH_", "NCCL_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                                 "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that crashes shows every thread's Python stack
    env.update(extra or {})
    return env


def torchrun(nproc: int, args: List[str], env: Optional[Dict[str, str]] = None, timeout: float = 120) -> Run:
    """`python -m torch.distributed.run --nproc_per_node N -m tensorwatch_otel nettest ARGS` on 127.0.0.1."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "tensorwatch_otel", "nettest", *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(env), timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


class OtlpReceiver:
    """Accepts OTLP/HTTP protobuf posts on 127.0.0.1 and keeps the decoded requests."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.traces: List[ExportTraceServiceRequest] = []
        self.metrics: List[ExportMetricsServiceRequest] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path == "/v1/traces":
                    msg = ExportTraceServiceRequest()
                    msg.ParseFromString(body)
                    receiver.traces.append(msg)
                elif self.path == "/v1/metrics":
                    msg = ExportMetricsServiceRequest()
                    msg.ParseFromString(body)
                    receiver.metrics.append(msg)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "OtlpReceiver":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def spans(self) -> list:
        return [s for req in self.traces for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def gauge_points(self, name: str) -> list:
        return [p for req in self.metrics for rm in req.resource_metrics for sm in rm.scope_metrics
                for m in sm.metrics if m.name == name for p in m.gauge.data_points]


def attrs(kvs) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for kv in kvs:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which)
    return out
