"""The export side of the precision statistics (target_dtypes): the metric catalogue both sinks
build from, the underflow/overflow gauges of both sinks (windowed, detail modes, series cap), and
the tensorwatch.tensor.magnitude exponential histogram, checked in the SDK and at a real OTLP
receiver.

Records are built by hand here with the agreed interface of core/record.py (targets, underflow,
overflow, magnitude(k)); the watcher's end-to-end test lives with the measurement.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest

from _otel_fixtures import parse_prom, sample
from tensorwatch_otel.core.frame_stats import BatchStats
from tensorwatch_otel.core.frame_draft import FrameDraft, ModuleInfo
from tensorwatch_otel.core.precision_rows import PrecisionRows
from tensorwatch_otel.core.record import Record
from tensorwatch_otel.sinks import catalogue
from tensorwatch_otel.sinks.otel import OtelTelemetry
from tensorwatch_otel.sinks.prometheus import PrometheusMetrics

NAN = math.nan
TARGETS = ("float16", "float8_e4m3fn")


@dataclass(frozen=True)
class Mag:
    """The agreed Magnitude shape: counts[i] = values with |x| in (2**(offset+i), 2**(offset+i+1)]."""

    zeros: int
    offset: int
    counts: Tuple[int, ...]


class PrecisionRecord(Record):
    """A Record of `infos`, each with tensors weight and output (abs min 0.5, abs max 2.0, read
    back), with the agreed precision fields set by hand."""

    __slots__ = ("_given",)

    def __init__(self, batch_number, infos, targets=(), underflow=(), overflow=(), mags=()):
        super().__init__(batch_number)
        for info in infos:
            d = FrameDraft()
            d.add("weight", (0.5, 2.0), torch.float32)
            d.add("output", (0.5, 2.0), torch.float32)
            self.add_frame(info, d)
        self.readback()  # (host floats: read back as they are)
        self.targets = tuple(targets)
        if targets:
            self.precision = PrecisionRows(self.targets)
            self.precision.underflow = list(underflow)
            self.precision.overflow = list(overflow)
        self._given = list(mags)

    def magnitude(self, k: int):
        return self._given[k] if k < len(self._given) else None


def _info(path: str, cls: str = "Linear") -> ModuleInfo:
    return ModuleInfo(path, torch.nn.Identity(), is_root=not path, recorded=True, cls=cls, params={})


INFOS = [_info("fc1"), _info("fc2")]


def record(n: int, under: Sequence[Sequence[float]], over: Sequence[Sequence[float]],
           mags: Sequence[Optional[Mag]] = (), targets=TARGETS, infos=INFOS) -> PrecisionRecord:
    """Modules of `infos`, each with tensors weight and output (k = 2 * module + tensor);
    under[k][j] / over[k][j]: the share for target j."""
    return PrecisionRecord(n, infos, targets, [v for row in under for v in row], [v for row in over for v in row],
                           mags)


def stats(rec: Record) -> BatchStats:
    return BatchStats(rec.batch_number, 0, time.time(), rec)


def scrape(reg) -> dict:
    return parse_prom(generate_latest(reg).decode())


UNDER = [[0.0, 0.25], [0.5, 0.125], [NAN, NAN], [0.0, 0.75]]
OVER = [[0.0, 0.0], [0.0625, 0.0], [NAN, NAN], [0.0, 0.0]]


# -- the catalogue ------------------------------------------------------------------------------

def test_prometheus_families_are_the_catalogues():
    sink = PrometheusMetrics(registry=CollectorRegistry())
    try:
        families = {m.name: m for m in sink._families(None, 0)}
    finally:
        sink.close()
    served = {s.prom: s for s in catalogue.SERIES if s.prom}
    assert set(families) == set(served)
    for name, fam in families.items():
        s = served[name]
        assert fam.documentation == s.help and fam.type == s.kind, name
    assert {"tensorwatch_tensor_underflow_ratio", "tensorwatch_tensor_overflow_ratio"} <= set(families)


def test_otel_instruments_are_the_catalogues(otel):
    sink = otel.sink()
    sink.on_batch(stats(record(0, UNDER, OVER, [Mag(1, -2, (3,))] * 4)))
    data = otel.reader.get_metrics_data()
    metrics = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    wanted = {s.otel: s for s in catalogue.SERIES if s.otel}
    assert set(metrics) <= set(wanted)
    for name, m in metrics.items():
        assert m.description == wanted[name].help and (m.unit or "") == wanted[name].unit, name
    assert {"tensorwatch.tensor.underflow_ratio", "tensorwatch.tensor.overflow_ratio",
            "tensorwatch.tensor.magnitude"} <= set(metrics)
    sink.close()


def test_every_label_has_an_attribute_and_the_collector_path_relabels_it():
    import yaml
    from pathlib import Path

    cfg = yaml.safe_load((Path(__file__).resolve().parent.parent / "deploy/prometheus/prometheus.yml").read_text())
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "otel-collector")
    relabelled = {r["target_label"] for r in job["metric_relabel_configs"] if r.get("source_labels") !=
                  ["__name__"] and "target_label" in r}
    for s in catalogue.SERIES:
        if s.otel and s.prom and s.kind != "histogram":
            assert set(s.labels) <= relabelled, (s.key, set(s.labels) - relabelled)


def test_collector_names_are_relabelled_to_the_direct_names():
    """Through the collector, each instrument arrives under the name its exporter derives (dots
    to underscores, unit suffixes); prometheus.yml's __name__ rules must map it to the direct
    path's name, so the same rules and dashboards work for both paths."""
    import re

    import yaml
    from pathlib import Path

    cfg = yaml.safe_load((Path(__file__).resolve().parent.parent / "deploy/prometheus/prometheus.yml").read_text())
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "otel-collector")
    renames = [r for r in job["metric_relabel_configs"] if r.get("source_labels") == ["__name__"]]

    def relabel(name: str) -> str:
        for r in renames:
            m = re.fullmatch(r["regex"], name)
            if m:
                name = m.expand(r["replacement"].replace("$1", r"\1"))
        return name

    checked = 0
    for s in catalogue.SERIES:
        if s.otel and s.prom:
            assert relabel(catalogue.collector_name(s)) == s.prom_series, s.key
            checked += 1
    assert checked >= 12
    assert catalogue.collector_name(catalogue.BY_KEY["underflow"]) == "tensorwatch_tensor_underflow_ratio"


