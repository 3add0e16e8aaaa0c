"""Behaviour of the watcher core on tiny real models: frames, names and values, exact detection
with its ring buffer, batch numbering, options, hook lifetime, and robustness."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

import tensorwatch_otel
import tensorwatch_otel.core.frames.recorder as watcher_mod
from tensorwatch_otel.core.batch.thread_batch import Phase
from tensorwatch_otel.core.measure.weights import WeightTable
import tensorwatch_otel.core.watcher as watcher_core
from tensorwatch_otel import (
    AbortAfterBatch,
    AbortAfterBatchEvent,
    BatchTraceEvent,
    NonFiniteDetected,
    NonFiniteEvent,
    watch,
)
from tensorwatch_otel.sinks import Sink
from tensorwatch_otel.core.measure.host_batch import HostBatch
from _collect import Collect



def count_measured(monkeypatch, into: list) -> None:
    """Every tensor the recorder measures goes into `into`: through `measure`, gathered for
    a frame's one kernel call (HostBatch.add accepting it), or read with the weight table."""
    real = watcher_mod.measure
    monkeypatch.setattr(watcher_mod, "measure", lambda t: into.append(t) or real(t))
    real_add = HostBatch.add

    def add(self, t):
        took = real_add(self, t)
        if took and self is not None:
            into.append(t)
        return took
    monkeypatch.setattr(HostBatch, "add", add)
    real_state = WeightTable.state

    def state(self):  # a read of the weight table measures every row
        fresh = self._state is None
        st = real_state(self)
        if fresh and st is not None:
            into.extend(self._tensors)
        return st
    monkeypatch.setattr(WeightTable, "state", state)

def amm(t):
    """abs min and abs max computed independently of the watcher."""
    a = t.detach().abs()
    return a.min().item(), a.max().item()


def stats_of(frame):
    return {t.name: (t.abs_min, t.abs_max) for t in frame.tensors}


# ----------------------------------------------------------------------------- models
class KwOnly(nn.Module):
    def forward(self, x, *, scale):
        return x * scale


class Pair(nn.Module):
    def forward(self, x):
        return x + 1, x * 3


class Nested(nn.Module):
    def forward(self, x):
        return (x - 1, x * 2), [x * 4, x - 5]


class DictOut(nn.Module):
    def forward(self, x):
        return {"logits": x * 7, "hidden": x - 2}


@dataclasses.dataclass
class DCOutput:
    logits: torch.Tensor
    extra: object = None


class DataclassOut(nn.Module):
    def forward(self, x):
        return DCOutput(logits=x / 3, extra=None)


class ModelOutputOut(nn.Module):
    def forward(self, x):
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=x * 0.5)


