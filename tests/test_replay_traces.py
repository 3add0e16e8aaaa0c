"""A replay leaves no trace (issue: trust, items 3 and 8). Localizing a detection in an unsampled
batch and `rerun_on_detect` replay the batch on the user's model; training must then go on
exactly as if the replay never ran: each test runs the same training watched (with a replay) and
unwatched and compares every weight, buffer and attribute bit for bit. And the inputs held for a
replay are let go at detach() and after NonFiniteDetected, while the watcher is still referenced."""

from __future__ import annotations

import gc
import logging
import math
import random
import weakref

import pytest
import torch
from torch import nn

from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch

BAD = 13  # an unsampled batch at every_n_batches=10
BATCHES = 20
REPLAYS = {"localize": dict(every_n_batches=10), "rerun": dict(rerun_on_detect=True),
           "both": dict(every_n_batches=10, rerun_on_detect=True)}


class Stateful(nn.Module):
    """A forward that changes what its module holds: a step counter rebound by assignment (a new
    buffer tensor each call), a hidden state kept as a plain attribute (truncated BPTT), a
    running mean written in place, a plain int and a list it appends to."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("running", torch.zeros(16))
        self.h = torch.zeros(16)
        self.calls = 0
        self.sizes = []

    def forward(self, x):
        self.count = self.count + 1
        self.calls += 1
        self.sizes.append(x.shape[0])
        z = self.a(x)
        h = torch.tanh(z + self.h)
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * torch.nan_to_num(h).mean(0))
        self.h = h.detach().mean(0)
        # an inf input makes z inf (tanh saturates: the hidden state stays finite) and the output nan
        return self.b(h) * (1 + self.count / 100) + 0 * z[:, :4]


def _batches():
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 8, generator=g) for _ in range(BATCHES)]
    data[BAD][0, 0] = math.inf
    return data


def _train(model, replay=None):
    """The run: a batch whose loss is not finite takes no step (the loop's own guard). Returns
    the losses and the sink (None unwatched)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = Collect() if replay is not None else None
    w = watch(model, sinks=[sink], on_detect="report", **REPLAYS[replay]) if replay is not None else None
    losses = []
    try:
        for x in _batches():
            loss = model(x).square().mean()
            losses.append(loss.detach())
            loss.backward()
            if torch.isfinite(loss):
                opt.step()
            opt.zero_grad()
    finally:
        if w is not None:
            w.detach()
    return torch.stack(losses), sink


def _same_state(model, ref):
    for (name, v), (_, r) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(v, r), name  # weights, `count`, `running`


@pytest.mark.parametrize("replay", list(REPLAYS))
def test_training_after_a_replay_is_bit_for_bit_the_unwatched_run(replay):
    torch.manual_seed(0)
    ref = Stateful()
    ref_losses, _ = _train(ref)
    torch.manual_seed(0)
    model = Stateful()
    losses, sink = _train(model, replay)
    (ev,) = sink.of(NonFiniteEvent)
    assert (ev.batch_number, ev.module, ev.tensor) == (BAD, "a", "input[0]")  # a replay ran and named it
    if "rerun_on_detect" in REPLAYS[replay]:
        assert ev.reproduced is True
    assert int(model.count) == int(ref.count) == BATCHES  # not 21: the replay's new tensor did not stay
    assert model.calls == ref.calls == BATCHES and model.sizes == ref.sizes
    assert torch.equal(model.h, ref.h)  # the hidden state the forward kept, not the replay's
    _same_state(model, ref)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0, equal_nan=True)


class Scaled(nn.Module):
    """Multiplies by a buffer: autograd saves the buffer for the backward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        return torch.exp(self.a(x) * self.scale)


@pytest.mark.parametrize("replay", ["localize", "rerun"])
def test_the_backward_after_a_replay_runs_as_unwatched(replay):
    """The replay runs between the forward and its backward (on_detect="skip": the backward and
    the step follow): giving a buffer back must not look like an in-place write to autograd
    (before, every buffer was copied back: "modified by an inplace operation")."""
    results = []
    for watched in (False, True):
        torch.manual_seed(0)
        model = Scaled()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sink = Collect()
        w = watch(model, sinks=[sink], on_detect="skip", **REPLAYS[replay]) if watched else None
        g = torch.Generator().manual_seed(1)
        for i in range(BATCHES):
            x = torch.randn(4, 8, generator=g) * (100 if i == BAD else 1)
            loss = model(x).sum()
            loss.backward()  # raised RuntimeError after a replay before the fix
            if torch.isfinite(loss) or watched:  # (watched: on_detect="skip" skips that step itself)
                opt.step()
            opt.zero_grad()
        if w is not None:
            w.detach()
            assert w.nonfinite_steps_skipped == 1
            assert [(e.batch_number, e.module) for e in sink.of(NonFiniteEvent)] == [(BAD, "")]
        results.append(model)
    _same_state(*results)


class Noisy(nn.Module):
    """Noise from a generator the module holds and from Python's `random`: state the batch's
    start does not hold, so a replay cannot draw the batch's numbers; it must give them back."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.gen = torch.Generator().manual_seed(3)

    def forward(self, x):
        z = self.a(x) * (1 + 0.01 * random.random())
        z = z + 0.01 * torch.randn(z.shape, generator=self.gen)
        return self.b(torch.exp(z))


