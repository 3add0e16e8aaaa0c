"""PrometheusMetrics: per-module tensor statistics and inf/nan detections as Prometheus series.

A custom collector builds the series at scrape time, on the HTTP server's thread, from the
window of batches the training thread folds into (see _aggregate.Window). After a detection the
endpoint waits for one more scrape at close or exit (see _prometheus_linger.ScrapeLinger).
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import socket
import threading
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prometheus_client.samples import Exemplar

from ..core import env as _env
from ..core.events import (NonFiniteEvent, SamplingRateEvent, SkippedNonFiniteStepEvent, SkippedStepEvent,
                           SkipStreakEvent, StoppedByRankEvent, label_for_module)
from ..core.frame_stats import BatchStats
from ..core.rank import current_rank
from ._aggregate import ModuleFilter, Patterns, Snapshot, Window, window_seconds
from ._base import SamplingTally, Sink, StepTally, utf8_text
from ._detail import DetailPolicy, detail_ranks_setting, detail_setting, summary_families
from ._options import number_option
from ._prometheus_linger import ScrapeLinger
from .catalogue import BY_KEY

__all__ = ["PrometheusMetrics", "DEFAULT_MAX_SERIES", "DEFAULT_LINGER_S"]

# Counter exemplars (the detection's trace_id) need prometheus-client >= 0.22; older: no exemplar.
_COUNTER_EXEMPLARS = "exemplar" in inspect.signature(CounterMetricFamily.add_metric).parameters

log = logging.getLogger(__name__)

#: Most (module, tensor) pairs exported per gauge; beyond it pairs are dropped and counted.
DEFAULT_MAX_SERIES = 10_000
#: After a detection, how long the process waits at exit (or close) for one more scrape.
DEFAULT_LINGER_S = 30.0
ENV_MAX_SERIES = _env.ENV_PROMETHEUS_MAX_SERIES
ENV_LINGER = _env.ENV_PROMETHEUS_LINGER_SECONDS
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


def _encodable(families: List[Metric]) -> List[Metric]:
    """Label values that UTF-8 cannot encode (a module named with a lone surrogate) fail the
    whole page with HTTP 500; such a value is written as its backslash escape instead."""
    for m in families:
        if not all(v.isascii() for s in m.samples for v in s.labels.values()):
            m.samples = [s._replace(labels={k: utf8_text(v) for k, v in s.labels.items()}) for s in m.samples]
    return families


_Key = Tuple[str, str, str, int, int]  # module label, class, tensor, rank, first rank


class _Detections:
    """The detection counters' series: inf/nan detections (each with the trace id and time of
    its last one) and stops by another rank's detection, by labels; whether this rank detected.
    Written under the sink's lock."""

    def __init__(self):
        self.detected = False  # this rank detected inf/nan: serve every per-module series
        # (module, class, tensor, rank, first_rank) -> [count, trace id, time of the last detection]
        self._nonfinite: Dict[_Key, list] = {}
        self._stopped: Dict[_Key, int] = {}  # StoppedByRankEvents, same key

    def nonfinite(self, event: NonFiniteEvent) -> None:
        self.detected = True
        entry = self._nonfinite.setdefault(self._key(event), [0, None, None])
        entry[0] += 1
        if event.trace_id:
            entry[1], entry[2] = event.trace_id, event.time

    def stopped(self, event: StoppedByRankEvent) -> None:
        key = self._key(event)
        self._stopped[key] = self._stopped.get(key, 0) + 1

    def counts(self) -> Tuple[List[Tuple[_Key, list]], List[Tuple[_Key, int]]]:
        """Copies of the nonfinite and stopped_by_rank counts (the caller holds the lock)."""
        return [(k, list(v)) for k, v in self._nonfinite.items()], list(self._stopped.items())

    @staticmethod
    def _key(event: Union[NonFiniteEvent, StoppedByRankEvent]) -> _Key:
        """The detection counters' labels: module (`(root)` for the root), class, tensor, rank, first rank."""
        place, first = event.place, event.first_rank
        return (label_for_module(place.module), place.module_class, place.tensor, event.rank,
                event.rank if first is None else first)


