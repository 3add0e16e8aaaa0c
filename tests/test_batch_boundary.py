"""Who a batch belongs to: each thread's outermost watched call is its own batch (an inference
server calling one watched model from several threads), a detection raises in the thread whose
call produced it, and `Watcher.batch()` makes every watched call inside it one batch."""

from __future__ import annotations

import math
import sys
import threading

import pytest
import torch
import torch.nn as nn

from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch


class Double(nn.Module):
    def forward(self, x):
        return x * 2


class Chain(nn.Module):
    """root(x) = c(b(a(x))): every value of a call follows from its input's."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = Double(), Double(), Double()

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _in_threads(target, n):
    """Run target(i) in n threads started together, with a short switch interval so that their
    calls interleave; returns {i: exception} for the threads that raised."""
    errors = {}
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors[i] = exc

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    return errors


def _value(frame, name):
    return next(t.abs_max for t in frame.tensors if t.name == name)


def test_each_threads_outermost_call_is_its_own_batch():
    model = Chain()
    sink = Collect()
    calls = 50

    def serve(i):
        x = torch.full((2, 4), float(i + 1))
        for _ in range(calls):
            assert torch.equal(model(x), x * 8)

    with watch(model, sinks=[sink], on_detect="raise") as w:
        errors = _in_threads(serve, 4)
        assert errors == {}
        assert w.batch_number == 4 * calls
    assert sorted(b.batch_number for b in sink.batches) == list(range(4 * calls))
    per_thread = {}
    for b in sink.batches:
        assert [f.module for f in b.frames] == ["a", "b", "c", ""]
        v = _value(b.frames[0], "input[0]")  # the calling thread's value, 1..4
        assert [_value(f, "output") for f in b.frames] == [2 * v, 4 * v, 8 * v, 8 * v]
        per_thread[v] = per_thread.get(v, 0) + 1
    assert per_thread == {1.0: calls, 2.0: calls, 3.0: calls, 4.0: calls}
    assert sink.events == []


def test_a_detection_raises_in_the_thread_whose_call_produced_it():
    model = Chain()
    sink = Collect()
    done = {}

    def serve(i):
        x = torch.full((2, 4), float(i + 1))
        for k in range(50):
            model(torch.full((2, 4), math.inf) if (i == 2 and k == 20) else x)
            done[i] = k + 1

    with watch(model, sinks=[sink], on_detect="raise"):
        errors = _in_threads(serve, 4)
    assert list(errors) == [2] and isinstance(errors[2], NonFiniteDetected)
    assert done == {0: 50, 1: 50, 2: 20, 3: 50}
    event = errors[2].event
    assert (event.module, event.tensor, event.kind) == ("a", "input[0]", "inf")
    assert sink.of(NonFiniteEvent) == [event]
    # the event's own batch holds thread 2's frames only
    [bad] = [b for b in sink.batches if b.batch_number == event.batch_number]
    assert [_value(f, "output") for f in bad.frames] == [math.inf] * 4


def test_a_batch_held_in_one_thread_leaves_the_other_threads_batches_alone():
    model = Chain()
    sink = Collect()
    with watch(model, sinks=[sink]) as w:
        def serve(i):
            x = torch.full((2, 4), float(i + 1))
            if i == 0:
                with w.batch():
                    for _ in range(3):
                        model.a(x)
                        model.b(x)
            else:
                for _ in range(3):
                    model(x)

        assert _in_threads(serve, 2) == {}
    sizes = sorted(len(b.frames) for b in sink.batches)
    assert sizes == [4, 4, 4, 6]
    [held] = [b for b in sink.batches if len(b.frames) == 6]
    assert [f.module for f in held.frames] == ["a", "b"] * 3


def test_batch_makes_submodule_calls_one_batch():
    model = Chain()
    sink = Collect()
    x = torch.ones(2, 4)
    with watch(model, sinks=[sink]) as w:
        model(x)
        with w.batch():
            model.a(x)
            model.b(x)
            model.c(x)
            assert w.batch_number == 1  # the batch in progress (numbered when its first call began)
        model(x)
        assert w.batch_number == 3
    assert [b.batch_number for b in sink.batches] == [0, 1, 2]
    assert [f.module for f in sink.batches[1].frames] == ["a", "b", "c"]
    assert sink.batches[1].frames[0].batch_start and not sink.batches[1].frames[1].batch_start


def test_nested_batches_are_one_batch_and_an_empty_batch_takes_no_number():
    model = Chain()
    sink = Collect()
    x = torch.ones(2, 4)
    with watch(model, sinks=[sink]) as w:
        with w.batch():
            model.a(x)
            with w.batch():
                model.b(x)
                model(x)
            model.c(x)
        with w.batch():
            pass
        assert w.batch_number == 1
    [b] = sink.batches
    assert [f.module for f in b.frames] == ["a", "b", "a", "b", "c", "", "c"]


def test_an_exception_inside_batch_propagates_unchanged_and_the_batch_is_recorded():
    model = Chain()
    sink = Collect()
    x = torch.ones(2, 4)
    boom = KeyError("user's own")
    with watch(model, sinks=[sink], on_detect="report") as w:
        with pytest.raises(KeyError) as info:
            with w.batch():
                model.a(x)
                raise boom
        assert info.value is boom
        model(x)
    assert [(b.batch_number, len(b.frames)) for b in sink.batches] == [(0, 1), (1, 4)]


def test_a_detection_inside_batch_raises_at_the_call_that_produced_it():
    """Not at the batch's end: the backward and the optimizer step after it never run."""
    model = Chain()
    sink = Collect()
    reached = []
    with watch(model, sinks=[sink]) as w:
        with pytest.raises(NonFiniteDetected) as info:
            with w.batch():
                model.a(torch.ones(2, 4))
                model.b(torch.full((2, 4), math.inf))
                reached.append("after")
    assert reached == []
    assert (info.value.event.module, info.value.event.batch_number) == ("b", 0)
    assert sink.of(NonFiniteEvent) == [info.value.event]
    assert [f.module for f in sink.batches[0].frames] == ["a", "b"]


def test_report_mode_records_a_detection_under_the_users_exception():
    model = Chain()
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report") as w:
        with pytest.raises(RuntimeError, match="loader"):
            with w.batch():
                model.a(torch.full((2, 4), math.inf))
                raise RuntimeError("loader")
    [event] = sink.of(NonFiniteEvent)
    assert (event.module, event.batch_number) == ("a", 0)


def test_backward_and_step_inside_batch_belong_to_the_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    x = torch.randn(3, 4)
    with watch(model, sinks=[sink]) as w:
        for step in range(3):
            with w.batch():
                model[0](x)  # an extra outermost call: the batch is not ended by it
                loss = model(x).sum()
                loss.backward()
                if step == 2:
                    model[1].weight.grad[0, 0] = math.inf
                    with pytest.raises(NonFiniteDetected) as info:
                        opt.step()
                else:
                    opt.step()
                opt.zero_grad()
    assert [b.batch_number for b in sink.batches if b.phase == "forward"] == [0, 1, 2]
    event = info.value.event
    assert (event.batch_number, event.module, event.tensor) == (2, "1", "weight.grad")


def test_gradients_of_a_batch_are_numbered_with_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    sink = Collect()
    x = torch.randn(3, 4)
    with watch(model, sinks=[sink], gradients=True) as w:
        for _ in range(2):
            with w.batch():
                model[0](x)
                model(x).sum().backward()
    phases = [(b.batch_number, b.phase) for b in sink.batches]
    assert sorted(phases) == [(0, "backward"), (0, "forward"), (1, "backward"), (1, "forward")]