class Everything(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.act = nn.Tanh()
        self.kw = KwOnly()
        self.pair = Pair()
        self.nested = Nested()
        self.dictout = DictOut()
        self.dc = DataclassOut()
        self.mo = ModelOutputOut()

    def forward(self, x, mask=None):
        h = self.act(self.lin(x))
        h = self.kw(h, scale=mask)
        a, b = self.pair(h)
        (n0, _), _ = self.nested(a)
        d = self.dictout(b)
        c = self.dc(d["logits"])
        m = self.mo(c.logits + n0)
        return m.last_hidden_state


class Capture:
    """Independent record of what each module received and returned (clones), in call order."""

    def __init__(self, model):
        self.calls = []
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_hook(self._hook(name), with_kwargs=True))

    def _hook(self, name):
        def hook(mod, args, kwargs, out):
            clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            self.calls.append((name, [clone(a) for a in args], {k: clone(v) for k, v in kwargs.items()}, out))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def test_frames_names_and_values_for_every_module():
    torch.manual_seed(0)
    model = Everything()
    cap = Capture(model)  # registered first: sees the same values the watcher sees
    sink = Collect()
    x = torch.randn(2, 4)
    mask = torch.full((2, 3), -2.5)
    with watch(model, sinks=[sink]):
        out = model(x, mask=mask)
    cap.remove()
    (batch,) = sink.batches
    frames = batch.frames
    assert [f.module for f in frames] == ["lin", "act", "kw", "pair", "nested", "dictout", "dc", "mo", ""]
    assert [f.module_class for f in frames] == ["Linear", "Tanh", "KwOnly", "Pair", "Nested", "DictOut",
                                                "DataclassOut", "ModelOutputOut", "Everything"]
    assert frames[0].batch_start and not any(f.batch_start for f in frames[1:])
    assert all(f.batch_number == 0 and f.phase == "forward" for f in frames)
    calls = {name: (args, kwargs, o) for name, args, kwargs, o in cap.calls}

    expected = {
        "lin": {"weight": model.lin.weight, "bias": model.lin.bias, "input[0]": x,
                "output": calls["lin"][2]},
        "act": {"input[0]": calls["act"][0][0], "output": calls["act"][2]},
        "kw": {"input[0]": calls["kw"][0][0], "input.scale": mask, "output": calls["kw"][2]},
        "pair": {"input[0]": calls["pair"][0][0], "output[0]": calls["pair"][2][0],
                 "output[1]": calls["pair"][2][1]},
        "nested": {"input[0]": calls["nested"][0][0], "output[0][0]": calls["nested"][2][0][0],
                   "output[0][1]": calls["nested"][2][0][1], "output[1][0]": calls["nested"][2][1][0],
                   "output[1][1]": calls["nested"][2][1][1]},
        "dictout": {"input[0]": calls["dictout"][0][0], "output.logits": calls["dictout"][2]["logits"],
                    "output.hidden": calls["dictout"][2]["hidden"]},
        "dc": {"input[0]": calls["dc"][0][0], "output.logits": calls["dc"][2].logits},
        "mo": {"input[0]": calls["mo"][0][0], "output.last_hidden_state": calls["mo"][2].last_hidden_state},
        "": {"input[0]": x, "input.mask": mask, "output": out},
    }
    for f in frames:
        want = {name: amm(t) for name, t in expected[f.module].items()}
        got = {t.name: (t.abs_min, t.abs_max) for t in f.tensors if not t.note}
        assert got == want, f.module
        for t in f.tensors:
            if not t.note:
                assert t.dtype == "float32"
                assert t.range_used == pytest.approx(t.abs_max / torch.finfo(torch.float32).max)
    dc = frames[6]
    assert [(t.name, t.note, t.abs_min) for t in dc.tensors if t.note] == [("output.extra", "None", None)]
    # report order: parameters, positional inputs, keyword inputs, outputs
    assert [t.name for t in frames[0].tensors] == ["weight", "bias", "input[0]", "output"]
    assert [t.name for t in frames[2].tensors] == ["input[0]", "input.scale", "output"]
    assert [t.name for t in frames[-1].tensors] == ["input[0]", "input.mask", "output"]


# ----------------------------------------------------------------------------- detection
class Blow(nn.Module):
    """A real float32 overflow: finite input and factor, inf output (when armed)."""

    def __init__(self):
        super().__init__()
        self.factor = nn.Parameter(torch.tensor(1e30))
        self.armed = False

    def forward(self, x):
        return x * self.factor * self.factor if self.armed else x + 0.0