class _TensorwatchCollector(Collector):
    def __init__(self, sink: "PrometheusMetrics"):
        self._sink = sink

    def describe(self) -> Iterable[Metric]:
        # Names only, so registering never materialises a batch.
        return self._sink.describe_families()

    def collect(self) -> Iterable[Metric]:
        return self._sink.collect_families()


class PrometheusMetrics(Sink):
    """Exports the ``tensorwatch_*`` series: tensor gauges hold the extremes over the batches of
    the last ``window_s`` seconds, so a one-batch spike between two scrapes is still seen.

    - ``port``: serve ``/metrics`` on ``addr`` (127.0.0.1), at ``port + LOCAL_RANK``; ``port=0``
      picks a free one (``.port``). A taken port is logged once and training goes on. A bad
      ``port``, ``addr`` or ``registry`` raises ``ValueError`` naming it and leaves nothing behind.
    - ``registry``: the ``CollectorRegistry`` to register into (default: prometheus_client's
      global one, so an existing ``start_http_server`` exposes the series too).
    - ``include``/``exclude``: glob patterns on module paths (the root is ``(root)``).
    - ``max_series`` (TENSORWATCH_PROMETHEUS_MAX_SERIES, 10000): (module, tensor) pairs per gauge.
    - ``linger_s`` (TENSORWATCH_PROMETHEUS_LINGER_SECONDS, 30): after a detection, serve at exit
      until one scrape happened, at most this long. A SIGTERM (preemption) or Ctrl-C ends it.
    - ``window_s`` (TENSORWATCH_METRICS_WINDOW_SECONDS, 60): seconds of batches the gauges cover.
    - ``detail`` (TENSORWATCH_PROMETHEUS_DETAIL, ``all``): per-module series served: ``all``,
      ``summary`` (per-rank series only) or ``top:K`` (the K pairs with the largest range used);
      ``detail_ranks`` (TENSORWATCH_PROMETHEUS_DETAIL_RANKS): ranks that serve all. A rank that
      detected inf/nan serves all from then on. See docs/at-scale.md.
    - The nonfinite counter carries the detection's ``trace_id`` as an OpenMetrics exemplar.
    - ``tensorwatch_measure_every_n_batches``: one batch in this many is measured; with
      ``watch(max_overhead=...)`` also ``tensorwatch_overhead_ratio``, the watcher's measured share
      of the step time.
    See docs/telemetry.md for each.
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
        window_s: Optional[float] = None,
        detail: Union[str, int, None] = None,
        detail_ranks: Union[str, Iterable[int], None] = None,
    ):
        self.max_series = number_option("max_series", max_series, ENV_MAX_SERIES, DEFAULT_MAX_SERIES,
                                        minimum=1, integer=True)
        # finite: no wait at exit takes an endless timeout
        linger_s = number_option("linger_s", linger_s, ENV_LINGER, DEFAULT_LINGER_S, minimum=0.0)
        self.detail = detail_setting(detail)
        self.detail_ranks = detail_ranks_setting(detail_ranks)
        self._policy = DetailPolicy(self.detail, self.detail_ranks)
        self._default_rank = current_rank()  # a bad RANK fails here, naming it

        # The tensor gauges: extremes over the batches of the last window_s seconds.
        self._window = Window(ModuleFilter(include, exclude), self.max_series, window_seconds(window_s),
                              "Prometheus")
        self._detections = _Detections()
        self._steps = StepTally(self._default_rank)  # skipped optimizer steps, streaks, loss scale
        self._sampling = SamplingTally()  # the interval between measured batches, the measured overhead
        self._lock = threading.Lock()
        # after a detection: the wait for a scrape at close or exit, and the SIGTERM that ends it
        self._linger = ScrapeLinger(self._lock, linger_s)
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
    @property
    def linger_s(self) -> float:
        """After a detection, seconds to wait at close or exit for a scrape."""
        return self._linger.linger_s

    @linger_s.setter
    def linger_s(self, seconds: float) -> None:  # (settable after construction, as before)
        self._linger.linger_s = seconds

    @property
    def window_s(self) -> float:
        """Seconds of batches the tensor gauges cover (0: the last watched batch)."""
        return self._window.window_s

    def on_batch(self, stats: BatchStats) -> None:
        self._window.add(stats)
        self._steps.on_batch(stats)
        with self._lock:
            self._sampling.on_batch(stats)
        if self._linger.want_sigterm:  # a detection came on another thread (backward on a GPU)
            self._note_sigterm()

    # the event types it counts (Sink.on_event calls handle_<event type>)
    def handle_skipped_nonfinite_step(self, event: SkippedNonFiniteStepEvent) -> None:
        with self._lock:
            self._steps.nonfinite += 1

    def handle_optimizer_step_skipped(self, event: SkippedStepEvent) -> None:
        with self._lock:
            self._steps.on_skip(event, False)

    def handle_skipped_steps_streak(self, event: SkipStreakEvent) -> None:
        with self._lock:
            self._steps.on_skip(event, True)
            self._linger.detection()  # may precede the exception that ends the run: linger for it
        self._note_sigterm()

    def handle_sampling_rate(self, event: SamplingRateEvent) -> None:
        with self._lock:
            self._sampling.on_rate(event)  # the gauge follows the watcher now, not at its next measured batch

    def handle_nonfinite_detected(self, event: NonFiniteEvent) -> None:
        with self._lock:
            self._detections.nonfinite(event)
            self._linger.detection()  # let the next scrape see it
        self._note_sigterm()

    def handle_stopped_by_rank(self, event: StoppedByRankEvent) -> None:
        with self._lock:
            self._detections.stopped(event)
            self._linger.detection()  # this rank stops now: let the next scrape see it
        self._note_sigterm()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is None:
            self._unregister()
            return
        if self._linger.pending():
            self._note_sigterm()
            if self._linger.sigterm:  # preempted: the grace period is the application's, not ours
                self._linger.log_sigterm(False, self.url)
                self._stop()
                return
            # Let Prometheus see the detection before the endpoint goes away, off this thread.
            threading.Thread(target=self._linger_then_stop, name="tensorwatch-prometheus-linger",
                             daemon=True).start()
        else:
            self._stop()

    # -- linger -------------------------------------------------------------------------
    def wait_for_scrape(self, timeout_s: float) -> bool:
        """Blocks until a scrape after the last detection, at most timeout_s, and no longer once
        a SIGTERM came through the application's handler; True if a scrape came."""
        return self._linger.wait(timeout_s)

    def _linger_then_stop(self) -> None:
        self.wait_for_scrape(self.linger_s)
        if self._linger.sigterm:
            self._linger.log_sigterm(True, self.url)
        self._stop()

    def _at_exit(self) -> None:
        if self._server is not None and self._linger.pending():
            self._note_sigterm()  # a SIGTERM now (the scheduler's, after the run ended) ends the wait
            if self._linger.sigterm:
                self._linger.log_sigterm(False, self.url)
                self._stop()
                return
            log.warning("tensorwatch_otel: waiting up to %.0f s for Prometheus to scrape the inf/nan "
                        "detection from %s (%s=0 skips this, Ctrl-C ends the wait%s)",
                        self.linger_s, self.url, ENV_LINGER,
                        ", SIGTERM ends the wait" if self._linger.chained else "")
            try:
                if not self.wait_for_scrape(self.linger_s) and not self._linger.sigterm:
                    log.warning("tensorwatch_otel: no scrape within %.0f s; the detection is in the "
                                "logs and other sinks only", self.linger_s)
            except KeyboardInterrupt:  # the user chose not to wait: no traceback from an exit hook
                log.warning("tensorwatch_otel: wait for a scrape ended by Ctrl-C; the detection is in "
                            "the logs and other sinks only")
            except SystemExit:  # the application's signal handler (SIGTERM: sys.exit(143)), run through ours
                if not self._linger.sigterm:
                    log.warning("tensorwatch_otel: wait for a scrape ended by a signal; the detection is "
                                "in the logs and other sinks only")
            if self._linger.sigterm:
                self._linger.log_sigterm(True, self.url)
        self._stop()

    # -- SIGTERM ------------------------------------------------------------------------
    def _note_sigterm(self) -> None:
        """While a detection waits for a scrape, chain the application's SIGTERM handler (see
        ScrapeLinger.note_sigterm); only while /metrics is served."""
        self._linger.note_sigterm(self._server is not None)

    def sigterm_received(self) -> None:
        """A preemption's grace period has begun: no linger starts or goes on (a plain store)."""
        self._linger.sigterm_received()

    def _stop(self) -> None:
        self._linger.unnote_sigterm()
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
    def describe_families(self) -> List[Metric]:
        """Every family's name and type, without samples (a registry's describe: never a batch)."""
        return self._families(None, self._default_rank)

    def collect_families(self) -> Iterator[Metric]:
        self._linger.scraped()
        snap = self._window.snapshot()
        rank = snap.rank if snap is not None else self._default_rank
        return iter(_encodable(self._families(snap, rank)))

    def _families(self, snap: Optional[Snapshot], rank: int) -> List[Metric]:
        r = str(rank)
        f = _family
        amax, amin, used = f("abs_max"), f("abs_min"), f("range_used")
        under, over = f("underflow"), f("overflow")
        nonfinite, stopped_f = f("nonfinite"), f("stopped_by_rank")
        batches_f, number, dropped_f = f("batches"), f("batch_number"), f("series_dropped")
        skipped_f, scale_f, streaks_f, streak_f = f("steps_skipped"), f("grad_scale"), f("skip_streaks"), \
            f("skip_streak")
        nonfinite_skips_f = f("skipped_nonfinite")
        every_f, overhead_f = f("measure_every"), f("overhead")
        batches = 0
        rows, cutoff, hidden = ((), 0.0, 0) if snap is None else \
            self._policy.select(snap.rows, rank, self._detections.detected)
        if snap is not None:
            for module, cls, tensor, dtype, lo, hi, ru, shares in rows:
                labels = (module, cls, tensor, r)
                amax.add_metric(labels, hi)
                amin.add_metric(labels, lo)
                if ru is not None:
                    used.add_metric((module, cls, tensor, dtype, r), ru)
                for target, u, o in shares:
                    if u is not None:
                        under.add_metric((module, cls, tensor, target, r), u)
                    if o is not None:
                        over.add_metric((module, cls, tensor, target, r), o)
            dropped_f.add_metric((r,), snap.dropped)
            number.add_metric((r,), snap.batch_number)
            batches = snap.batches
        batches_f.add_metric((r,), batches)
        with self._lock:
            steps = self._steps
            skipped, streaks, streak, scale = steps.skipped, steps.streaks, steps.streak, steps.scale
            nonfinite_skips = steps.nonfinite
            every, overhead = self._sampling.every_n_batches, self._sampling.overhead
            counts, stopped = self._detections.counts()
        skipped_f.add_metric((r,), skipped)
        streaks_f.add_metric((r,), streaks)
        nonfinite_skips_f.add_metric((r,), nonfinite_skips)
        if streak is not None:
            streak_f.add_metric((r,), streak[0])
        if scale is not None:
            scale_f.add_metric((r,), scale)
        if every is not None:
            every_f.add_metric((r,), every)
        if overhead is not None:
            overhead_f.add_metric((r,), overhead)
        for (module, cls, tensor, ev_rank, first), (n, trace_id, t) in counts:
            labels = (module, cls, tensor, str(ev_rank), str(first))
            if trace_id is not None and _COUNTER_EXEMPLARS:
                nonfinite.add_metric(labels, n, exemplar=Exemplar({"trace_id": trace_id}, 1.0, t))
            else:
                nonfinite.add_metric(labels, n)
        for (module, cls, tensor, ev_rank, first), n in stopped:
            stopped_f.add_metric((module, cls, tensor, str(ev_rank), str(first)), n)
        return [amax, amin, used, under, over, nonfinite, stopped_f, batches_f, number, dropped_f, skipped_f,
                scale_f, streaks_f, streak_f, nonfinite_skips_f, every_f, overhead_f] + \
            summary_families(None if snap is None else snap.rows, r, cutoff, hidden)


def _family(key: str) -> Metric:
    """The catalogue's family for `key`, empty."""
    s = BY_KEY[key]
    cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
    return cls(s.prom, s.help, labels=s.labels)
