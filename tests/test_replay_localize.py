"""Detection in every batch, localization by replay (issue 27, parts 1 and 2): with
every_n_batches=10, an inf/nan born in an unsampled batch (in a forward activation, in the loss,
in a gradient) is detected in that batch, by the check of its output or by the step guard, and
named where a run watching every batch names it: the batch is replayed with every module
watched. Each test runs the same training twice, every_n_batches=1 and 10, and compares."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch
from torch import nn

from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch
from tensorwatch_otel.core.events import SkippedNonFiniteStepEvent
from tensorwatch_otel.sinks import JsonlLog

BAD = 13  # an unsampled batch at every_n_batches=10
BATCHES = 15
INF = float("inf")


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class ExpNet(nn.Module):
    """a -> exp -> b: an exp overflow in `act` reaches the output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.act = Exp()
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


class ClampedExpNet(nn.Module):
    """a -> relu -> b -> exp, clamped: an exp overflow in `act` never reaches the output (the
    clamp makes it 1e4), but its backward (0 * inf) makes b's gradients NaN."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.act = Exp()

    def forward(self, x):
        return self.act(self.b(torch.relu(self.a(x)))).clamp(max=1e4)


class LossNet(nn.Module):
    """Returns {"loss", "logits"}, as a transformers model given labels does."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, y):
        logits = self.b(torch.relu(self.a(x)))
        return {"loss": (logits - y).square().mean(), "logits": logits}


def _data(scenario):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(BATCHES)]
    x, y = data[BAD]
    if scenario in ("activation", "hidden_activation", "in_place"):
        x = x * 300  # exp overflows in `act`
    elif scenario == "loss_in_model":
        y = torch.full_like(y, 1e30)  # (logits - 1e30) ** 2 overflows in the model's loss
    elif scenario == "loss_outside":
        y = y.clone()
        y[0, 0] = INF  # the loss computed outside the model
    data[BAD] = (x, y)
    return data


MODELS = {"activation": ExpNet, "hidden_activation": ClampedExpNet, "loss_in_model": LossNet,
          "loss_outside": ExpNet, "gradient": ExpNet}


def _train(scenario, every, on_detect="raise", sinks=None, batch_blocks=False, compile_model=False, **kw):
    """The same training, watched with every_n_batches=`every`: (the detection's exception or
    None, the sink, the model)."""
    torch.manual_seed(0)
    model = MODELS[scenario]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = Collect()
    called = torch.compile(model, backend="eager") if compile_model else model
    raised = None
    with watch(called, sinks=[sink] + list(sinks or ()), every_n_batches=every, on_detect=on_detect, **kw) as w:
        try:
            for i, (x, y) in enumerate(_data(scenario)):
                block = w.batch() if batch_blocks else contextlib.nullcontext()
                with block:
                    opt.zero_grad()
                    if scenario == "loss_in_model":
                        loss = called(x, y)["loss"]
                    else:
                        loss = (called(x) - y).square().mean()
                    loss.backward()
                    if scenario == "gradient" and i == BAD:
                        model.a.weight.grad[0, 0] = INF  # born in a gradient
                    opt.step()
        except NonFiniteDetected as exc:
            raised = exc
    return raised, sink, model


def _place(ev):
    return (ev.module, ev.tensor, ev.phase, ev.batch_number, ev.kind)


def _first_event(sink):
    events = sink.of(NonFiniteEvent)
    assert events, "no detection"
    return events[0]


# where a run watching every batch names each (checked live below, not assumed)
EXPECTED = {"activation": ("act", "output", "forward"), "hidden_activation": ("act", "output", "forward"),
            "loss_in_model": ("", "output.loss", "forward"), "loss_outside": ("b", "bias.grad", "backward"),
            "gradient": ("a", "weight.grad", "backward")}