# -- Prometheus gauges ----------------------------------------------------------------------------

def test_prometheus_shares_per_target_and_not_applicable_left_out():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg)
    sink.on_batch(stats(record(0, UNDER, OVER)))
    p = scrape(reg)
    sink.close()
    u = "tensorwatch_tensor_underflow_ratio"
    labels = dict(module="fc1", module_class="Linear", tensor="output", rank="0")
    assert sample(p, u, target_dtype="float16", **labels) == 0.5
    assert sample(p, u, target_dtype="float8_e4m3fn", **labels) == 0.125
    assert sample(p, "tensorwatch_tensor_overflow_ratio", target_dtype="float16", **labels) == 0.0625
    assert sample(p, u, module="fc2", module_class="Linear", tensor="output", rank="0",
                  target_dtype="float8_e4m3fn") == 0.75
    # NaN: not applicable (fc2's weight) gives no series at all, never a 0 or a NaN sample
    assert not [k for k in p if k[0] == u and ("module", "fc2") in k[1] and ("tensor", "weight") in k[1]]
    assert sum(1 for k in p if k[0] == u) == 6


def test_prometheus_shares_are_the_worst_of_the_window():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg, window_s=60)
    sink.on_batch(stats(record(0, UNDER, OVER)))
    better = [[0.0, 0.0]] * 4
    sink.on_batch(stats(record(1, better, better)))
    p = scrape(reg)
    assert sample(p, "tensorwatch_tensor_underflow_ratio", module="fc1", module_class="Linear", tensor="output",
                  rank="0", target_dtype="float16") == 0.5
    sink.close()
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg, window_s=0)  # 0: the last batch only
    sink.on_batch(stats(record(0, UNDER, OVER)))
    sink.on_batch(stats(record(1, better, better)))
    p = scrape(reg)
    assert sample(p, "tensorwatch_tensor_underflow_ratio", module="fc1", module_class="Linear", tensor="output",
                  rank="0", target_dtype="float16") == 0.0
    sink.close()


def test_prometheus_shares_follow_detail_and_the_series_cap():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg, detail="summary")
    sink.on_batch(stats(record(0, UNDER, OVER)))
    p = scrape(reg)
    sink.close()
    assert not [k for k in p if k[0] == "tensorwatch_tensor_underflow_ratio"]
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg, max_series=1)
    sink.on_batch(stats(record(0, UNDER, OVER)))
    p = scrape(reg)
    sink.close()
    pairs = {(dict(k[1])["module"], dict(k[1])["tensor"]) for k in p if k[0] == "tensorwatch_tensor_underflow_ratio"}
    assert pairs == {("fc1", "weight")}


