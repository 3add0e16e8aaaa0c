"""A copy of a watched model is not watched (issue 28): copy.deepcopy (EMA, AveragedModel),
pickle and torch.save work, the copy's calls are not the original's batches, and detach()
leaves no hook on the original or on its copies. The same for the drop-in."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel

from _collect import Collect
from _hooks import remaining_hooks
from _models import TwoLinear as Net
from tensorwatch_otel import DebugUnderflowOverflow, NonFiniteDetected, NonFiniteEvent, watch


def _train(model, steps, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _round_trip(model, how):
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


OPTIONS = [{}, {"gradients": True}, {"every_n_batches": 3}, {"capture_dir": "CAPTURE"}, {"optimizer_state": True}]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "defaults")
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_watched_model_saves_and_loads_unwatched(options, how, tmp_path):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 8)
    options = {k: (str(tmp_path) if v == "CAPTURE" else v) for k, v in options.items()}
    sink = Collect()
    w = watch(model, sinks=[sink], **options)
    _train(model, 4, x)
    loaded = _round_trip(model, how)
    before = w.batch_number
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))  # the same weights, and it runs
    assert w.batch_number == before + 1  # the original's call only
    assert _hooks(loaded) == 0  # its first call took what the save carried off
    assert remaining_hooks(loaded) == {}
    with torch.no_grad():
        loaded.a.weight[0, 0] = math.inf
        loaded(x)  # not watched: nothing is detected, nothing counted
    assert w.batch_number == before + 1 and sink.of(NonFiniteEvent) == []
    w.detach()
    assert remaining_hooks(model) == {} and remaining_hooks(loaded) == {}


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "defaults")
def test_an_ema_copy_is_not_watched(options, tmp_path):
    """5 steps and 5 evaluations of a deep copy (an EMA) are 5 batches; an inf in the copy's
    weight is no detection of the original's; the original stays watched."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 8)
    options = {k: (str(tmp_path) if v == "CAPTURE" else v) for k, v in options.items()}
    sink = Collect()
    w = watch(model, sinks=[sink], **options)
    ema = copy.deepcopy(model)
    for _ in range(5):
        _train(model, 1, x)
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.mul_(0.9).add_(pm, alpha=0.1)
            ema(x)
    assert w.batch_number == 5
    assert _hooks(ema) == 0  # its first call took the copied ones off
    every = options.get("every_n_batches", 1)
    forward = [b for b in sink.batches if b.phase == "forward"]
    assert [b.batch_number for b in forward] == list(range(0, 5, every))
    assert all([f.module for f in b.frames] == ["a", "b", ""] for b in forward)
    with torch.no_grad():
        ema.b.weight[0, 0] = math.inf
        ema(x)
    assert w.batch_number == 5 and sink.of(NonFiniteEvent) == []
    with torch.no_grad():
        model.b.weight[0, 0] = math.inf
    with pytest.raises(NonFiniteDetected) as info:
        model(x)  # (an unsampled batch's output is checked, and a replay names the module)
    event = info.value.event
    assert (event.module, event.tensor, event.kind) == ("b", "weight", "inf")
    assert event.batch_number == 5
    w.detach()
    assert remaining_hooks(model) == {} and remaining_hooks(ema) == {}


def test_averaged_model_of_a_model_watched_with_a_capture_dir(tmp_path):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 8)
    w = watch(model, sinks=[Collect()], capture_dir=str(tmp_path), gradients=True)
    swa = AveragedModel(model)
    snapshots = []
    for _ in range(3):
        _train(model, 1, x)
        swa.update_parameters(model)
        snapshots.append([p.detach().clone() for p in model.parameters()])
    with torch.no_grad():
        swa(x)
    assert w.batch_number == 3  # the three training steps: the average's call is not one
    mean = [torch.stack(ps).mean(0) for ps in zip(*snapshots)]
    assert all(torch.allclose(a, m) for a, m in zip(swa.module.parameters(), mean))
    assert remaining_hooks(swa) == {}
    w.detach()
    assert remaining_hooks(model) == {}


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save", "weights_only"])
def test_a_copy_or_a_save_of_a_watched_model_scripts(how):
    """An EMA's deep copy, or a model saved whole while watched, is a plain model before any
    call: torch.jit.script compiles it (it compiles every forward hook a module holds, and
    found the copied ones: 'Unwatched' object has no attribute '__name__')."""
    from tensorwatch_otel.core.frames.copies import Unwatched

    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 8)
    w = watch(model, sinks=[Collect()], gradients=True, every_n_batches=2)
    _train(model, 2, x)
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    elif how == "weights_only":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        with torch.serialization.safe_globals([Net, nn.Linear, Unwatched]):
            copied = torch.load(buf, weights_only=True)
    else:
        copied = _round_trip(model, how)
    assert _hooks(copied) == 0  # nothing of the watcher's, before any call
    scripted = torch.jit.script(copied)
    with torch.no_grad():
        assert torch.equal(scripted(x), model(x))
    assert w.batch_number == 3  # the original's call only
    assert _hooks(model) > 0  # still watched
    w.detach()
    assert remaining_hooks(model) == {}


def test_detach_takes_the_hooks_off_copies_never_called():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 8)
    w = watch(model, sinks=[Collect()], gradients=True)
    model(x)
    copies = [copy.deepcopy(model), copy.deepcopy(nn.Sequential(model))[0]]
    assert [_hooks(c) for c in copies] == [0, 0]  # taken off as each copy was complete
    memo = {}
    kept = copy.deepcopy(model, memo)  # a memo the caller keeps: what torch copied stays until...
    assert _hooks(kept) > 0
    before = w.batch_number
    twice = copy.deepcopy(kept)  # a copy of a copy, and a pickle of one, work too
    pickled = pickle.loads(pickle.dumps(kept))
    w.detach()  # ...detach(), or the copy's first call
    assert remaining_hooks(model) == {}
    assert [remaining_hooks(c) for c in copies + [kept]] == [{}, {}, {}]
    twice(x), pickled(x)
    assert (_hooks(twice), _hooks(pickled)) == (0, 0) and w.batch_number == before
    del memo


def test_a_copy_can_be_watched_on_its_own():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 8)
    a, b = Collect(), Collect()
    w = watch(model, sinks=[a])
    twin = copy.deepcopy(model)
    w2 = watch(twin, sinks=[b])
    model(x)
    twin(x), twin(x)
    assert (w.batch_number, w2.batch_number) == (1, 2)
    assert (len(a.batches), len(b.batches)) == (1, 2)
    w.detach()
    twin(x)
    assert w2.batch_number == 3
    w2.detach()
    assert remaining_hooks(twin) == {}


@pytest.mark.parametrize("trace", [None, [1]])
def test_the_dropin_behaves_the_same(trace, capsys):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 8)
    debug = DebugUnderflowOverflow(model, trace_batch_nums=trace)
    model(x)
    ema = copy.deepcopy(model)
    saved = _round_trip(model, "torch.save")
    for _ in range(3):
        ema(x), saved(x)
    assert debug.batch_number == 1
    assert _hooks(ema) == 0 and _hooks(saved) == 0
    model(x)  # batch 1: traced when asked
    assert debug.batch_number == 2
    if trace:
        assert "abs min  abs max  metadata" in capsys.readouterr().out
    late = copy.deepcopy(model)
    debug.detach()
    assert remaining_hooks(model) == {} and remaining_hooks(late) == {}
