"""Checks of the OTLP settings that otel_env builds exporters from: the endpoint is a URL, the
protocol follows the well-known gRPC port when none is set, and an export that fails because
protocol and port do not match (http/protobuf to a gRPC port, gRPC to an HTTP port) says so once,
at the latest when the exporters are shut down, so a short run prints it before it exits.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Set, Tuple
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from ._otlp_backoff import ExportBackoff

log = logging.getLogger(__name__)

#: Protocols the OTLP exporters speak; the OpenTelemetry specification's default is http/protobuf.
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "http/protobuf"
#: The IANA port of OTLP/gRPC: an endpoint on it with no protocol variable set is exported to over gRPC.
GRPC_PORT = 4317
HTTP_PORT = 4318
ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
#: The endpoint is probed when the first export starts, then after a failed export at most once
#: per this period until a mismatch is found.
PROBE_PERIOD_S = 60.0
PROBE_TIMEOUT_S = 1.0

_HOST = re.compile(r"[A-Za-z0-9._%:-]+")


class OtlpConfigError(ValueError):
    """An OTEL_* variable the exporters cannot work with; the message names it."""


@dataclass(frozen=True)
class Target:
    """Where one signal goes and how: the variables that said so, for messages."""

    signal: str
    endpoint_var: str
    endpoint: str
    host: str
    port: Optional[int]
    tls: bool
    protocol: str
    protocol_var: Optional[str]  # None: not set, chosen by default or by the port

    def describe_protocol(self) -> str:
        if self.protocol_var is not None:
            return f"{self.protocol_var} is {self.protocol}"
        return f"{ENV_PROTOCOL} is unset (so {self.protocol})"


def _signal_var(signal: str, what: str) -> str:
    return f"OTEL_EXPORTER_OTLP_{signal.upper()}_{what}"


def resolve(signal: str, env: Mapping[str, str]) -> Target:
    """The target of `signal` ("traces" or "metrics"), from the per-signal variables, then the
    generic ones. Raises OtlpConfigError naming the variable for an unsupported protocol or an
    endpoint that is not a URL."""
    endpoint_var = _signal_var(signal, "ENDPOINT")
    endpoint = env.get(endpoint_var, "").strip()
    if not endpoint:
        endpoint_var, endpoint = ENV_ENDPOINT, env.get(ENV_ENDPOINT, "").strip()
    protocol, protocol_var = None, None
    for name in (_signal_var(signal, "PROTOCOL"), ENV_PROTOCOL):
        value = env.get(name, "").strip().lower()
        if value:
            if value not in PROTOCOLS:
                raise OtlpConfigError(f"{name}={value!r} is not supported; use one of: {', '.join(PROTOCOLS)}")
            protocol, protocol_var = value, name
            break
    has_scheme = "://" in endpoint
    parts = urlsplit(endpoint if has_scheme else "http://" + endpoint)
    try:
        port = parts.port
    except ValueError:
        port, parts = None, None
    ok = (parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
          and _HOST.fullmatch(parts.hostname or "") is not None)
    if ok and protocol is None:
        protocol = "grpc" if port == GRPC_PORT else DEFAULT_PROTOCOL
    # The gRPC exporter also takes a bare host:port; the HTTP one needs the scheme.
    if not ok or (not has_scheme and protocol != "grpc"):
        raise OtlpConfigError(f"{endpoint_var}={endpoint!r} is not a URL: expected e.g. "
                              f"http://localhost:{HTTP_PORT} (OTLP/HTTP) or http://localhost:{GRPC_PORT} (OTLP/gRPC)")
    return Target(signal, endpoint_var, endpoint, parts.hostname, port, parts.scheme == "https",
                  protocol, protocol_var)


def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """What the server at host:port speaks: "http/1" (answers an HTTP/1.1 request with a status
    line), "http/2" (opens with an HTTP/2 SETTINGS frame, as gRPC servers do), or None (no
    answer, closed, or something else)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"GET / HTTP/1.1\r\nHost: " + host.encode("ascii", "replace") + b"\r\nConnection: close\r\n\r\n")
            data = b""
            deadline = time.monotonic() + timeout_s
            while len(data) < 9 and time.monotonic() < deadline:
                chunk = s.recv(64)
                if not chunk:
                    break
                data += chunk
    except (OSError, UnicodeError):
        return None
    if data.startswith(b"HTTP/1."):
        return "http/1"
    if len(data) >= 9 and data[3] == 0x04:  # frame header: length(3) type(1); 0x04 = SETTINGS
        return "http/2"
    return None