class NanMaker(nn.Module):
    """sqrt of a negative number: NaN output from finite input (when armed)."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return torch.sqrt(x - 1e6) if self.armed else x * 1.0


class Chain(nn.Module):
    def __init__(self, bad=None):
        super().__init__()
        self.l0 = nn.Linear(3, 3)
        self.l1 = nn.Linear(3, 3)
        self.bad = bad if bad is not None else nn.Identity()
        self.l2 = nn.Linear(3, 3)

    def forward(self, x):
        return self.l2(self.bad(self.l1(self.l0(x))))


CHAIN_ORDER = ["l0", "l1", "bad", "l2", ""]


def test_detection_exact_frame_and_ring_across_batch_boundary():
    torch.manual_seed(0)
    model = Chain(Blow())
    sink = Collect()
    w = watch(model, sinks=[sink], max_frames=6)
    x = torch.randn(2, 3)
    model(x)
    model(x)  # batch 1, clean
    model.bad.armed = True
    with pytest.raises(NonFiniteDetected) as ei:
        model(x)  # batch 2: inf appears in bad's output
    assert isinstance(ei.value, ValueError)
    ev = ei.value.event
    assert isinstance(ev, NonFiniteEvent)
    assert (ev.module, ev.module_class, ev.tensor, ev.kind, ev.batch_number) == ("bad", "Blow", "output", "inf", 2)
    assert sink.of(NonFiniteEvent) == [ev]
    # ring: the last 6 frames ending at the first bad frame: 3 of batch 1, then l0, l1, bad of batch 2
    assert [(f.module, f.batch_number) for f in ev.frames] == [
        ("bad", 1), ("l2", 1), ("", 1), ("l0", 2), ("l1", 2), ("bad", 2)]
    assert [f.batch_start for f in ev.frames] == [False, False, False, True, False, False]
    last = ev.frames[-1]
    assert stats_of(last)["factor"] == (1e30, 1e30) or math.isclose(stats_of(last)["factor"][0], 1e30, rel_tol=1e-7)
    assert math.isfinite(stats_of(last)["input[0]"][1])
    assert stats_of(last)["output"][1] == math.inf
    assert last.first_nonfinite().name == "output"
    for f in ev.frames[:-1]:
        assert f.kind == ""
    # the watcher stays usable after the exception was caught
    model.bad.armed = False
    model(x)
    assert w.batch_number == 4
    w.detach()


def test_ring_is_bounded_and_within_batch():
    model = Chain(NanMaker())
    model.bad.armed = True
    sink = Collect()
    with watch(model, sinks=[sink], max_frames=2):
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.randn(2, 3))
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind, ev.batch_number) == ("bad", "output", "nan", 0)
    assert [f.module for f in ev.frames] == ["l1", "bad"]
    assert math.isnan(stats_of(ev.frames[-1])["output"][0])


def test_first_nonfinite_parameter_is_named():
    model = Chain()
    with torch.no_grad():
        model.l1.bias[1] = float("nan")
    with watch(model, sinks=[Collect()]):
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.randn(2, 3))
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind) == ("l1", "bias", "nan")


def test_report_mode_continues_and_reports_each_affected_batch():
    model = Chain(Blow())
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report")
    x = torch.randn(2, 3)
    for b in range(5):
        model.bad.armed = b in (1, 3)
        model(x)
    evs = sink.of(NonFiniteEvent)
    assert [(e.batch_number, e.module, e.tensor) for e in evs] == [(1, "bad", "output"), (3, "bad", "output")]
    assert w.batch_number == 5 and w.detections == 2
    w.detach()


# ----------------------------------------------------------------------------- batches
class Recursive(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, depth=2):
        x = self.lin(x)
        return self(x, depth - 1) if depth > 0 else x


def test_batch_numbering_root_forward_recursive_and_eval():
    model = Recursive()
    sink = Collect()
    w = watch(model, sinks=[sink])
    x = torch.randn(2, 3)
    assert w.batch_number == 0
    model(x)  # the root calls itself twice: one batch
    assert w.batch_number == 1
    model.eval()
    with torch.no_grad():
        model(x, depth=0)
    assert w.batch_number == 2
    model.lin(x)  # a submodule called on its own is the outermost watched call: a batch of its own
    assert w.batch_number == 3
    assert [b.batch_number for b in sink.batches] == [0, 1, 2]
    assert [f.module for f in sink.batches[2].frames] == ["lin"]
    # frames in the order the forwards finish: the innermost root call first
    assert [f.module for f in sink.batches[0].frames] == ["lin", "lin", "lin", "", "", ""]
    w.detach()


def test_trace_batches_gives_every_frame():
    model = Chain()
    sink = Collect()
    with watch(model, sinks=[sink], trace_batches=[1, 3]):
        x = torch.randn(2, 3)
        for _ in range(3):
            model(x)
    traces = sink.of(BatchTraceEvent)
    assert [t.batch_number for t in traces] == [1]
    assert [f.module for f in traces[0].frames] == CHAIN_ORDER
    assert all(f.batch_number == 1 for f in traces[0].frames)
    assert stats_of(traces[0].frames[0])["input[0]"] == amm(x)
    assert stats_of(traces[0].frames[0])["weight"] == amm(model.l0.weight)


def test_abort_after_batch():
    model = Chain()
    sink = Collect()
    w = watch(model, sinks=[sink], abort_after_batch=1)
    x = torch.randn(2, 3)
    model(x)
    with pytest.raises(AbortAfterBatch) as ei:
        model(x)
    assert isinstance(ei.value, ValueError)
    assert [e.batch_number for e in sink.of(AbortAfterBatchEvent)] == [1]
    assert w.batch_number == 2
    w.detach()


def test_every_n_batches_samples_and_traced_batches_always_watched(monkeypatch):
    model = Chain()
    sink = Collect()
    calls = []
    count_measured(monkeypatch, calls)
    w = watch(model, sinks=[sink], every_n_batches=3, trace_batches=[4])
    x = torch.randn(2, 3)
    per_batch = []
    for _ in range(7):
        n = len(calls)
        model(x)
        per_batch.append(len(calls) - n)
    assert [b.batch_number for b in sink.batches] == [0, 3, 4, 6]
    assert [t.batch_number for t in sink.of(BatchTraceEvent)] == [4]
    assert per_batch[1] == per_batch[2] == per_batch[5] == 0
    assert all(per_batch[b] > 0 for b in (0, 3, 4, 6))
    w.detach()


def test_every_n_batches_unwatched_batch_is_checked_and_localized_by_a_replay():
    model = Chain(Blow())
    sink = Collect()
    w = watch(model, sinks=[sink], every_n_batches=2, on_detect="report")
    x = torch.randn(2, 3)
    model(x)
    model.bad.armed = True
    model(x)  # batch 1: not watched; its output is checked, and the replay names the module
    model(x)  # batch 2: watched
    events = sink.of(NonFiniteEvent)
    assert [e.batch_number for e in events] == [1, 2]
    assert [(e.module, e.tensor, e.phase) for e in events] == [("bad", "output", "forward")] * 2
    assert [b.batch_number for b in sink.batches] == [0, 2]  # statistics of the watched batches only
    w.detach()


@pytest.mark.parametrize("include,exclude,expected", [
    (["l*"], None, ["l0", "l1", "l2"]),
    (None, ["l1", "bad"], ["l0", "l2", ""]),
    ("l[02]", None, ["l0", "l2"]),
    (None, "(root)", ["l0", "l1", "bad", "l2"]),
])
def test_include_exclude_globs(include, exclude, expected):
    model = Chain()
    sink = Collect()
    w = watch(model, sinks=[sink], include=include, exclude=exclude)
    model(torch.randn(2, 3))
    model(torch.randn(2, 3))
    assert w.batch_number == 2  # the root is always hooked for batch numbering
    assert [f.module for f in sink.batches[1].frames] == expected
    w.detach()


# ----------------------------------------------------------------------------- lifetime
def _all_hooks(model):
    n = 0
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_with_kwargs)
        n += len(m._forward_hooks_always_called)
        for p in m.parameters(recurse=False):
            n += len(p._post_accumulate_grad_hooks or {})
    return n


def test_detach_removes_every_hook_and_is_idempotent():
    model = Chain()
    w = watch(model, sinks=[Collect()], gradients=True)
    assert _all_hooks(model) > 0
    model(torch.randn(2, 3)).sum().backward()
    w.detach()
    assert _all_hooks(model) == 0
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    w.detach()
    model(torch.randn(2, 3))
    assert w.batch_number == 1
    assert w not in watcher_core.ACTIVE


def test_context_manager_detaches_even_on_exception():
    model = Chain(Blow())
    model.bad.armed = True
    with pytest.raises(NonFiniteDetected):
        with watch(model, sinks=[Collect()]) as w:
            assert isinstance(w, tensorwatch_otel.Watcher)
            model(torch.randn(2, 3))
    assert _all_hooks(model) == 0


class Flaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("boom")
        return x


def test_forward_that_raises_leaves_watcher_consistent():
    model = Chain(Flaky())
    sink = Collect()
    w = watch(model, sinks=[sink])
    x = torch.randn(2, 3)
    model.bad.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    assert w.batch_number == 1  # the failed batch counts
    failed = sink.batches[0].frames
    assert [f.module for f in failed] == ["l0", "l1", "bad", ""]
    assert [(t.name, t.note) for t in failed[2].tensors] == [("input[0]", ""), ("output", "None")]
    model.bad.fail = False
    model(x)
    assert w.batch_number == 2
    assert [f.module for f in sink.batches[1].frames] == CHAIN_ORDER
    assert sink.batches[1].frames[0].batch_number == 1
    w.detach()


def test_weights_reused_only_in_no_grad_batches_until_changed(monkeypatch):
    torch.manual_seed(0)
    model = Chain()
    measured = []
    count_measured(monkeypatch, measured)
    sink = Collect()
    w = watch(model, sinks=[sink])
    params = {id(p) for p in model.parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(2, 3)

    def step(train):
        measured.clear()
        with torch.set_grad_enabled(train):
            out = model(x)
        if train:
            opt.zero_grad()
            out.square().sum().backward()
            opt.step()
        return sum(id(t) in params for t in measured)

    assert step(train=True) == 6  # first batch: every weight and bias
    assert step(train=False) == 6  # the optimizer step changed them all
    assert step(train=False) == 0  # unchanged since: served from the cache
    assert stats_of(sink.batches[2].frames[0])["weight"] == amm(model.l0.weight)
    with torch.no_grad():
        model.l1.weight.mul_(2)
    assert step(train=False) == 1
    assert stats_of(sink.batches[3].frames[1])["weight"] == amm(model.l1.weight)
    assert step(train=True) == 6  # a training batch always reads live weights
    w.detach()


class InplaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(3, 8)
        self.relu = nn.ReLU(inplace=True)
        self.l2 = nn.Linear(8, 3)
        self.l3 = nn.Linear(3, 3)

    def forward(self, x):
        h = self.relu(self.l1(x))
        y = self.l2(h)
        return self.l3(y)


def test_tensor_seen_twice_measured_once_and_inplace_measured_again(monkeypatch):
    torch.manual_seed(0)
    model = InplaceNet()
    with torch.no_grad():
        model.l1.bias.copy_(torch.tensor([-5.0, 5.0] * 4))  # some pre-relu values are negative
    measured = []
    count_measured(monkeypatch, measured)
    sink = Collect()
    cap = Capture(model)
    x = torch.randn(4, 3)
    with watch(model, sinks=[sink]):
        model(x)
    cap.remove()
    calls = {name: (args, out) for name, args, _, out in cap.calls}
    y = calls["l2"][1]
    assert sum(t is y for t in measured) == 1  # l2 output == l3 input: measured once
    h = calls["relu"][1]
    assert sum(t is h for t in measured) == 2  # l1 output, then again after the in-place ReLU
    f = {fr.module: stats_of(fr) for fr in sink.batches[0].frames}
    assert f["l3"]["input[0]"] == f["l2"]["output"] == amm(y)
    assert f["l2"]["input[0]"] == amm(torch.relu(calls["l2"][0][0]))
    assert f["l2"]["input[0]"][0] == 0.0  # not the stale pre-relu statistics
    assert f["l1"]["output"][0] > 0.0


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(self.lin(x) * 10)


def test_shared_module_called_twice_gives_two_frames():
    model = Shared()
    sink = Collect()
    x = torch.randn(2, 3)
    with watch(model, sinks=[sink]):
        model(x)
    frames = sink.batches[0].frames
    assert [f.module for f in frames] == ["lin", "lin", ""]
    first = model.lin(x)
    assert stats_of(frames[0])["output"] == amm(first)
    assert stats_of(frames[1])["input[0]"] == amm(first * 10)


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, self.inp(x), use_reentrant=False)
        return self.out(h)


def test_activation_checkpointing_recompute_adds_no_frames():
    model = Checkpointed()
    sink = Collect()
    w = watch(model, sinks=[sink])
    x = torch.randn(2, 3)
    names = ["inp", "block.0", "block.1", "block.2", "block", "out", ""]
    for _ in range(2):
        model(x).sum().backward()
    assert model.block[0].weight.grad is not None
    assert [[f.module for f in b.frames] for b in sink.batches] == [names, names]
    assert w._session.life.phase is Phase.IDLE  # no batch begun (nothing recorded) during backward
    w.detach()


class WhereSqrt(nn.Module):
    """The classic NaN gradient: torch.where over sqrt of a negative; the forward is finite."""

    def forward(self, x):
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))


class GradNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.ws = WhereSqrt()
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.ws(self.lin(x)))


def test_gradients_nan_gradient_detected_when_the_step_would_consume_it():
    torch.manual_seed(0)
    model = GradNet()
    with torch.no_grad():
        model.lin.weight.fill_(0.5)
        model.lin.bias.copy_(torch.tensor([-10.0, 1.0, 1.0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    sink = Collect()
    x = torch.rand(2, 3)
    with watch(model, sinks=[sink], gradients=True):
        loss = model(x).sum()  # forward is finite: no detection here
        assert sink.of(NonFiniteEvent) == []
        loss.backward()  # a non-finite gradient alone is no detection (a scaler may skip it)
        assert sink.of(NonFiniteEvent) == []
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step never ran
    ev = ei.value.event
    assert ev.phase == "backward"
    assert ev.frames[-1].phase == "backward"
    # the NaN is born in the backward of `ws` (sqrt of a masked-out negative): named there,
    # at its input's gradient, not at whichever parameter happened to receive it
    assert (ev.module, ev.module_class, ev.tensor, ev.kind, ev.batch_number) == \
        ("ws", "WhereSqrt", "input[0].grad", "nan", 0)
    assert torch.isnan(model.lin.bias.grad).any()
    assert sink.of(NonFiniteEvent) == [ev]


def test_gradients_finite_backward_reports_nothing():
    model = GradNet()
    sink = Collect()
    with watch(model, sinks=[sink], gradients=True):
        with torch.no_grad():
            model.lin.bias.fill_(5.0)
            model.lin.weight.fill_(0.1)
        model(torch.rand(2, 3)).sum().backward()
    assert sink.of(NonFiniteEvent) == []


class Sentinel(nn.Module):
    def __init__(self):
        super().__init__()
        self.ran = 0

    def forward(self, x):
        self.ran += 1
        return x


def test_check_module_raises_inside_the_module():
    model = nn.Sequential(nn.Linear(3, 3), NanMaker(), Sentinel())
    model[1].armed = True
    w = watch(model, sinks=[Collect()], check="module")
    with pytest.raises(NonFiniteDetected) as ei:
        model(torch.randn(2, 3))
    assert model[2].ran == 0  # raised before the next module ran
    ev = ei.value.event
    assert (ev.module, ev.module_class, ev.tensor, ev.kind) == ("1", "NanMaker", "output", "nan")
    assert w.batch_number == 1
    model[1].armed = False
    model(torch.randn(2, 3))
    assert w.batch_number == 2
    w.detach()


class RootNan(nn.Module):
    """The root itself produces the NaN (no submodule sees it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.armed = True

    def forward(self, x):
        h = self.lin(x)
        return torch.sqrt(h - 100) if self.armed else h


@pytest.mark.parametrize("check", ["batch", "module"])
def test_detection_in_root_keeps_batch_numbering(check):
    model = RootNan()
    sink = Collect()
    w = watch(model, sinks=[sink], check=check)
    with pytest.raises(NonFiniteDetected) as ei:
        model(torch.randn(2, 3))
    assert (ei.value.event.module, ei.value.event.tensor) == ("", "output")
    assert w.batch_number == 1
    model.armed = False
    model(torch.randn(2, 3))
    assert w.batch_number == 2
    model(torch.randn(2, 3))
    assert w.batch_number == 3
    w.detach()


@pytest.mark.parametrize("check", ["batch", "module"])
def test_report_mode_one_event_per_batch(check):
    """NaN spreads into every later frame; the event names where it appeared, once a batch."""
    model = nn.Sequential(nn.Linear(3, 3), NanMaker(), nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].armed = True
    sink = Collect()
    w = watch(model, sinks=[sink], check=check, on_detect="report")
    for _ in range(2):
        model(torch.randn(2, 3))
    evs = sink.of(NonFiniteEvent)
    assert [(e.batch_number, e.module, e.tensor) for e in evs] == [(0, "1", "output"), (1, "1", "output")]
    w.detach()


@pytest.mark.parametrize("kwargs,option", [
    ({"on_detect": "ignore"}, "on_detect"),
    ({"max_frames": 0}, "max_frames"),
    ({"max_frames": "3"}, "max_frames"),
    ({"every_n_batches": 0}, "every_n_batches"),
    ({"every_n_batches": 1.5}, "every_n_batches"),
    ({"trace_batches": [-1]}, "trace_batches"),
    ({"trace_batches": 3.0}, "trace_batches"),
    ({"abort_after_batch": -1}, "abort_after_batch"),
    ({"check": "step"}, "check"),
    ({"gradients": "yes"}, "gradients"),
    ({"include": 3}, "include"),
    ({"exclude": [None]}, "exclude"),
    ({"flush_timeout_s": -1}, "flush_timeout_s"),
    ({"flush_timeout_s": float("inf")}, "flush_timeout_s"),  # no flush takes an endless timeout
    ({"flush_timeout_s": float("nan")}, "flush_timeout_s"),
    ({"sinks": [object()]}, "sinks"),
])
def test_config_errors_name_the_option(kwargs, option):
    model = Chain()
    with pytest.raises((ValueError, TypeError), match=option):
        watch(model, **kwargs)
    assert _all_hooks(model) == 0


def test_non_module_is_rejected():
    with pytest.raises(TypeError, match="model"):
        watch(lambda x: x)


class BrokenSink(Sink):
    wants_batches = True

    def on_batch(self, stats):
        raise OSError("disk full")

    def on_event(self, event):
        raise OSError("socket closed")


def test_failing_sink_logged_once_and_training_goes_on(caplog):
    model = Chain()
    good = Collect()
    with caplog.at_level(logging.ERROR, logger="tensorwatch_otel"):
        w = watch(model, sinks=[BrokenSink(), good], trace_batches=range(10))
        for _ in range(4):
            model(torch.randn(2, 3))
        w.detach()
    records = [r for r in caplog.records if "BrokenSink" in r.getMessage()]
    assert len([r for r in records if "on_batch" in r.getMessage()]) == 1
    assert len([r for r in records if "on_event" in r.getMessage()]) == 1
    assert w.sink_failures == {"BrokenSink.on_batch": 4, "BrokenSink.on_event": 4}
    assert len(good.batches) == 4 and len(good.of(BatchTraceEvent)) == 4  # later sinks still served


def test_failing_sink_still_raises_detection():
    model = Chain(Blow())
    model.bad.armed = True
    good = Collect()
    with watch(model, sinks=[BrokenSink(), good]):
        with pytest.raises(NonFiniteDetected):
            model(torch.randn(2, 3))
    assert len(good.of(NonFiniteEvent)) == 1


def test_strict_raises_sink_errors():
    model = Chain()
    with watch(model, sinks=[BrokenSink()], strict=True):
        with pytest.raises(OSError, match="disk full"):
            model(torch.randn(2, 3))


def test_ring_after_a_caught_detection_continues_from_that_batch():
    """Training that catches NonFiniteDetected and goes on: the next ring still ends with the
    frames that really came before it (the batch that raised), not an older batch."""
    model = Chain(Blow())
    w = watch(model, sinks=[Collect()], max_frames=6)
    x = torch.randn(2, 3)
    model(x)
    model.bad.armed = True
    for b in (1, 2):
        with pytest.raises(NonFiniteDetected) as ei:
            model(x)
        assert ei.value.event.batch_number == b
    assert [(f.module, f.batch_number) for f in ei.value.event.frames] == [
        ("bad", 1), ("l2", 1), ("", 1), ("l0", 2), ("l1", 2), ("bad", 2)]
    w.detach()


def test_replaced_parameters_are_not_kept_alive():
    """Code that swaps parameters every step (functional_call, re-created weights) must not leak
    them through the weight cache, and the new weights are measured."""
    import gc
    import weakref

    model = nn.Linear(8, 8)
    sink = Collect()
    w = watch(model, sinks=[sink])
    old = []
    for _ in range(200):
        model.weight = nn.Parameter(torch.randn(8, 8))
        old.append(weakref.ref(model.weight))
        model(torch.ones(1, 8))
        assert stats_of(sink.batches[-1].frames[0])["weight"] == amm(model.weight)
    gc.collect()
    assert sum(r() is not None for r in old) <= w._session.recorder.params_cap + 1  # bounded, not 200
    params = {"weight": torch.randn(8, 8), "bias": torch.randn(8)}
    for _ in range(40):
        params = {k: v * 1.01 for k, v in params.items()}
        torch.func.functional_call(model, params, (torch.ones(1, 8),))
        assert stats_of(sink.batches[-1].frames[0])["weight"] == amm(params["weight"])
    assert len(w._session.recorder.params_seen) <= w._session.recorder.params_cap + 2
    w.detach()


def test_weight_changed_through_data_is_measured_again():
    model = nn.Linear(2, 2)
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report"):
        model(torch.ones(1, 2))
        model.weight.data.mul_(100)
        model(torch.ones(1, 2))
    assert stats_of(sink.batches[1].frames[0])["weight"] == amm(model.weight)