def test_records_without_targets_serve_no_share_series():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg)
    rec = record(0, [], [], targets=())
    sink.on_batch(stats(rec))
    p = scrape(reg)
    sink.close()
    assert sample(p, "tensorwatch_tensor_abs_max", module="fc1", module_class="Linear", tensor="output",
                  rank="0") == 2.0
    assert not [k for k in p if "flow_ratio" in k[0]]


# -- OpenTelemetry gauges and the magnitude histogram ---------------------------------------------

class Otel:
    def __init__(self):
        self.reader = InMemoryMetricReader()
        self.mp = MeterProvider(metric_readers=[self.reader], resource=Resource.create({"service.name": "t"}),
                                shutdown_on_exit=False)

    def sink(self, **kw) -> OtelTelemetry:
        return OtelTelemetry(None, self.mp, **kw)

    def metric(self, name):
        data = self.reader.get_metrics_data()
        found = [m for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics
                 for m in sm.metrics if m.name == name]
        return found[0] if found else None


@pytest.fixture
def otel():
    o = Otel()
    yield o
    o.mp.shutdown()


def _points(metric) -> Dict[Tuple, object]:
    return {(dp.attributes["tensorwatch.module.path"], dp.attributes["tensorwatch.tensor"],
             dp.attributes.get("tensorwatch.target_dtype")): dp for dp in metric.data.data_points}


def test_otel_share_gauges(otel):
    sink = otel.sink()
    sink.on_batch(stats(record(0, UNDER, OVER)))
    under = _points(otel.metric("tensorwatch.tensor.underflow_ratio"))
    over = _points(otel.metric("tensorwatch.tensor.overflow_ratio"))
    sink.close()
    assert under[("fc1", "output", "float16")].value == 0.5
    assert under[("fc1", "output", "float8_e4m3fn")].value == 0.125
    assert over[("fc1", "output", "float16")].value == 0.0625
    assert ("fc2", "weight", "float16") not in under and len(under) == 6


MAGS = [Mag(2, -3, (1, 0, 4)), Mag(0, 0, (5,)), None, Mag(7, 0, ())]


def test_otel_magnitude_histogram_accumulates_exact_buckets(otel):
    sink = otel.sink()
    sink.on_batch(stats(record(0, UNDER, OVER, MAGS)))
    otel.metric("tensorwatch.tensor.magnitude")  # a collection samples batch 0
    sink.on_batch(stats(record(1, UNDER, OVER, [Mag(1, -1, (2, 3))] + MAGS[1:])))
    m = otel.metric("tensorwatch.tensor.magnitude")
    sink.close()
    assert m is not None and m.unit == ""
    from opentelemetry.sdk.metrics.export import AggregationTemporality, ExponentialHistogram

    assert isinstance(m.data, ExponentialHistogram)
    assert m.data.aggregation_temporality == AggregationTemporality.CUMULATIVE
    pts = _points(m)
    w = pts[("fc1", "weight", None)]
    # batch 0: zeros 2, index -3:1, -1:4; batch 1: zeros 1, index -1:2, 0:3
    assert (w.scale, w.zero_count, w.positive.offset, list(w.positive.bucket_counts)) == (0, 3, -3, [1, 0, 6, 3])
    assert w.count == 3 + 1 + 6 + 3 and list(w.negative.bucket_counts) == []
    assert w.sum is None and w.min is None and w.max is None  # unknown: only buckets are counted
    assert w.attributes["tensorwatch.rank"] == 0 and w.attributes["tensorwatch.module.class"] == "Linear"
    assert (pts[("fc1", "output", None)].positive.offset, list(pts[("fc1", "output", None)].positive.bucket_counts)) \
        == (0, [10])
    assert ("fc2", "weight", None) not in pts  # no magnitude: no point
    z = pts[("fc2", "output", None)]
    assert z.zero_count == 14 and z.count == 14 and list(z.positive.bucket_counts) == []