@pytest.mark.parametrize("scenario", list(MODELS))
def test_an_inf_in_an_unsampled_batch_is_named_where_full_watching_names_it(scenario):
    full, _, _ = _train(scenario, 1)
    sampled, sink, _ = _train(scenario, 10)
    assert full is not None and sampled is not None
    assert full.event.batch_number == BAD
    assert _place(full.event)[:3] == EXPECTED[scenario]
    assert _place(sampled.event) == _place(full.event)
    assert sink.of(NonFiniteEvent) == [sampled.event]
    if full.event.phase == "forward":  # the replay's frames: the batch's modules up to the place
        assert [f.module for f in sampled.event.frames] == [f.module for f in full.event.frames
                                                             if f.batch_number == BAD]
        assert all(f.batch_number == BAD for f in sampled.event.frames)


@pytest.mark.parametrize("scenario", ["activation", "hidden_activation", "loss_outside"])
def test_report_records_the_same_first_event_and_training_goes_on(scenario):
    full, full_sink, _ = _train(scenario, 1, on_detect="report")
    sampled, sink, _ = _train(scenario, 10, on_detect="report")
    assert full is None and sampled is None
    assert _place(_first_event(sink)) == _place(_first_event(full_sink))


@pytest.mark.parametrize("scenario", ["activation", "hidden_activation", "gradient"])
def test_skip_skips_the_step_and_names_where_the_inf_was_born(scenario):
    full, full_sink, full_model = _train(scenario, 1, on_detect="skip")
    sampled, sink, model = _train(scenario, 10, on_detect="skip")
    assert full is None and sampled is None
    (skipped_full,) = full_sink.of(SkippedNonFiniteStepEvent)
    (skipped,) = sink.of(SkippedNonFiniteStepEvent)
    keys = ("batch_number", "module", "module_class", "tensor", "kind", "phase")
    assert [getattr(skipped, k) for k in keys] == [getattr(skipped_full, k) for k in keys]
    assert [_place(e) for e in sink.of(NonFiniteEvent)] == [_place(e) for e in full_sink.of(NonFiniteEvent)]
    for p, q in zip(model.parameters(), full_model.parameters()):  # the same steps skipped: the same weights
        assert torch.isfinite(p).all() and torch.equal(p, q)