_reported: Set[Tuple[str, Optional[int], str]] = set()
_reported_lock = threading.Lock()  # guards _reported and _probes


class _Probe:
    """One probe of host:port on a daemon thread; `done` is set when `spoken` is known."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.started = time.monotonic()
        self.spoken: Optional[str] = None
        self.done = threading.Event()
        self._then: List[Callable[[], None]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="tensorwatch-otlp-probe", daemon=True).start()

    def _run(self) -> None:
        try:
            self.spoken = probe(self.host, self.port)
        finally:
            with self._lock:
                self.done.set()
                then, self._then = self._then, []
            for fn in then:
                fn()

    def then(self, fn: Callable[[], None]) -> None:
        """Calls fn once the result is known (now, when it already is)."""
        with self._lock:
            if not self.done.is_set():
                self._then.append(fn)
                return
        fn()


_probes: Dict[Tuple[str, int], _Probe] = {}


def _probe_for(host: str, port: int) -> _Probe:
    """The probe of host:port under way or made less than PROBE_PERIOD_S ago, else a new one:
    the traces and metrics exporters of one endpoint share it."""
    with _reported_lock:
        p = _probes.get((host, port))
        if p is None or (p.done.is_set() and time.monotonic() - p.started >= PROBE_PERIOD_S):
            p = _probes[(host, port)] = _Probe(host, port)
        return p


class MismatchCheck:
    """Logs one warning per process and (host, port, protocol) when exports fail because the
    server speaks the other protocol.

    The endpoint is probed (a plain HTTP/1.1 request on a connection of its own, off the exporter's
    thread) when the first export starts, and again after a failed export at most once per
    PROBE_PERIOD_S until a mismatch is found. The warning comes once an export failed, or at
    shutdown (settle()) while one is still under way: waiting for the exporter's own retries (up
    to its timeout) left a short run no time to say it, the process was gone first."""

    def __init__(self, target: Target):
        self.target = target
        self._done = target.tls or target.port is None  # TLS: the plaintext probe cannot tell
        self.mismatch: Optional[str] = None
        self._lock = threading.Lock()
        self._probe: Optional[_Probe] = None
        self._running = 0  # exports under way
        self._failed = False

    def export_started(self) -> None:
        with self._lock:
            self._running += 1
            first = self._probe is None and not self._done
        if first:
            self._start_probe()

    def export_ended(self, ok: bool) -> None:
        with self._lock:
            self._running -= 1
            if ok:  # the protocol works here: nothing to say, now or later
                self._done = True
                return
            if self._done:
                return
            self._failed = True
            p = self._probe
        if p is not None and p.done.is_set() and p.spoken is None:
            self._start_probe()  # the last probe heard nothing: ask again (rate limited)
        else:
            self._decide()

    def settle(self, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        """At shutdown: waits (at most timeout_s) for a probe under way, then warns if an export
        failed or is still under way against a port that speaks the other protocol."""
        p = self._probe
        if self._done or p is None:
            return
        p.done.wait(max(0.0, timeout_s))
        self._decide(at_shutdown=True)

    def _start_probe(self) -> None:
        t = self.target
        p = _probe_for(t.host, t.port)  # type: ignore[arg-type]
        with self._lock:
            self._probe = p
        p.then(self._decide)

    def _decide(self, at_shutdown: bool = False) -> None:
        with self._lock:
            p = self._probe
            if self._done or p is None or not p.done.is_set():
                return
            # A probe alone is no proof (a server may speak both on one port): an export must
            # have failed, or still be failing when the exporters shut down.
            if not (self._failed or (at_shutdown and self._running > 0)):
                return
            message = self._message(p.spoken)
            if message is None:
                return
            self.mismatch, self._done = message, True
        t = self.target
        key = (t.host, t.port, t.protocol)
        with _reported_lock:
            if key in _reported:
                return
            _reported.add(key)
        log.warning("%s", message)

    def _message(self, spoken: Optional[str]) -> Optional[str]:
        t = self.target
        if t.protocol == "grpc" and spoken == "http/1":
            return (f"tensorwatch_otel: OTLP {t.signal} export to {t.endpoint} ({t.endpoint_var}) failed: "
                    f"that port speaks HTTP/1.1 (OTLP/HTTP), not gRPC, and {t.describe_protocol()}; "
                    f"set {ENV_PROTOCOL}=http/protobuf, or use the collector's OTLP/gRPC port "
                    f"(usually {GRPC_PORT})")
        if t.protocol == "http/protobuf" and spoken == "http/2":
            return (f"tensorwatch_otel: OTLP {t.signal} export to {t.endpoint} ({t.endpoint_var}) failed: "
                    f"that port speaks gRPC (HTTP/2), not OTLP/HTTP, and {t.describe_protocol()}; "
                    f"set {ENV_PROTOCOL}=grpc, or use the collector's OTLP/HTTP port (usually {HTTP_PORT})")
        return None


def checked_span_exporter(inner: Any, check: MismatchCheck, backoff: Optional["ExportBackoff"] = None) -> Any:
    """`inner` (an OTLP SpanExporter) with the mismatch check and, when given, the backoff after
    a failed export: a batch holding a detection span is tried whatever the backoff says."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from ._otel_spans import DETECTION_SPAN

    class CheckedSpanExporter(SpanExporter):
        def export(self, spans):
            if backoff is not None and backoff.waiting() and not any(s.name == DETECTION_SPAN for s in spans):
                backoff.drop()
                return SpanExportResult.FAILURE
            result = SpanExportResult.FAILURE
            check.export_started()
            try:
                result = inner.export(spans)
                return result
            finally:
                ok = result is SpanExportResult.SUCCESS
                check.export_ended(ok)
                if backoff is not None:
                    backoff.record(ok)

        def shutdown(self):
            return inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return inner.force_flush(timeout_millis)

    exporter = CheckedSpanExporter()
    exporter.check = check  # type: ignore[attr-defined]  # settled at shutdown (otel_env)
    return exporter


