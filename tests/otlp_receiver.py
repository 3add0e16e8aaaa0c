"""A real OTLP receiver for tests: gRPC TraceService/MetricsService (the servicers generated in
opentelemetry-proto) and an HTTP server for POST /v1/traces and /v1/metrics protobuf bodies,
on 127.0.0.1 free ports. It keeps the decoded requests, and can be told to stall or refuse."""

from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def any_value(v) -> Any:
    """An OTLP AnyValue as a Python value (arrays as lists)."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def attrs(kvs) -> Dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


class OtlpReceiver:
    """Context manager. ``grpc_endpoint`` ("http://127.0.0.1:P") and ``http_endpoint``
    ("http://127.0.0.1:Q", the base the exporters append /v1/traces to).

    ``grpc_port``: the gRPC port to bind (default: a free one; raises when taken).
    ``mode``: "ok" (accept), "stall" (hold each request until ``release()`` or ``stall_s``),
    "refuse" (gRPC UNAVAILABLE / HTTP 503). Change it at any time with ``set_mode``.
    """

    def __init__(self, mode: str = "ok", stall_s: float = 60.0, grpc_port: int = 0):
        self.mode = mode
        self.stall_s = stall_s
        self._released = threading.Event()
        self._cond = threading.Condition()
        self.trace_requests: List[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metric_requests: List[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.calls: Dict[str, int] = {"grpc": 0, "http": 0}  # requests accepted
        self.attempts: Dict[str, int] = {"grpc": 0, "http": 0}  # requests received, refused ones too
        self._grpc: Optional[grpc.Server] = None
        self._http: Optional[ThreadingHTTPServer] = None
        self.grpc_port = grpc_port  # 0: a free one
        self.http_port = 0

    # -- control ----------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        self.mode = mode
        if mode != "stall":
            self._released.set()
        else:
            self._released.clear()

    def release(self) -> None:
        self._released.set()

    def _gate(self, transport: str) -> bool:
        """True to accept the request; stalls first in stall mode."""
        with self._cond:
            self.attempts[transport] += 1
        if self.mode == "stall":
            self._released.wait(self.stall_s)
        return self.mode != "refuse"

    def _store(self, transport: str, req) -> None:
        with self._cond:
            self.calls[transport] += 1
            if isinstance(req, trace_service_pb2.ExportTraceServiceRequest):
                self.trace_requests.append(req)
            else:
                self.metric_requests.append(req)
            self._cond.notify_all()

    # -- decoded views -------------------------------------------------------------------------
    def spans(self) -> List[Dict[str, Any]]:
        """Every received span as a dict: name, attributes, events, status, resource, scope."""
        out = []
        with self._cond:
            reqs = list(self.trace_requests)
        for req in reqs:
            for rs in req.resource_spans:
                res = attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        out.append({
                            "name": sp.name, "attributes": attrs(sp.attributes),
                            "events": [{"name": e.name, "time": e.time_unix_nano, "attributes": attrs(e.attributes)}
                                       for e in sp.events],
                            "status_code": sp.status.code, "status_message": sp.status.message,
                            "resource": res, "scope": (ss.scope.name, ss.scope.version),
                            "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                            "parent_span_id": sp.parent_span_id.hex(),
                        })
        return out

    def metrics(self) -> List[Dict[str, Any]]:
        """Every received data point: metric name, unit, kind, value, attributes, resource, scope."""
        out = []
        with self._cond:
            reqs = list(self.metric_requests)
        for req in reqs:
            for rm in req.resource_metrics:
                res = attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        for dp in getattr(m, kind).data_points:
                            value = dp.as_double if dp.WhichOneof("value") == "as_double" else dp.as_int
                            out.append({"name": m.name, "unit": m.unit, "kind": kind, "value": value,
                                        "attributes": attrs(dp.attributes), "resource": res,
                                        "scope": (sm.scope.name, sm.scope.version)})
        return out

    def wait_for(self, what: Callable[["OtlpReceiver"], Any], timeout: float = 20.0) -> Any:
        """Polls what(self) until it returns something truthy; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            got = what(self)
            if got:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"OTLP receiver: nothing matching after {timeout:.0f}s; calls={self.calls}, "
                                     f"span names={sorted({s['name'] for s in self.spans()})}, "
                                     f"metric names={sorted({m['name'] for m in self.metrics()})}")
            with self._cond:
                self._cond.wait(min(left, 0.2))

    # -- servers ---------------------------------------------------------------------------------
    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> "OtlpReceiver":
        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                if not receiver._gate("grpc"):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "refused by test")
                receiver._store("grpc", request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                if not receiver._gate("grpc"):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "refused by test")
                receiver._store("grpc", request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
        self.grpc_port = server.add_insecure_port(f"127.0.0.1:{self.grpc_port}")
        server.start()
        self._grpc = server

        routes = {
            "/v1/traces": (trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse),
            "/v1/metrics": (metrics_service_pb2.ExportMetricsServiceRequest,
                            metrics_service_pb2.ExportMetricsServiceResponse),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                route = routes.get(self.path)
                if route is None:
                    self.send_error(404)
                    return
                if not receiver._gate("http"):
                    self.send_error(503, "refused by test")
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = route[0]()
                req.ParseFromString(body)
                receiver._store("http", req)
                payload = route[1]().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):  # keep test output quiet
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()
        return self

    def stop(self) -> None:
        self._released.set()
        if self._grpc is not None:
            self._grpc.stop(grace=0)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def __enter__(self) -> "OtlpReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
