"""Step-time overhead of the exporters on the T5-shaped step of bench_step.py, and the time a
scrape (and an OpenTelemetry collection) takes on a model with 2,000+ modules.

Variants, interleaved round by round in one process, each as a ratio to the unwatched step of
the same round: the watcher with no sink, with PrometheusMetrics served on 127.0.0.1 and
scraped by a thread every --scrape-interval seconds, and with OtelTelemetry whose metrics are
collected and OTLP-encoded every --otel-interval seconds (the encoding is the real exporter's;
the bytes go nowhere). Both intervals are far shorter than production defaults (15 s / 60 s)
on purpose: a stress, not a best case.

The tensor gauges cover a window of batches, so every watched batch is folded into it on the
training thread: the big-model figures include that fold (PrometheusMetrics.on_batch on the
watcher's record) as a share of the watched forward that produced the record.

    python benchmarks/bench_sinks.py                # the issue's figures (a few minutes on 2 cores)
    python benchmarks/bench_sinks.py --quick        # seconds (smoke test)
    python benchmarks/bench_sinks.py --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import Trainer, build_model, run_rounds  # noqa: E402


class _Scraper:
    """GETs url every interval seconds on a daemon thread; keeps the durations."""

    def __init__(self, url: str, interval: float):
        self.url, self.interval = url, interval
        self.durations: List[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.interval):
            t = time.perf_counter()
            urllib.request.urlopen(self.url, timeout=10).read()
            self.durations.append(time.perf_counter() - t)

    def stop(self):
        self._stop.set()
        self._thread.join()


def _otel_meter_provider(interval_ms: int):
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader

    class EncodeOnly(MetricExporter):
        """The OTLP exporter's work up to the socket: encode to protobuf bytes."""

        def __init__(self):
            super().__init__()
            self.sizes: List[int] = []

        def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
            self.sizes.append(len(encode_metrics(metrics_data).SerializeToString()))
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
            pass

    exporter = EncodeOnly()
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)
    return MeterProvider(metric_readers=[reader], shutdown_on_exit=False), exporter


def make_variants(base, ids, labels, args) -> Dict[str, Callable[[int], List[float]]]:
    import tensorwatch_otel as tw
    from prometheus_client import CollectorRegistry

    from tensorwatch_otel.sinks import OtelTelemetry, PrometheusMetrics

    shared = Trainer(copy.deepcopy(base), ids, labels)

    def plain(n):
        return [shared.step() for _ in range(n)]

    def watched(make_sinks):
        def run(n):
            sinks, done = make_sinks()
            try:
                with tw.watch(shared.model, sinks=sinks, on_detect="report"):
                    return [shared.step() for _ in range(n)]
            finally:
                done()
        return run

    def prometheus():
        sink = PrometheusMetrics(port=0, registry=CollectorRegistry(), linger_s=0)
        scraper = _Scraper(sink.url, args.scrape_interval)

        def done():
            scraper.stop()
            sink.close()
        return [sink], done

    def otel():
        mp, exporter = _otel_meter_provider(int(args.otel_interval * 1000))
        sink = OtelTelemetry(meter_provider=mp)

        def done():
            mp.shutdown()
        return [sink], done

    return {"unwatched": plain, "watch": watched(lambda: ([], lambda: None)),
            "prometheus": watched(prometheus), "otel_metrics": watched(otel)}