def checked_metric_exporter(inner: Any, check: MismatchCheck) -> Any:
    """`inner` (an OTLP MetricExporter) with the mismatch check. No backoff here: a failing export
    holds the metric reader's thread for the exporter's timeout, which already spaces its
    collections out; returning at once would let it collect at every interval instead."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class CheckedMetricExporter(MetricExporter):
        def __init__(self):
            super().__init__(preferred_temporality=inner._preferred_temporality,
                             preferred_aggregation=inner._preferred_aggregation)

        def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
            result = MetricExportResult.FAILURE
            check.export_started()
            try:
                result = inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
                return result
            finally:
                check.export_ended(result is MetricExportResult.SUCCESS)

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return inner.force_flush(timeout_millis=timeout_millis)

        def shutdown(self, *args, **kwargs) -> None:
            return inner.shutdown(*args, **kwargs)

    exporter = CheckedMetricExporter()
    exporter.check = check  # type: ignore[attr-defined]  # settled at shutdown (otel_env)
    return exporter


def warn_well_known_port_mismatch(env: Mapping[str, str]) -> None:
    """For exporters that are not ours (opentelemetry-instrument's, whose distro sets
    OTEL_EXPORTER_OTLP_PROTOCOL=grpc): one warning per process and (host, port, protocol) when
    the protocol is the other one than the endpoint's well-known port speaks (gRPC to 4318,
    http/protobuf to 4317). Nothing is probed: those exports fail out of our sight."""
    for signal in ("traces", "metrics"):
        try:
            t = resolve(signal, env)
        except OtlpConfigError:
            continue
        if (t.protocol, t.port) == ("grpc", HTTP_PORT):
            fix = f"set {ENV_PROTOCOL}=http/protobuf, or use the collector's OTLP/gRPC port ({GRPC_PORT})"
        elif (t.protocol, t.port) == ("http/protobuf", GRPC_PORT):
            fix = f"set {ENV_PROTOCOL}=grpc, or use the collector's OTLP/HTTP port ({HTTP_PORT})"
        else:
            continue
        key = (t.host, t.port, t.protocol)
        with _reported_lock:
            if key in _reported:
                continue
            _reported.add(key)
        log.warning("tensorwatch_otel: OTLP %s to %s (%s) over %s: port %d is OTLP/%s's, so the export "
                    "fails (opentelemetry-instrument's distro defaults to grpc); %s", t.signal, t.endpoint,
                    t.endpoint_var, t.protocol, t.port, "HTTP" if t.port == HTTP_PORT else "gRPC", fix)
