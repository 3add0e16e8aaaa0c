"""PrometheusMetrics fleet mode (detail=, detail_ranks=): per-rank summary series always, per-module
detail for the top-k pairs by range used, for chosen ranks, or after a detection on this rank."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from _otel_fixtures import batch, detection, frame, linear_frames, parse_prom, sample, stat
from tensorwatch_otel.core import env as twenv
from tensorwatch_otel.sinks.prometheus import PrometheusMetrics

TENSOR_GAUGES = ("tensorwatch_tensor_abs_max", "tensorwatch_tensor_abs_min", "tensorwatch_tensor_range_used_ratio")


def scrape(reg) -> dict:
    return parse_prom(generate_latest(reg).decode())


def pairs(p, name="tensorwatch_tensor_abs_max"):
    return {(dict(k[1])["module"], dict(k[1])["tensor"]) for k in p if k[0] == name}


def ten_layers():
    # layers.i output abs max i+1 (range used (i+1)/65504): layers.9 output is the worst pair
    return linear_frames(10)


def test_default_is_all_detail_and_zero_cutoff():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg)
    assert sink.detail == "all" and sink.detail_ranks == frozenset()
    sink.on_batch(batch(ten_layers(), rank=3))
    p = scrape(reg)
    assert len(pairs(p)) == 40
    assert sample(p, "tensorwatch_detail_hidden_pairs", rank="3") == 0
    assert sample(p, "tensorwatch_detail_cutoff_ratio", rank="3") == 0
    sink.close()


def test_top_k_serves_the_k_pairs_with_the_largest_range_used_and_the_cutoff():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg, detail="top:3")
    assert sink.detail == "top:3"
    sink.on_batch(batch(ten_layers(), rank=5))
    p = scrape(reg)
    # weights are 0.5+i (layers.9: 9.5), outputs i+1 (layers.9: 10), inputs i (layers.9: 9)
    want = {("layers.9", "output"), ("layers.9", "weight"), ("layers.8", "output")}
    for name in TENSOR_GAUGES:
        assert pairs(p, name) == want, name
    # the largest pair left out: layers.9 input[0] (9.0) and layers.8 weight (8.5) -> 9.0
    assert sample(p, "tensorwatch_detail_cutoff_ratio", rank="5") == pytest.approx(9.0 / 65504)
    assert sample(p, "tensorwatch_detail_hidden_pairs", rank="5") == 37
    # the worst pair of the rank, with its labels
    assert sample(p, "tensorwatch_rank_range_used_max_ratio", module="layers.9", module_class="Linear",
                  tensor="output", dtype="float16", rank="5") == pytest.approx(10.0 / 65504)
    # per-rank series stay
    assert sample(p, "tensorwatch_batches_total", rank="5") == 1
    sink.close()


def test_summary_serves_no_per_module_gauges_but_the_worst_pair():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg, detail="summary")
    sink.on_batch(batch(ten_layers(), rank=1))
    p = scrape(reg)
    assert not any(k[0] in TENSOR_GAUGES for k in p)
    assert sample(p, "tensorwatch_detail_cutoff_ratio", rank="1") == pytest.approx(10.0 / 65504)
    assert sample(p, "tensorwatch_rank_range_used_max_ratio", module="layers.9", module_class="Linear",
                  tensor="output", dtype="float16", rank="1") == pytest.approx(10.0 / 65504)
    sink.close()


def test_detail_ranks_serve_everything():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg, detail="summary", detail_ranks=[0, 8])
    sink.on_batch(batch(ten_layers(), rank=8))
    assert len(pairs(scrape(reg))) == 40
    sink.close()


def test_nan_and_inf_rank_first_and_a_detection_turns_full_detail_on():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg, detail="top:1")
    frames = linear_frames(10, bad_at=2)  # layers.2 output is inf
    sink.on_batch(batch(frames, rank=2))
    p = scrape(reg)
    assert pairs(p) == {("layers.2", "output")}
    assert sample(p, "tensorwatch_tensor_abs_max", module="layers.2", module_class="Linear",
                  tensor="output", rank="2") == math.inf
    sink.on_event(detection(frames[:3], rank=2))
    p = scrape(reg)
    assert len(pairs(p)) == 40  # the detecting rank shows every module from now on
    assert sample(p, "tensorwatch_detail_hidden_pairs", rank="2") == 0
    sink.close()


def test_environment_and_argument_precedence(monkeypatch):
    monkeypatch.setenv(twenv.ENV_PROMETHEUS_DETAIL, "top:4")
    monkeypatch.setenv(twenv.ENV_PROMETHEUS_DETAIL_RANKS, "0, 16,32")
    sink = PrometheusMetrics(registry=CollectorRegistry())
    assert sink.detail == "top:4" and sink.detail_ranks == frozenset({0, 16, 32})
    sink.close()
    sink = PrometheusMetrics(registry=CollectorRegistry(), detail="summary", detail_ranks=())
    assert sink.detail == "summary" and sink.detail_ranks == frozenset()
    sink.close()
    sink = PrometheusMetrics(registry=CollectorRegistry(), detail=7)
    assert sink.detail == "top:7"
    sink.close()


@pytest.mark.parametrize("kwargs, env, needle", [
    (dict(detail="top:0"), {}, "detail='top:0'"),
    (dict(detail="most"), {}, "detail='most'"),
    (dict(detail=True), {}, "detail=True"),
    (dict(detail_ranks="0,x"), {}, "detail_ranks='0,x'"),
    (dict(detail_ranks=[-1]), {}, "detail_ranks=[-1]"),
    ({}, {twenv.ENV_PROMETHEUS_DETAIL: "top:-2"}, "TENSORWATCH_PROMETHEUS_DETAIL='top:-2'"),
    ({}, {twenv.ENV_PROMETHEUS_DETAIL_RANKS: "a"}, "TENSORWATCH_PROMETHEUS_DETAIL_RANKS='a'"),
])
def test_bad_values_name_the_option(monkeypatch, kwargs, env, needle):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    reg = CollectorRegistry()
    with pytest.raises(ValueError) as err:
        PrometheusMetrics(registry=reg, **kwargs)
    assert needle in str(err.value)
    assert "all" in str(err.value) or "rank" in str(err.value)
    # nothing left registered: a corrected sink in the same registry works
    for k in env:
        monkeypatch.delenv(k)
    PrometheusMetrics(registry=reg).close()


def test_top_k_keeps_a_served_pair_while_it_stays_among_the_2k_worst():
    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg, detail="top:2", window_s=0)

    def outputs(*his):  # layers.i output abs max his[i]; weights and inputs small
        return tuple(frame(f"layers.{i}", "Linear", stat("weight", 0.0, 0.01), stat("output", 0.0, hi))
                     for i, hi in enumerate(his))

    sink.on_batch(batch(outputs(10, 9, 8, 1, 1), number=0))
    p = scrape(reg)
    assert pairs(p) == {("layers.0", "output"), ("layers.1", "output")}
    # layers.2 overtakes layers.1 by a hair: layers.1 is 3rd, within the 2K=4 worst, and stays
    sink.on_batch(batch(outputs(10, 8.9, 9.1, 1, 1), number=1))
    p = scrape(reg)
    assert pairs(p) == {("layers.0", "output"), ("layers.1", "output"), ("layers.2", "output")}
    # the cutoff is the largest pair left out, whatever stays served
    assert sample(p, "tensorwatch_detail_cutoff_ratio", rank="0") == pytest.approx(1 / 65504)
    # layers.1 falls below the 2K worst: it goes
    sink.on_batch(batch(outputs(10, 0.001, 9.1, 5, 6), number=2))
    p = scrape(reg)
    assert pairs(p) == {("layers.0", "output"), ("layers.2", "output")}
    assert sample(p, "tensorwatch_detail_cutoff_ratio", rank="0") == pytest.approx(6 / 65504)
    sink.close()


def test_a_stop_caused_by_another_rank_keeps_top_k():
    """Only the detecting rank turns full detail on: a fleet stop must not put every rank's
    detail into Prometheus at once."""
    import time

    from tensorwatch_otel.core.events import StoppedByRankEvent

    reg = CollectorRegistry()
    sink = PrometheusMetrics(registry=reg, detail="top:2", linger_s=0)
    sink.on_batch(batch(ten_layers(), rank=4))
    sink.on_event(StoppedByRankEvent(0, 4, 1, "layers.3", "Linear", "output", "inf", time.time()))
    p = scrape(reg)
    assert len(pairs(p)) == 2
    assert sample(p, "tensorwatch_stopped_by_rank_events_total", module="layers.3", module_class="Linear",
                  tensor="output", rank="4", first_rank="1") == 1
    sink.close()