def scrape_big_model(n_modules: int, scrapes: int) -> Dict[str, float]:
    """A real model with n_modules Linear layers, one watched forward, then timed scrapes and
    OpenTelemetry collections of its statistics."""
    import tensorwatch_otel as tw
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from prometheus_client import CollectorRegistry, generate_latest

    from tensorwatch_otel.sinks import OtelTelemetry, PrometheusMetrics

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n_modules)])
    reg = CollectorRegistry()
    prom = PrometheusMetrics(registry=reg, linger_s=0)
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    otel = OtelTelemetry(meter_provider=mp, max_series=100_000)
    from tensorwatch_otel.sinks import Sink

    class Keep(Sink):
        wants_batches = True

        def __init__(self):
            self.batches = []

        def on_batch(self, stats):
            self.batches.append(stats)

    keep = Keep()
    forwards = []
    x = torch.randn(4, 8)
    with torch.no_grad(), tw.watch(model, sinks=[prom, otel, keep], on_detect="report"):
        for _ in range(3):
            t = time.perf_counter()
            model(x)
            forwards.append(time.perf_counter() - t)
    # the fold alone, on a sink of its own, for each record (after the first: layout learnt)
    fold_sink = PrometheusMetrics(registry=CollectorRegistry(), linger_s=0)
    folds = []
    for st in keep.batches * 4:
        t = time.perf_counter()
        fold_sink.on_batch(st)
        folds.append(time.perf_counter() - t)
    fold_sink.close()
    t = time.perf_counter()
    body = generate_latest(reg)
    first = time.perf_counter() - t
    times = []
    for _ in range(scrapes):
        t = time.perf_counter()
        generate_latest(reg)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    reader.get_metrics_data()
    otel_first = time.perf_counter() - t
    otel_times = []
    for _ in range(max(1, scrapes // 2)):
        t = time.perf_counter()
        reader.get_metrics_data()
        otel_times.append(time.perf_counter() - t)
    prom.close()
    mp.shutdown()
    return {"modules": n_modules + 1, "series": body.count(b"\n") - body.count(b"\n#"),
            "watched_forward_s": statistics.median(forwards), "fold_first_s": folds[0],
            "fold_median_s": statistics.median(folds[1:]),
            "bytes": len(body), "scrape_first_s": first, "scrape_median_s": statistics.median(times),
            "scrape_max_s": max(times), "otel_collect_first_s": otel_first,
            "otel_collect_median_s": statistics.median(otel_times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, few rounds (smoke test)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes (default 1)")
    p.add_argument("--otel-interval", type=float, default=1.0, help="seconds between OTel collections (default 1)")
    p.add_argument("--big-modules", type=int, default=2048, help="Linear layers of the scrape model (default 2048)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.steps, args.big_modules = min(args.rounds, 2), min(args.steps, 2), min(args.big_modules, 300)

    big = scrape_big_model(args.big_modules, scrapes=5 if args.quick else 11)
    print(f"scrape of a {big['modules']}-module model: {big['series']} series, {big['bytes'] / 1e6:.1f} MB; "
          f"first {big['scrape_first_s'] * 1000:.0f} ms, median {big['scrape_median_s'] * 1000:.0f} ms, "
          f"max {big['scrape_max_s'] * 1000:.0f} ms; OTel collection first "
          f"{big['otel_collect_first_s'] * 1000:.0f} ms, median {big['otel_collect_median_s'] * 1000:.0f} ms")
    print(f"window fold per batch (training thread): median {big['fold_median_s'] * 1e3:.2f} ms = "
          f"{big['fold_median_s'] / big['watched_forward_s'] * 100:.2f}% of the watched forward "
          f"({big['watched_forward_s'] * 1e3:.0f} ms); first batch of a layout {big['fold_first_s'] * 1e3:.0f} ms")

    base, ids, labels = build_model(args.quick)
    n_modules = sum(1 for _ in base.named_modules())
    variants = make_variants(base, ids, labels, args)
    print(f"model: T5-shaped, {n_modules} modules, batch {tuple(ids.shape)}, {torch.get_num_threads()} threads",
          file=sys.stderr)
    for run in variants.values():
        run(args.warmup)
    result = {"model_modules": n_modules, "batch": list(ids.shape), "rounds": args.rounds,
              "scrape_interval_s": args.scrape_interval, "otel_interval_s": args.otel_interval,
              "big_model_scrape": big, "variants": run_rounds(variants, args.rounds, args.steps)}
    w = result["variants"]["watch"]["ratio_median"]
    for name in ("prometheus", "otel_metrics"):
        print(f"{name} / watch: {result['variants'][name]['ratio_median'] / w:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