class BnNet(nn.Module):
    """Batch statistics and dropout in train mode: what a replay must give back."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(16, 4)
        self.act = Exp()

    def forward(self, x, boost=1.0):
        return self.act(self.b(self.drop(self.bn(self.a(x)))) * boost)


def _bn_run(watched):
    """Batch BAD is a forward whose output overflows, not trained on; the run goes on after it."""
    torch.manual_seed(0)
    model = BnNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = Collect()
    g = torch.Generator().manual_seed(1)
    outs = []
    ctx = watch(model, sinks=[sink], every_n_batches=10, on_detect="report") if watched else contextlib.nullcontext()
    with ctx:
        for i in range(BATCHES + 2):
            x = torch.randn(4, 8, generator=g)
            if i == BAD:
                with torch.no_grad():
                    model(x, boost=1e3)
                continue
            opt.zero_grad()
            out = model(x)
            outs.append(out.detach())
            out.square().mean().backward()
            opt.step()
    return model, outs, torch.get_rng_state(), sink


def test_the_replay_gives_back_batch_norm_statistics_and_the_rng_stream():
    ref, ref_outs, ref_rng, _ = _bn_run(False)
    model, outs, rng, sink = _bn_run(True)
    (ev,) = sink.of(NonFiniteEvent)
    assert (ev.module, ev.tensor, ev.batch_number) == ("act", "output", BAD)  # localized: a replay ran
    for (name, v), (_, r) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(v, r), name  # running_mean/var, num_batches_tracked, weights
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))  # the dropout masks after it too
    assert torch.equal(rng, ref_rng)


class InPlace(ExpNet):
    def forward(self, x):
        x.mul_(1.0)  # the forward changes its input in place: a replay would not see the batch
        return super().forward(x)


def test_inputs_changed_in_place_are_not_replayed_and_the_event_stays_the_calls(caplog):
    MODELS["in_place"] = InPlace
    try:
        with caplog.at_level(logging.WARNING, logger="tensorwatch_otel"):
            sampled, sink, _ = _train("in_place", 10)
    finally:
        del MODELS["in_place"]
    ev = sampled.event
    assert (ev.module, ev.phase, ev.batch_number) == ("", "forward", BAD)  # the output's check, unlocalized
    assert ev.tensor == "output" and ev.kind in ("inf", "nan", "inf,nan")
    assert sink.of(NonFiniteEvent) == [ev]
    said = [r.getMessage() for r in caplog.records if "not replayed" in r.getMessage()]
    assert len(said) == 1 and "changed in place" in said[0]


@pytest.mark.parametrize("scenario", ["activation", "hidden_activation", "gradient"])
def test_a_model_called_inside_watcher_batch_blocks(scenario):
    full, _, _ = _train(scenario, 1, batch_blocks=True)
    sampled, _, _ = _train(scenario, 10, batch_blocks=True)
    assert full.event.batch_number == BAD
    assert _place(sampled.event) == _place(full.event)


def test_a_batch_block_that_calls_the_root_twice_replays_the_call_held_last():
    """Two root calls in one unsampled batch() block: the overflow is born in the second, whose
    inputs and RNG states are the ones held: its replay names the module, as full watching does."""
    places = []
    for every in (1, 10):
        torch.manual_seed(0)
        model = ClampedExpNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with watch(model, sinks=[Collect()], every_n_batches=every) as w:
            with pytest.raises(NonFiniteDetected) as ei:
                for x, y in _data("hidden_activation"):
                    with w.batch():
                        opt.zero_grad()
                        warm = model(x / 300 if x.abs().max() > 100 else x)  # a healthy call first
                        ((model(x) - y).square().mean() + warm.sum() * 0).backward()
                        opt.step()
        places.append(_place(ei.value.event))
    assert places[1] == places[0] == ("act", "output", "forward", BAD, "inf")


def test_the_jsonl_event_of_a_replayed_batch_carries_its_frames(tmp_path):
    path = tmp_path / "events.jsonl"
    sampled, _, _ = _train("hidden_activation", 10, sinks=[JsonlLog(str(path))])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    (ev,) = [d for d in lines if d["event"] == "nonfinite_detected"]
    assert (ev["module"], ev["tensor"], ev["batch_number"]) == ("act", "output", BAD)
    assert [f["module"] for f in ev["frames"]] == ["a", "b", "act"]
    assert ev["frames"][-1]["tensors"][-1] == {**ev["frames"][-1]["tensors"][-1], "name": "output", "abs_max": "inf"}


def test_rerun_on_detect_says_the_replayed_batch_reproduces():
    sampled, _, _ = _train("hidden_activation", 10, rerun_on_detect=True)
    assert _place(sampled.event)[:2] == ("act", "output")
    assert sampled.event.reproduced is True


def test_a_compiled_model_is_replayed_eagerly_and_named_as_in_eager_full_watching():
    """watch(torch.compile(model)) (the eager backend: seconds on a CPU); the replay runs the
    user's model eagerly with every module watched."""
    for scenario in ("activation", "hidden_activation"):
        full, _, _ = _train(scenario, 1)
        sampled, _, _ = _train(scenario, 10, compile_model=True, rerun_on_detect=True)
        assert _place(sampled.event) == _place(full.event)
        assert (sampled.event.reproduced, sampled.event.verdict) == (True, "model")


def test_healthy_unsampled_batches_replay_nothing_and_a_bad_one_is_replayed_once(monkeypatch):
    from tensorwatch_otel.core.batch import detection

    calls = []
    localize = detection.localize
    monkeypatch.setattr(detection, "localize", lambda *a: calls.append(a[2]) or localize(*a))
    raised, sink, _ = _train("activation", 10, on_detect="raise")
    assert raised is not None and calls == [BAD]
    calls.clear()
    raised, sink, _ = _train("activation", 10, on_detect="raise", max_frames=1)
    assert [f.module for f in raised.event.frames] == ["act"] and calls == [BAD]  # the replay keeps max_frames


