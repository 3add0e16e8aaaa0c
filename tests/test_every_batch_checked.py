"""Every batch checked, really: a batch `every_n_batches` (or `max_overhead`) leaves unrecorded
is still checked as its outermost call returns, whatever its output looks like (the output
check reads what a frame reads: 256 values per container, 6 levels deep), under torch.func
transforms too, and the inf/nan is named where a run watching every batch names it, with
`max_overhead` alone as with `every_n_batches`. Each test runs the same loop watched with
every_n_batches=1 (every batch recorded) and with sampling, and compares."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

from _collect import Collect
from _models import TwoLinear
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch
from test_budget import slow_frames  # noqa: F401 (a fixture)

BAD = 13  # an unsampled batch at every_n_batches=10
INF = float("inf")


def _place(ev):
    return (ev.module, ev.tensor, ev.phase, ev.batch_number, ev.kind)


# -- outputs wider and deeper than the old walk (64 tensors, 4 levels) ---------------------------------

class Heads(nn.Module):
    """A trunk and 80 heads (multi-task): the output is a list of 80 tensors."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.heads = nn.ModuleList(nn.Linear(16, 2) for _ in range(80))

    def forward(self, x):
        z = torch.relu(self.trunk(x))
        return [h(z) for h in self.heads]


class Detector(nn.Module):
    """Per image a dict of boxes, scores and labels, as torchvision's detectors return: 40 images
    are 80 floating tensors."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(8, 16)
        self.box = nn.Linear(16, 4)
        self.score = nn.Linear(16, 1)

    def forward(self, images):
        out = []
        for feats in torch.relu(self.backbone(images)).unbind(0):
            out.append({"boxes": self.box(feats).view(1, 4), "scores": self.score(feats).sigmoid(),
                        "labels": torch.zeros(1, dtype=torch.long)})
        return out


class Pyramid(nn.Module):
    """Feature maps nested five levels deep ({"fpn": [[[{"p5": t}]]]}): a frame records p5."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.p5 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return {"fpn": [[[{"p5": self.p5(h)}]]], "h": h.sum()}


def _inject(name, model, x):
    if name == "heads":  # an inf in head 70 of 80
        with torch.no_grad():
            model.heads[70].weight[0, 0] = INF
    elif name == "images":  # image 35 of 40
        x = x.clone()
        x[35, 0] = INF
    else:  # a weight whose output is found only five levels down
        with torch.no_grad():
            model.p5.weight[0, 0] = INF
    return x


WIDE = {"heads": (Heads, 4, ("heads.70", "weight")), "images": (Detector, 40, ("backbone", "input[0]")),
        "nested": (Pyramid, 4, ("p5", "weight"))}


def _infer(name, **options):
    """Inference (no gradients: no step guard), `BAD + 2` batches; the detection or None."""
    cls, rows, _ = WIDE[name]
    torch.manual_seed(0)
    model = cls().eval()
    g = torch.Generator().manual_seed(1)
    sink = Collect()
    with watch(model, sinks=[sink], **options):
        try:
            for i in range(BAD + 2):
                x = torch.randn(rows, 8, generator=g)
                if i == BAD:
                    x = _inject(name, model, x)
                with torch.no_grad():
                    model(x)
        except NonFiniteDetected as exc:
            return exc.event, sink
    return None, sink


@pytest.mark.parametrize("name", list(WIDE))
def test_an_inf_anywhere_a_frame_looks_is_found_in_an_unsampled_batch(name):
    full, _ = _infer(name, every_n_batches=1)
    sampled, sink = _infer(name, every_n_batches=10)
    assert full is not None and (full.module, full.tensor, full.batch_number) == (*WIDE[name][2], BAD)
    assert sampled is not None, "the unsampled batch's output was not checked where the inf is"
    assert _place(sampled) == _place(full)
    assert sink.of(NonFiniteEvent) == [sampled]


def test_the_output_check_reads_what_a_frame_reads():
    """The output check's walk has the recorder's bounds: 256 values per container, 6 levels."""
    from tensorwatch_otel.core.frames import finite, recorder

    assert (finite.MAX_ITEMS, finite.MAX_DEPTH) == (recorder.MAX_ITEMS, recorder.MAX_DEPTH)
    t = torch.ones(1)
    wide = [t] * 300
    assert len(finite.output_tensors(wide)) == 256
    assert len(finite.output_tensors([{"a": t, "b": t}] * 200)) == 400  # no cap over the whole output
    deep = t
    for _ in range(6):
        deep = [deep]
    assert len(finite.output_tensors(deep)) == 1  # a tensor 6 levels down is read, as a frame reads it
    assert finite.output_tensors([deep]) == []  # a container at level 6 is not looked into


# -- torch.func ---------------------------------------------------------------------------------------

def _loss(model):
    def loss(params, xi, yi):
        return F.mse_loss(functional_call(model, params, (xi.unsqueeze(0),)), yi.unsqueeze(0))
    return loss