def test_otel_magnitude_histogram_reaches_a_real_otlp_receiver():
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    from otlp_receiver import OtlpReceiver, attrs

    with OtlpReceiver() as rx:
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=rx.grpc_endpoint, insecure=True),
                                               export_interval_millis=60_000)
        mp = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "t"}),
                           shutdown_on_exit=False)
        sink = OtelTelemetry(None, mp)
        sink.on_batch(stats(record(0, UNDER, OVER, MAGS)))
        mp.force_flush()
        sink.close()
        mp.shutdown()
        found = {}
        for req in rx.metric_requests:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name == "tensorwatch.tensor.magnitude":
                            assert sm.scope.name == "tensorwatch_otel"
                            assert m.WhichOneof("data") == "exponential_histogram"
                            for dp in m.exponential_histogram.data_points:
                                a = attrs(dp.attributes)
                                found[(a["tensorwatch.module.path"], a["tensorwatch.tensor"])] = dp
                        if m.name == "tensorwatch.tensor.underflow_ratio":
                            found["gauge"] = m
    w = found[("fc1", "weight")]
    assert (w.scale, w.zero_count, w.count, w.positive.offset, list(w.positive.bucket_counts)) == \
        (0, 2, 7, -3, [1, 0, 4])
    assert found[("fc2", "output")].zero_count == 7
    assert "gauge" in found  # the SDK's own metrics still travel in the same export


