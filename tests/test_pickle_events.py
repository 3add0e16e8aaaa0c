"""Events and exceptions cross process boundaries: a diverging trial of a ProcessPoolExecutor or
multiprocessing.Pool sweep reaches the caller as NonFiniteDetected with its event (the pool
and the healthy trials survive), and a detection in a DataLoader worker reaches the main
process as NonFiniteDetected."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import pickle

import torch
from torch import nn

import pytest
from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, watch
from tensorwatch_otel.core.env import ConfigError
from tensorwatch_otel.core.errors import AbortAfterBatch
from tensorwatch_otel.core.events import (AbortAfterBatchEvent, BatchTraceEvent, NonFiniteEvent, OverflowCheckEvent,
                                          SamplingRateEvent, SkippedNonFiniteStepEvent, SkippedStepEvent,
                                          SkipStreakEvent, StoppedByRankEvent)
from tensorwatch_otel.core.frame_stats import Frame, TensorStat

INF = float("inf")
NAN = float("nan")


def _frames():
    return (Frame("", "Net", (TensorStat("input[0]", 0.5, 2.0, "float32", "", 2.0 / 3.4e38),
                              TensorStat("output", None, None, "", "None")), 4, batch_start=True),
            Frame("lin", "Linear", (TensorStat("weight", 0.1, INF, "float16", "", None),), 4, phase="backward"))


def _events():
    fr = _frames()
    return [
        NonFiniteEvent(4, 1, "lin", "Linear", "weight", "inf", fr, 1700000000.5, first_rank=0, phase="backward",
                       capture="/tmp/c.pt", reproduced=True, host="node7", trace_id="ab" * 16),
        NonFiniteEvent(2, 0, "", "Net", "output", "nan", (), 1.0),
        BatchTraceEvent(4, 1, fr, 2.0),
        AbortAfterBatchEvent(9, 0, 3.0),
        OverflowCheckEvent(5, 0, "after attention", "inf", TensorStat("x", 1.0, INF, "float32"), 4.0),
        SkippedStepEvent(6, 2, 3, 1024.0, "lin", "Linear", "weight.grad", "inf,nan", 5.0),
        SkipStreakEvent(7, 0, 8, 0.5, 6.0),
        SkippedNonFiniteStepEvent(8, 1, "lin", "Linear", "input[0]", "inf", 6.5, 2, "forward"),
        SamplingRateEvent(12, 0, 25, 0.031, 0.018, 0.02, 7.5),
        StoppedByRankEvent(3, 1, 0, "lin", "Linear", "output", "inf", 7.0, stopped_at_batch=4),
    ]


def _fields(obj):
    return {k: v for k, v in vars(obj).items()}


@pytest.mark.parametrize("event", _events(), ids=lambda e: type(e).__name__)
def test_every_event_round_trips_through_pickle(event):
    back = pickle.loads(pickle.dumps(event))
    assert type(back) is type(event) and back == event and _fields(back) == _fields(event)
    assert back.event == event.event


def _same_nan_aware(a, b):
    return a == b or (a != a and b != b)


def test_a_frame_with_nan_statistics_round_trips():
    st = TensorStat("output", NAN, NAN, "float16")
    back = pickle.loads(pickle.dumps(st))
    assert back.name == "output" and _same_nan_aware(back.abs_min, NAN) and back.kind == "nan"


@pytest.mark.parametrize("event", [_events()[0], _events()[-1]], ids=["NonFiniteEvent", "StoppedByRankEvent"])
def test_non_finite_detected_round_trips_with_its_event(event):
    exc = NonFiniteDetected("tensorwatch_otel: inf in lin (Linear) weight during batch 4", event)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is NonFiniteDetected and isinstance(back, ValueError)
    assert str(back) == str(exc) and back.args == exc.args and back.event == event


@pytest.mark.parametrize("exc", [AbortAfterBatch("abort_after_batch=3 reached"),
                                 ConfigError("TENSORWATCH_MAX_FRAMES='x': expected an integer >= 1")],
                         ids=lambda e: type(e).__name__)
def test_other_exceptions_round_trip(exc):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)


def test_non_finite_detected_built_from_a_message_alone():
    # torch's DataLoader rebuilds a worker's exception as exc_type(message)
    exc = NonFiniteDetected("Caught NonFiniteDetected in DataLoader worker process 0.")
    assert exc.event is None and "worker process 0" in str(exc)
    assert pickle.loads(pickle.dumps(exc)).event is None


# ---------------------------------------------------------------- real process pools
def trial(diverge: bool) -> float:
    """One sweep trial: a tiny model; a diverging one meets an inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    if diverge:
        x[1, 2] = INF
    with watch(model, sinks=[Collect()]):
        return float(model(x).sum().detach())


def _check_diverged(exc: BaseException):
    assert type(exc) is NonFiniteDetected
    ev = exc.event
    assert isinstance(ev, NonFiniteEvent)
    assert (ev.module, ev.tensor, ev.kind, ev.batch_number) == ("0", "input[0]", "inf", 0)
    assert ev.frames and ev.frames[-1].module == "0"


def test_a_diverging_trial_in_a_process_pool_executor_reaches_the_caller_with_its_event():
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        bad = pool.submit(trial, True)
        good = pool.submit(trial, False)
        exc = bad.exception(timeout=60)
        assert good.result(timeout=60) == pytest.approx(trial(False))
        assert pool.submit(trial, False).result(timeout=60) == pytest.approx(trial(False))  # the pool lives
    _check_diverged(exc)


def test_a_diverging_trial_in_a_multiprocessing_pool_reaches_the_caller_without_a_hang():
    pool = multiprocessing.get_context("fork").Pool(1)
    try:
        bad = pool.apply_async(trial, (True,))
        good = pool.apply_async(trial, (False,))
        with pytest.raises(NonFiniteDetected) as ei:
            bad.get(timeout=60)
        assert good.get(timeout=60) == pytest.approx(trial(False))
    finally:
        pool.terminate()
        pool.join()
    _check_diverged(ei.value)


class Features(torch.utils.data.Dataset):
    """A dataset that runs a (watched) feature model on each item."""

    def __init__(self, model):
        self.model = model
        self.x = torch.randn(4, 4)
        self.x[2, 1] = INF

    def __len__(self):
        return 4

    def __getitem__(self, i):
        with torch.no_grad():
            return self.model(self.x[i:i + 1])[0]


def test_a_detection_in_a_dataloader_worker_reaches_the_main_process_as_non_finite_detected():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    with watch(model, sinks=[Collect()]):
        loader = torch.utils.data.DataLoader(Features(model), batch_size=1, num_workers=1,
                                             multiprocessing_context="fork")
        with pytest.raises(NonFiniteDetected) as ei:
            for _ in loader:
                pass
    msg = str(ei.value)
    # torch re-raises a worker's exception as exc_type(message): the event stays in the worker,
    # the message carries the worker's traceback and the detection's own line
    assert "in DataLoader worker process 0" in msg and "tensorwatch_otel: inf in 0 (Linear) input[0]" in msg
    assert ei.value.event is None