@pytest.mark.parametrize("scenario", ["hidden_activation", "gradient"])
def test_gradients_true_still_guards_the_unsampled_batches_steps(scenario):
    """gradients=True records the gradients of the recorded batches only: the step guard reads
    the others' (before, an unsampled batch's bad gradient reached the weights unseen)."""
    full, _, _ = _train(scenario, 1)
    sampled, _, _ = _train(scenario, 10, gradients=True)
    assert sampled is not None
    assert _place(sampled.event) == _place(full.event)


@pytest.mark.parametrize("fused", [(), ("cpu",)])  # ("cpu",): the path CUDA tensors take, run here on the CPU
def test_the_output_check_reads_the_loss_alone_when_there_is_one(fused):
    from dataclasses import dataclass

    from tensorwatch_otel.core.frames.finite import all_finite, output_tensors

    @dataclass
    class Out:
        loss: torch.Tensor
        logits: torch.Tensor

    loss, logits = torch.tensor(0.5), torch.full((2, 3), INF)
    for out in ({"loss": loss, "logits": logits}, Out(loss, logits)):
        (t,) = output_tensors(out)
        assert t.data_ptr() == loss.data_ptr()  # the logits are not read: the loss was computed from them
        assert all_finite([t], fused)
    ids = torch.ones(2, dtype=torch.long)
    found = output_tensors((logits.half(), [loss, ids], {"loss": None, "h": loss.double()}))
    assert [t.dtype for t in found] == [torch.float16, torch.float32, torch.float64]  # no integer tensor
    assert not all_finite(found, fused)
    assert all_finite(found[1:], fused) and all_finite([], fused)
    nan = torch.zeros(4, 4)[:, 1]  # (not contiguous: measured apart from the kernel's batch)
    nan[2] = float("nan")
    assert not all_finite([loss, nan], fused)


@pytest.mark.parametrize("labels", [False, True])
def test_a_transformers_fp16_overflow_in_an_unsampled_batch_is_named_at_its_module(labels):
    """A real GPT-2 (tiny, fp16): a Conv1D whose output overflows, in an unsampled batch; its
    ModelOutput is checked (the loss alone when given labels, else the logits) and replayed."""
    pytest.importorskip("transformers")
    from _models import OVERFLOW_AT, batches, build, inject_overflow

    places = []
    for every in (1, 10):
        model = build("gpt2", torch.float16)
        with watch(model, sinks=[Collect()], every_n_batches=every):
            with pytest.raises(NonFiniteDetected) as ei:
                for i, kw in enumerate(batches("gpt2", BATCHES)):
                    if i == BAD:
                        inject_overflow(model, OVERFLOW_AT["gpt2"])
                    with torch.no_grad():
                        model(**(dict(kw, labels=kw["input_ids"]) if labels else kw))
        places.append(_place(ei.value.event))
    assert places[1] == places[0]
    assert places[0][:4] == (OVERFLOW_AT["gpt2"], "output", "forward", BAD)


def test_a_submodule_called_directly_is_checked_but_not_replayed(caplog):
    """A batch that is one call of a submodule: its output is checked; the root's inputs were
    not held for it, so the event is that call's own frame."""
    torch.manual_seed(0)
    model = ExpNet()
    x = torch.randn(4, 16) * 300
    with caplog.at_level(logging.WARNING, logger="tensorwatch_otel"):
        with watch(model, sinks=[Collect()], every_n_batches=10) as w:
            for _ in range(3):
                model(torch.randn(4, 8))
            with pytest.raises(NonFiniteDetected) as ei:
                model.act(x)  # batch 3: the submodule alone
            assert w.batch_number == 4
    assert _place(ei.value.event)[:4] == ("act", "output", "forward", 3)
    assert any("not held" in r.getMessage() for r in caplog.records)