def _func_loop(kind, **options):
    """torch.func in a loop, `BAD + 2` batches, an inf in the input of batch BAD: `vmap`
    inference, forward-mode `jvp`, a `grad` training loop (the update applied by hand: no optimizer step), per-sample
    gradients (vmap of grad) averaged into `.grad` and an optimizer step. The detection or None."""
    torch.manual_seed(0)
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    sink = Collect()
    with watch(model, sinks=[sink], **options):
        try:
            for i in range(BAD + 2):
                x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
                if i == BAD:
                    x[3, 5] = INF
                params = {k: v.detach() for k, v in model.named_parameters()}
                if kind == "vmap":
                    with torch.no_grad():
                        vmap(model)(x)
                elif kind == "jvp":
                    jvp(model, (x,), (torch.ones_like(x),))
                elif kind == "grad":
                    grads = grad(_loss(model))(params, x[0], y[0]) if i != BAD else \
                        grad(_loss(model))(params, x[3], y[3])
                    with torch.no_grad():
                        for k, p in model.named_parameters():
                            p -= 0.01 * grads[k]
                else:
                    per_sample = vmap(grad(_loss(model)), in_dims=(None, 0, 0))(params, x, y)
                    for k, p in model.named_parameters():
                        p.grad = per_sample[k].mean(0)
                    opt.step()
        except NonFiniteDetected as exc:
            return exc.event, sink
    return None, sink


@pytest.mark.parametrize("kind", ["vmap", "jvp", "grad", "per_sample_step"])
def test_unsampled_batches_under_torch_func_are_checked_and_named_in_the_forward(kind):
    full, _ = _func_loop(kind, every_n_batches=1)
    sampled, sink = _func_loop(kind, every_n_batches=10)
    assert full is not None and (full.module, full.tensor, full.phase, full.batch_number) == \
        ("a", "input[0]", "forward", BAD)
    assert sampled is not None, "the unsampled batch under torch.func was not checked"
    assert (sampled.phase, sampled.batch_number, sampled.kind) == ("forward", BAD, "inf")  # not bias.grad
    # replayed inside the transform (vmap's output read through what it wraps): named where full
    # watching names it
    assert _place(sampled) == _place(full)
    assert sink.of(NonFiniteEvent) == [sampled]


@pytest.mark.parametrize("kind", ["vmap", "per_sample_step"])
def test_unsampled_batches_under_vmap_are_localized_by_the_replay(kind):
    full, _ = _func_loop(kind, every_n_batches=1)
    sampled, _ = _func_loop(kind, every_n_batches=10)
    assert _place(sampled) == _place(full)


# -- max_overhead alone --------------------------------------------------------------------------------

def _budget_loop(options, inject, warm=40):
    """TwoLinear trained `warm` batches with a 40 ms step (a measured batch made dear by
    slow_frames: max_overhead measures one in several), then, right after a measured batch,
    `inject(model, opt, x)` runs the batch with the inf. (The detection, the watcher's interval,
    the batches measured, the model.)"""
    from test_budget import _to_just_after_a_measured_batch, _train

    torch.manual_seed(0)
    model = TwoLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = Collect()
    with watch(model, sinks=[sink], **options) as w:
        _train(w, model, opt, warm)
        if options.get("max_overhead"):
            _to_just_after_a_measured_batch(w, model, opt, sink)
        bad = w.batch_number
        try:
            inject(model, opt, torch.randn(4, 8))
        except NonFiniteDetected as exc:
            assert exc.event.batch_number == bad
            return exc.event, w.measure_every_n_batches, [s.batch_number for s in sink.batches], model
    raise AssertionError("no detection")


def _inf_weight_inference(model, opt, x):
    with torch.no_grad():
        model.b.weight[0, 0] = INF
        model(x)


def _inf_gradient_step(model, opt, x):
    opt.zero_grad()
    loss = model(x).sum()
    loss.backward()
    model.a.weight.grad[0, 0] = INF  # born in a gradient
    opt.step()


@pytest.mark.waits
@pytest.mark.usefixtures("slow_frames")
def test_max_overhead_alone_holds_the_inputs_and_names_the_weight():
    """max_overhead without every_n_batches: an inf in a weight in an unmeasured batch is named
    at that weight, as every_n_batches names it (the inputs are held for the replay), not at
    the root's output."""
    full = _budget_loop({"every_n_batches": 1}, _inf_weight_inference, warm=2)[0]
    sampled, n, measured, _ = _budget_loop({"max_overhead": 0.05}, _inf_weight_inference)
    assert n >= 3 and sampled.batch_number not in measured  # an unmeasured batch
    assert (full.module, full.tensor, full.kind) == ("b", "weight", "inf")
    assert (sampled.module, sampled.tensor, sampled.kind, sampled.phase) == ("b", "weight", "inf", "forward")


@pytest.mark.waits
@pytest.mark.usefixtures("slow_frames")
def test_max_overhead_with_gradients_guards_every_step():
    """gradients=True records the gradients of measured batches only; with max_overhead the step
    guard reads the others', as with every_n_batches: the step raises before it changes anything."""
    fixed = _budget_loop({"every_n_batches": 10, "gradients": True}, _inf_gradient_step, warm=2)[0]
    before = []

    def step(model, opt, x):
        before.extend(p.detach().clone() for p in model.parameters())
        _inf_gradient_step(model, opt, x)

    sampled, n, measured, model = _budget_loop({"max_overhead": 0.05, "gradients": True}, step)
    assert n >= 3 and sampled.batch_number not in measured
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step did not run
    assert (fixed.module, fixed.tensor, fixed.phase) == ("a", "weight.grad", "backward")
    assert (sampled.module, sampled.tensor, sampled.kind, sampled.phase) == ("a", "weight.grad", "inf", "backward")