def test_a_replay_gives_back_the_generators_it_drew_from_and_says_it_could_not_replay_them():
    runs = []
    for every in (None, 10):
        torch.manual_seed(0)
        random.seed(5)
        model = Noisy()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sink = Collect()
        w = watch(model, sinks=[sink], on_detect="report", every_n_batches=every) if every else None
        g = torch.Generator().manual_seed(1)
        for i in range(BATCHES):
            loss = model(torch.randn(4, 8, generator=g) * (300 if i == BAD else 1)).square().mean()
            if torch.isfinite(loss):
                loss.backward()
                opt.step()
            opt.zero_grad()
        if w is not None:
            w.detach()
        runs.append((model, random.random(), sink))
    (ref, ref_next, _), (model, after, sink) = runs
    _same_state(model, ref)
    assert torch.equal(model.gen.get_state(), ref.gen.get_state()) and after == ref_next
    (ev,) = sink.of(NonFiniteEvent)
    # named where the check saw it, and said why not where it was born
    assert (ev.batch_number, ev.module, ev.tensor) == (BAD, "", "output")
    assert ev.uncertain == "the replay drew random numbers the batch did not draw (from the generator gen, " \
                           "Python's random)"


def test_uncertain_reaches_json_lines_the_span_and_the_exception(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tensorwatch_otel.report.codec import read_events
    from tensorwatch_otel.sinks import JsonlLog, OtelTelemetry

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    path = tmp_path / "events.jsonl"
    torch.manual_seed(0)
    model = Noisy()
    with watch(model, sinks=[JsonlLog(str(path)), OtelTelemetry(tracer_provider=tp)], every_n_batches=10) as w:
        model(torch.randn(4, 8))
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.randn(4, 8) * 300)  # batch 1, unsampled
        assert w.batch_number == 2
    why = "the replay drew random numbers the batch did not draw (from the generator gen, Python's random)"
    assert ei.value.event.uncertain == why
    assert str(ei.value).endswith(f"(seen there; where it was born is uncertain: {why})")
    (back,) = [e for e in read_events(str(path)) if isinstance(e, NonFiniteEvent)]
    assert (back.batch_number, back.module, back.tensor, back.uncertain) == (1, "", "output", why)
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "tensorwatch.nonfinite_detected"]
    assert span.attributes["tensorwatch.uncertain"] == why
    tp.shutdown()


class ClipsItself(nn.Module):
    """A forward that clips its own weight in place (under no_grad): a change a replay cannot give
    back without a copy of every parameter."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            self.a.weight.clamp_(-0.3, 0.3)
        return torch.exp(self.a(x))


def test_a_parameter_the_replay_changed_in_place_is_said_at_error(caplog):
    torch.manual_seed(0)
    model = ClipsItself()
    with caplog.at_level(logging.ERROR, logger="tensorwatch_otel"):
        with watch(model, sinks=[Collect()], on_detect="report", rerun_on_detect=True):
            model(torch.randn(4, 8) * 300)
    said = [r.getMessage() for r in caplog.records if "cannot give back" in r.getMessage()]
    assert len(said) == 1 and "a.weight (a parameter, changed in place)" in said[0]


class ExpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.exp(self.a(x)))


@pytest.mark.parametrize("replay", list(REPLAYS))
def test_the_held_inputs_are_let_go_at_detach(replay):
    """A batch (on a GPU, in a notebook) is not kept alive by a watcher still referenced."""
    torch.manual_seed(0)
    model = ExpNet()
    w = watch(model, sinks=[Collect()], **REPLAYS[replay])
    x = torch.randn(4, 8)
    held = weakref.ref(x)
    model(x)
    del x
    gc.collect()
    assert held() is not None  # the batch's inputs are held until the next batch begins (documented)
    w.detach()
    gc.collect()
    assert held() is None


@pytest.mark.parametrize("replay", list(REPLAYS))
def test_the_held_inputs_are_let_go_after_nonfinite_detected(replay):
    torch.manual_seed(0)
    model = ExpNet()
    w = watch(model, sinks=[Collect()], **REPLAYS[replay])
    x = torch.randn(4, 8) * 300
    held = weakref.ref(x)
    try:
        model(x)
    except NonFiniteDetected as exc:
        assert exc.event.batch_number == 0
    else:
        raise AssertionError("no detection")
    del x
    gc.collect()
    assert held() is None
    assert w.detections == 1  # (still attached, still referenced)
    w.detach()
