"""The attributed ratio of benchmarks/bench_paired.py times exactly the watcher's own work: a
known delay put into the measurement shows up in full, and nothing is left patched after."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from _attribution import HookClock, hook_dispatch_s  # noqa: E402
from tensorwatch_otel import watch  # noqa: E402
from tensorwatch_otel.core.frames import recorder  # noqa: E402
from tensorwatch_otel.core.measure.host_batch import HostBatch  # noqa: E402
from tensorwatch_otel.core.steps import tracker as steps  # noqa: E402

pytestmark = pytest.mark.timing  # times the hooks: run alone (scripts/test.sh)

DELAY = 0.002


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_known_delay_in_the_measurement_is_attributed_in_full(monkeypatch):
    measured = []
    real = recorder.measure

    def slow_measure(t):
        measured.append(1)
        _busy(DELAY)
        return real(t)

    monkeypatch.setattr(recorder, "measure", slow_measure)
    real_many = HostBatch.measure

    def slow_many(self):  # a frame's (or the step guard's) one kernel call for its CPU tensors
        if len(self.ns):
            measured.append(1)
            _busy(DELAY)
        return real_many(self)

    monkeypatch.setattr(HostBatch, "measure", slow_many)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    originals = (nn.Module.register_forward_hook, nn.Module.register_forward_pre_hook,
                 torch.Tensor.register_hook, steps.register_optimizer_step_pre_hook)
    hc = HookClock(time.perf_counter)
    with hc.patched():
        with watch(model, sinks=[]):
            for _ in range(3):
                measured.clear()
                with hc.step():
                    model(torch.randn(4, 8)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                # every measurement's delay lies inside the hooks, and the hooks inside the step
                assert hc.per_step[-1] >= len(measured) * DELAY > 0
                assert hc.per_step[-1] <= hc.step_s[-1]
                # the work outside the delays is small: the delays are most of the hook time
                assert hc.per_step[-1] < len(measured) * DELAY + 0.25
    assert hc.calls_per_step == [4, 4, 4]  # the root and its three children, once per step
    assert (nn.Module.register_forward_hook, nn.Module.register_forward_pre_hook,
            torch.Tensor.register_hook, steps.register_optimizer_step_pre_hook) == originals


def test_hook_dispatch_is_a_small_positive_cost():
    per_call = hook_dispatch_s(time.perf_counter, calls=500, repeats=5)
    assert 0.0 <= per_call < 200e-6
