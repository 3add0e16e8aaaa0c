"""PrometheusMetrics: per-module tensor statistics and inf/nan detections as Prometheus series.

A custom collector reads the latest batch at scrape time, on the HTTP server's thread; the
training thread only swaps one reference per batch.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core import env as _env
from ..core.events import BatchStats, Event, NonFiniteEvent, label_for_module
from ._aggregate import Key, ModuleFilter, Patterns, aggregate
from ._base import Sink

__all__ = ["PrometheusMetrics", "DEFAULT_MAX_SERIES", "DEFAULT_LINGER_S"]

log = logging.getLogger(__name__)

#: Most (module, tensor) pairs exported per gauge; beyond it pairs are dropped and counted.
DEFAULT_MAX_SERIES = 10_000
#: After a detection, how long the process waits at exit (or close) for one more scrape.
DEFAULT_LINGER_S = 30.0
ENV_MAX_SERIES = _env.ENV_PROMETHEUS_MAX_SERIES
ENV_LINGER = _env.ENV_PROMETHEUS_LINGER_SECONDS
# Time left for the HTTP response to reach Prometheus after the collector produced it.
_RESPONSE_GRACE_S = 0.5



def _env_number(name: str, arg: str, value, default, cast, minimum):
    """Argument, then environment variable, then default; a clear error names the option."""
    source = arg
    if value is None:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return default
        value, source = raw, name
    try:
        number = cast(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not number >= minimum:
        raise ValueError(f"{source}={value!r}: expected a number >= {minimum}")
    return number


_MAX_PORT = 65535


def _check_port(port) -> Optional[int]:
    """None, or a TCP port number 0..65535 (an int or a string of digits)."""
    if port is None:
        return None
    number = None
    if isinstance(port, int) and not isinstance(port, bool):
        number = port
    elif isinstance(port, str) and port.strip().isdigit():
        number = int(port)
    if number is None or not 0 <= number <= _MAX_PORT:
        raise ValueError(f"port={port!r}: expected a TCP port number 0..{_MAX_PORT} (0 picks a free one) "
                         "or None (no HTTP server)")
    return number


def _check_addr(addr) -> str:
    if not isinstance(addr, str) or not addr.strip():
        raise ValueError(f"addr={addr!r}: expected the address to listen on, e.g. '127.0.0.1' or '0.0.0.0'")
    return addr.strip()


def _check_registry(registry):
    if not all(callable(getattr(registry, m, None)) for m in ("register", "unregister", "collect")):
        raise ValueError(f"registry={registry!r}: expected a prometheus_client CollectorRegistry or None "
                         "(the global one)")
    return registry


class _Snapshot:
    """Aggregated rows of one batch: one entry per (module, tensor), built at scrape time."""

    __slots__ = ("stats", "entries", "dropped")

    def __init__(self, stats: BatchStats, entries: Dict[Key, list], dropped: int):
        self.stats = stats
        self.entries = entries
        self.dropped = dropped


class _TensorwatchCollector(Collector):
    def __init__(self, sink: "PrometheusMetrics"):
        self._sink = sink

    def describe(self) -> Iterable[Metric]:
        # Names only, so registering never materialises a batch.
        return self._sink._families(None, self._sink._default_rank, 0)

    def collect(self) -> Iterable[Metric]:
        return self._sink._collect()


class PrometheusMetrics(Sink):
    """Exports the CONTRACT's ``tensorwatch_*`` series for the last watched batch.

    - ``port``: serve ``/metrics`` there on ``addr`` (127.0.0.1 by default). When ``LOCAL_RANK``
      is set each process serves ``port + LOCAL_RANK``. ``port=0`` picks a free port (see
      ``.port``). A port already taken is logged once as an error and training goes on.
      A port outside 0..65535 (LOCAL_RANK included), an ``addr`` that is no address and a
      ``registry`` that is no registry raise ``ValueError`` naming the argument, and leave
      nothing behind (no collector registered, no server thread).
    - ``registry``: the ``CollectorRegistry`` to register into (default: prometheus_client's
      global one, so an existing ``start_http_server`` exposes the series too).
    - ``include``/``exclude``: glob patterns on module paths (the root is ``(root)``).
    - ``max_series``: most (module, tensor) pairs per gauge (env TENSORWATCH_PROMETHEUS_MAX_SERIES,
      default 10000); a note is logged once when the cap bites and
      ``tensorwatch_series_dropped`` counts the pairs left out.
    - ``linger_s``: after a detection, keep serving at exit/close until one scrape happened,
      at most this long (env TENSORWATCH_PROMETHEUS_LINGER_SECONDS, default 30; 0 disables).
    """

    wants_batches = True

    def __init__(
        self,
        port: Optional[int] = None,
        addr: str = "127.0.0.1",
        registry: Optional[CollectorRegistry] = None,
        *,
        include: Patterns = None,
        exclude: Patterns = None,
        max_series: Optional[int] = None,
        linger_s: Optional[float] = None,
    ):
        self.max_series = _env_number(ENV_MAX_SERIES, "max_series", max_series, DEFAULT_MAX_SERIES, int, 1)
        self.linger_s = _env_number(ENV_LINGER, "linger_s", linger_s, DEFAULT_LINGER_S, float, 0.0)
        self._wanted = ModuleFilter(include, exclude)
        self._default_rank = int(os.environ.get("RANK", "0") or 0)

        # (latest stats, watched batches so far): one tuple swapped at once, so a scrape sees
        # one whole batch and the count that goes with it.
        self._state: Tuple[Optional[BatchStats], int] = (None, 0)
        self._snapshot: Optional[_Snapshot] = None
        self._nonfinite: Dict[Tuple[str, str, str, int], int] = {}
        self._lock = threading.Lock()
        self._scraped = threading.Condition(self._lock)
        self._scrapes = 0
        self._unscraped_detection = False
        self._cap_logged = False
        self._closed = False

        # Every argument is checked before anything is registered or bound, and a failure after
        # that undoes it, so a corrected PrometheusMetrics in the same process starts clean.
        port = _check_port(port)
        addr = _check_addr(addr)
        self.registry = REGISTRY if registry is None else _check_registry(registry)
        self._collector = _TensorwatchCollector(self)
        self._registered = False
        self.port: Optional[int] = None
        self.addr = addr
        self._server = None
        self._server_thread: Optional[threading.Thread] = None
        try:
            try:
                self.registry.register(self._collector)
                self._registered = True
            except ValueError as exc:  # names already taken by another PrometheusMetrics
                log.error("tensorwatch_otel: PrometheusMetrics could not register its series: %s; "
                          "close the other PrometheusMetrics first or pass registry=", exc)
            if port is not None:
                self._serve(port, addr)
        except BaseException:
            self._closed = True
            self._stop()
            raise

    # -- serving ------------------------------------------------------------------------
    def _serve(self, base_port: int, addr: str) -> None:
        local_rank = os.environ.get("LOCAL_RANK", "").strip()
        port = base_port
        if local_rank and base_port != 0:
            try:
                port = base_port + int(local_rank)
            except ValueError:
                log.error("tensorwatch_otel: LOCAL_RANK=%r is not an integer; serving on %d",
                          local_rank, base_port)
        if port > _MAX_PORT:
            raise ValueError(f"port={base_port} plus LOCAL_RANK={local_rank} is {port}: expected a TCP "
                             f"port number 0..{_MAX_PORT}")
        try:
            self._server, self._server_thread = start_http_server(port, addr=addr, registry=self.registry)
        except socket.gaierror as exc:
            raise ValueError(f"addr={addr!r}: not an address to listen on ({exc})") from None
        except OSError as exc:
            log.error("tensorwatch_otel: cannot serve Prometheus metrics on %s:%d (%s); training "
                      "goes on without the /metrics endpoint. Choose a free port "
                      "(TENSORWATCH_PROMETHEUS_PORT or PrometheusMetrics(port=...)).", addr, port, exc)
            return
        self.port = self._server.server_address[1]
        atexit.register(self._at_exit)
        log.info("tensorwatch_otel: Prometheus metrics at http://%s:%d/metrics", addr, self.port)

    @property
    def url(self) -> Optional[str]:
        return None if self.port is None else f"http://{self.addr}:{self.port}/metrics"

    # -- sink port ----------------------------------------------------------------------
    def on_batch(self, stats: BatchStats) -> None:
        self._state = (stats, self._state[1] + 1)

    def on_event(self, event: Event) -> None:
        if not isinstance(event, NonFiniteEvent):
            return
        key = (label_for_module(event.module), event.module_class, event.tensor, event.rank)
        with self._lock:
            self._nonfinite[key] = self._nonfinite.get(key, 0) + 1
            self._unscraped_detection = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is None:
            self._unregister()
            return
        if self._pending_scrape():
            # Let Prometheus see the detection before the endpoint goes away, off this thread.
            threading.Thread(target=self._linger_then_stop, name="tensorwatch-prometheus-linger",
                             daemon=True).start()
        else:
            self._stop()

    # -- linger -------------------------------------------------------------------------
    def _pending_scrape(self) -> bool:
        return self._unscraped_detection and self.linger_s > 0

    def wait_for_scrape(self, timeout_s: float) -> bool:
        """Blocks until a scrape after the last detection, at most timeout_s; True if one came."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._unscraped_detection:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._scraped.wait(left)
        time.sleep(_RESPONSE_GRACE_S)
        return True

    def _linger_then_stop(self) -> None:
        self.wait_for_scrape(self.linger_s)
        self._stop()

    def _at_exit(self) -> None:
        if self._server is not None and self._pending_scrape():
            log.warning("tensorwatch_otel: waiting up to %.0f s for Prometheus to scrape the inf/nan "
                        "detection from %s (%s=0 skips this)", self.linger_s, self.url, ENV_LINGER)
            if not self.wait_for_scrape(self.linger_s):
                log.warning("tensorwatch_otel: no scrape within %.0f s; the detection is in the "
                            "logs and other sinks only", self.linger_s)
        self._stop()

    def _stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            try:
                server.shutdown()
                server.server_close()
            except Exception as exc:
                log.debug("tensorwatch_otel: stopping the metrics server: %s", exc)
        self._unregister()

    def _unregister(self) -> None:
        if self._registered:
            self._registered = False
            try:
                self.registry.unregister(self._collector)
            except KeyError:
                pass

    # -- collection (scrape thread) -------------------------------------------------------
    def _build(self, stats: BatchStats) -> _Snapshot:
        cap = self.max_series
        entries, dropped = aggregate(stats, self._wanted, cap)
        if dropped and not self._cap_logged:
            self._cap_logged = True
            log.warning("tensorwatch_otel: Prometheus series cap reached: %d (module, tensor) pairs "
                        "of batch %d not exported (max_series=%d). Narrow with include=/exclude= or "
                        "raise %s.", dropped, stats.batch_number, cap, ENV_MAX_SERIES)
        return _Snapshot(stats, entries, dropped)

    def _collect(self) -> Iterator[Metric]:
        with self._lock:
            self._scrapes += 1
            self._unscraped_detection = False
            self._scraped.notify_all()
        stats, batches = self._state
        snap = self._snapshot
        if stats is not None and (snap is None or snap.stats is not stats):
            snap = self._build(stats)
            self._snapshot = snap  # reused by later scrapes of the same batch
        rank = stats.rank if stats is not None else self._default_rank
        return iter(self._families(snap, rank, batches))

    def _families(self, snap: Optional[_Snapshot], rank: int, batches: int) -> List[Metric]:
        r = str(rank)
        amax = GaugeMetricFamily("tensorwatch_tensor_abs_max",
                                 "Largest absolute value of the tensor in the last watched batch",
                                 labels=("module", "module_class", "tensor", "rank"))
        amin = GaugeMetricFamily("tensorwatch_tensor_abs_min",
                                 "Smallest absolute value of the tensor in the last watched batch",
                                 labels=("module", "module_class", "tensor", "rank"))
        used = GaugeMetricFamily("tensorwatch_tensor_range_used_ratio",
                                 "abs max divided by the largest finite value of the tensor's dtype",
                                 labels=("module", "module_class", "tensor", "dtype", "rank"))
        nonfinite = CounterMetricFamily("tensorwatch_nonfinite_events",
                                        "inf/nan detections, labelled with the first module and tensor "
                                        "where one appeared", labels=("module", "module_class", "tensor", "rank"))
        batches_f = CounterMetricFamily("tensorwatch_batches", "Watched batches", labels=("rank",))
        number = GaugeMetricFamily("tensorwatch_batch_number", "Number of the last watched batch (0-based)",
                                   labels=("rank",))
        dropped_f = GaugeMetricFamily("tensorwatch_series_dropped",
                                      "(module, tensor) pairs of the last batch left out by max_series",
                                      labels=("rank",))
        if snap is not None:
            for (module, tensor), (cls, dtype, lo, hi, ru) in snap.entries.items():
                labels = (module, cls, tensor, r)
                amax.add_metric(labels, hi)
                amin.add_metric(labels, lo)
                if ru is not None:
                    used.add_metric((module, cls, tensor, dtype, r), ru)
            dropped_f.add_metric((r,), snap.dropped)
            number.add_metric((r,), snap.stats.batch_number)
        batches_f.add_metric((r,), batches)
        with self._lock:
            counts = list(self._nonfinite.items())
        for (module, cls, tensor, ev_rank), n in counts:
            nonfinite.add_metric((module, cls, tensor, str(ev_rank)), n)
        return [amax, amin, used, nonfinite, batches_f, number, dropped_f]