def test_the_final_export_of_providers_the_sink_shuts_down_carries_the_histogram():
    """sinks=None builds providers the sink shuts down on close(): their last export (at
    shutdown) holds the batches since the previous export, the histogram's counts too."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    from otlp_receiver import OtlpReceiver

    with OtlpReceiver() as rx:
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=rx.grpc_endpoint, insecure=True),
                                               export_interval_millis=600_000)
        mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
        sink = OtelTelemetry(None, mp, shutdown_on_close=True)
        sink.on_batch(stats(record(0, UNDER, OVER, MAGS)))
        sink.close()
        names = {m.name for req in rx.metric_requests for rm in req.resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics}
    assert "tensorwatch.tensor.magnitude" in names and "tensorwatch.tensor.underflow_ratio" in names


def test_histogram_leaves_other_readers_metrics_untouched_after_close(otel):
    sink = otel.sink()
    sink.on_batch(stats(record(0, UNDER, OVER, MAGS)))
    assert otel.metric("tensorwatch.tensor.magnitude") is not None
    sink.close()
    assert otel.metric("tensorwatch.tensor.magnitude") is None


def test_each_collection_samples_the_latest_batch_once(otel):
    """Reading a batch's counts costs Python work per tensor, so each collection adds the latest
    watched batch (exactly) and no other: many batches between two collections count as one."""
    sink = otel.sink()
    for n in range(200):
        sink.on_batch(stats(record(n, UNDER, OVER, [Mag(n, 0, (1,))] + MAGS[1:])))

    def weight():
        w = _points(otel.metric("tensorwatch.tensor.magnitude"))[("fc1", "weight", None)]
        return w.zero_count, list(w.positive.bucket_counts)

    assert weight() == (199, [1])  # the latest batch's counts
    assert weight() == (199, [1])  # a collection without a new batch adds nothing
    sink.on_batch(stats(record(200, UNDER, OVER, [Mag(1, 0, (5,))] + MAGS[1:])))
    assert weight() == (200, [6])
    sink.close()


def test_frames_with_precision_fields_export_like_records(otel):
    """BatchStats built from Frames (not the watcher's record): TensorStat's underflow/overflow
    dicts and magnitude travel the same way."""
    from dataclasses import dataclass as dc

    from tensorwatch_otel.core.frame_stats import Frame, TensorStat

    @dc(frozen=True)
    class Stat(TensorStat):  # the agreed fields, until core/frame_stats.py has them
        underflow: Optional[Dict[str, float]] = None
        overflow: Optional[Dict[str, float]] = None
        magnitude: Optional[Mag] = None

    frames = (Frame("fc1", "Linear", (
        Stat("weight", 0.5, 2.0, "float32", "", None, {"float16": 0.25}, {"float16": 0.0}, Mag(1, 0, (2,))),
        Stat("output", 0.5, 2.0, "float32", "", None, None, None, None)), 0, batch_start=True),)
    reg = CollectorRegistry()
    prom = PrometheusMetrics(registry=reg)
    sink = otel.sink()
    for s in (prom, sink):
        s.on_batch(BatchStats(0, 0, time.time(), frames))
    p = scrape(reg)
    under = _points(otel.metric("tensorwatch.tensor.underflow_ratio"))
    mag = _points(otel.metric("tensorwatch.tensor.magnitude"))
    prom.close()
    sink.close()
    assert sample(p, "tensorwatch_tensor_underflow_ratio", module="fc1", module_class="Linear", tensor="weight",
                  target_dtype="float16", rank="0") == 0.25
    assert sum(1 for k in p if k[0] == "tensorwatch_tensor_underflow_ratio") == 1
    assert under[("fc1", "weight", "float16")].value == 0.25 and len(under) == 1
    fc1 = mag[("fc1", "weight", None)]
    assert fc1.zero_count == 1 and list(fc1.positive.bucket_counts) == [2]
    assert ("fc1", "output", None) not in mag


def test_sink_options_fail_like_watch_options(monkeypatch):
    """The metric sinks' numeric options are read by the same parsers as watch()'s: the same
    ConfigError, the same wording, naming the argument or the variable."""
    from tensorwatch_otel.core.config import WatchConfig
    from tensorwatch_otel.core.env import ConfigError

    with pytest.raises(ConfigError) as watch_err:
        WatchConfig.build(every_n_batches=0, environ={})
    with pytest.raises(ConfigError) as sink_err:
        PrometheusMetrics(registry=CollectorRegistry(), max_series=0)
    assert str(sink_err.value) == str(watch_err.value).replace("every_n_batches", "max_series")
    with pytest.raises(ConfigError, match=r"max_series=True: expected an integer >= 1"):
        OtelTelemetry(meter_provider=MeterProvider(shutdown_on_exit=False), max_series=True)
    with pytest.raises(ConfigError) as watch_err:
        WatchConfig.build(environ={"TENSORWATCH_EVERY_N_BATCHES": "0"})
    monkeypatch.setenv("TENSORWATCH_PROMETHEUS_MAX_SERIES", "0")
    with pytest.raises(ConfigError) as sink_err:
        PrometheusMetrics(registry=CollectorRegistry())
    assert str(sink_err.value) == str(watch_err.value).replace("EVERY_N_BATCHES", "PROMETHEUS_MAX_SERIES")
    monkeypatch.setenv("TENSORWATCH_METRICS_WINDOW_SECONDS", "-1")
    monkeypatch.delenv("TENSORWATCH_PROMETHEUS_MAX_SERIES")
    with pytest.raises(ConfigError, match="TENSORWATCH_METRICS_WINDOW_SECONDS='-1': expected a finite number >= 0"):
        PrometheusMetrics(registry=CollectorRegistry())


def test_otel_share_points_stay_under_max_series(otel, caplog):
    """Each pair has one point per target dtype: the gauges stop at max_series points (the
    SDK's cardinality limit would otherwise fold the rest into an anonymous overflow series)."""
    import logging

    sink = otel.sink(max_series=4)
    with caplog.at_level(logging.WARNING, logger="tensorwatch_otel"):
        sink.on_batch(stats(record(0, UNDER, OVER)))  # 3 pairs with shares x 2 targets = 6
        under = otel.metric("tensorwatch.tensor.underflow_ratio").data.data_points
        otel.metric("tensorwatch.tensor.underflow_ratio")
    sink.close()
    assert len(under) == 4
    assert not any(dp.attributes.get("otel.metric.overflow") for dp in under)
    assert len([r for r in caplog.records if "exceed max_series" in r.getMessage()]) == 1


def test_histogram_batches_are_the_ones_sampled_between_collections(otel):
    # the watcher counts the magnitude histogram on watched batches 0, 16, 32...: a collection
    # after batches without one still exports the latest batch that had one
    from tensorwatch_otel import watch

    model = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.0, 1.5, 3.0, 0.75]] * 4))
    sink = otel.sink()
    with watch(model, sinks=[sink], target_dtypes=["float16"]):
        for _ in range(3):  # batch 0 has a histogram, batches 1 and 2 none
            model(torch.ones(2, 4))
        m = otel.metric("tensorwatch.tensor.magnitude")
        assert m is not None, "no histogram exported after batches without one"
        w = _points(m)[("(root)", "weight", None)]
        # weight: four zeros, 1.5 and 3 in (1, 2] / (2, 4] four times each, 0.75 in (0.5, 1]
        assert (w.zero_count, w.positive.offset, list(w.positive.bucket_counts)) == (4, -1, [4, 4, 4])
        for _ in range(13):  # batches 3..15: none
            model(torch.ones(2, 4))
        otel.metric("tensorwatch.tensor.magnitude")
        model(torch.ones(2, 4))  # batch 16: the next histogram
        w = _points(otel.metric("tensorwatch.tensor.magnitude"))[("(root)", "weight", None)]
        assert w.zero_count == 8 and list(w.positive.bucket_counts) == [8, 8, 8]
