"""Offloaded weights: under accelerate's offload (`cpu_offload`, or `device_map` with modules on
"disk") a module's weights are meta tensors between forwards and real only while accelerate's
hook lends them to the module's forward. They are measured there, and an inf in one is named at
the weight, with the real accelerate hooks (execution device "cpu" on this machine)."""

from __future__ import annotations

import gc
import logging
import math
import weakref

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from accelerate import cpu_offload  # noqa: E402

from _collect import Collect  # noqa: E402
from _hooks import remaining_hooks  # noqa: E402
import tensorwatch_otel as tw  # noqa: E402
from tensorwatch_otel import NonFiniteDetected, watch  # noqa: E402


class SeenLinear(nn.Linear):
    """A Linear that keeps a weak reference to the weight its forward used (the one accelerate
    lent it), so a test can tell whether anything holds that copy after the call."""

    lent: list

    def forward(self, x):
        self.__dict__.setdefault("lent", []).append(weakref.ref(self.weight))
        return super().forward(x)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(SeenLinear(4, 4), nn.ReLU(), SeenLinear(4, 2))


def _expected(model: nn.Sequential):
    """(abs min, abs max) of every weight, read before accelerate takes them away."""
    return {(str(i), n): (p.detach().abs().min().item(), p.detach().abs().max().item())
            for i in (0, 2) for n, p in model[i].named_parameters()}


def _tensors(frame):
    return {t.name: t for t in frame.tensors}


def test_cpu_offloaded_weights_are_measured_when_accelerate_lends_them(caplog):
    model = _model()
    expected = _expected(model)
    cpu_offload(model, execution_device="cpu")
    assert model[2].weight.is_meta  # between forwards accelerate keeps them off the module
    old_forward = model[2].__dict__["_old_forward"]
    sink = Collect()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # (an autograd graph would hold the lent weights for its backward)
        plain = model(x)
    caplog.set_level(logging.INFO, logger="tensorwatch_otel")
    with watch(model, sinks=[sink]), torch.no_grad():
        for _ in range(3):
            out = model(x)
    assert torch.equal(out, plain)
    assert [b.batch_number for b in sink.batches] == [0, 1, 2]
    for batch in sink.batches:
        frames = {f.module: f for f in batch.frames}
        for (path, name), (mn, mx) in expected.items():
            t = _tensors(frames[path])[name]
            assert t.note == "" and (t.abs_min, t.abs_max) == pytest.approx((mn, mx)), (path, name, t)
    # the lent copies are not kept: each is freed with accelerate's own references
    gc.collect()
    assert model[0].lent and all(r() is None for r in model[0].lent + model[2].lent)
    assert model[2].weight.is_meta
    # a lent weight each call is accelerate's doing, not the model's weights being replaced
    assert "replaced" not in caplog.text
    assert remaining_hooks(model) == {}
    assert model[2].__dict__["_old_forward"] is old_forward  # accelerate's forward as it was
    with torch.no_grad():
        assert torch.equal(model(x), plain)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = SeenLinear(4, 4)
        self.b = SeenLinear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_weights_lent_for_a_whole_block_are_measured_and_not_kept(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(4, 2))
    expected = {(f"0.{c}", n): (p.detach().abs().min().item(), p.detach().abs().max().item())
                for c in "ab" for n, p in model[0].get_submodule(c).named_parameters()}
    # the block's hook lends every weight below it for the block's call (place_submodules)
    cpu_offload(model, execution_device="cpu", preload_module_classes=["Block"])
    assert model[0]._hf_hook.place_submodules and model[0].a.weight.is_meta
    sink = Collect()
    caplog.set_level(logging.INFO, logger="tensorwatch_otel")
    with watch(model, sinks=[sink]), torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 4))
    for batch in sink.batches:
        frames = {f.module: f for f in batch.frames}
        for (path, name), (mn, mx) in expected.items():
            t = _tensors(frames[path])[name]
            assert (t.abs_min, t.abs_max) == pytest.approx((mn, mx)), (path, name, t)
    gc.collect()
    assert len(model[0].a.lent) == 3 and all(r() is None for r in model[0].a.lent + model[0].b.lent)
    assert "replaced" not in caplog.text
    assert remaining_hooks(model) == {}


def test_inf_in_an_offloaded_weight_is_named_at_the_weight():
    model = _model()
    cpu_offload(model, execution_device="cpu")
    sink = Collect()
    with watch(model, sinks=[sink]) as w:
        model(torch.randn(2, 4))
        # the copy accelerate keeps between forwards (its hook's weights map) goes bad
        model[2]._hf_hook.weights_map["weight"][0, 0] = math.inf
        with pytest.raises(NonFiniteDetected) as info:
            model(torch.randn(2, 4))
        assert w.batch_number == 2
    event = info.value.event
    assert (event.module, event.module_class, event.tensor, event.kind, event.batch_number) == \
        ("2", "SeenLinear", "weight", "inf", 1)
    assert _tensors(event.frames[-1])["weight"].abs_max == math.inf
    assert remaining_hooks(model) == {}


def test_dropin_debug_underflow_overflow_names_the_offloaded_weight(capsys):
    model = _model()
    with torch.no_grad():
        model[2].weight[1, 2] = math.inf
    cpu_offload(model, execution_device="cpu")
    dbg = tw.DebugUnderflowOverflow(model)
    try:
        with pytest.raises(ValueError, match="DebugUnderflowOverflow: inf/nan detected") as info:
            model(torch.randn(2, 4))
    finally:
        dbg.detach()
    assert (info.value.event.module, info.value.event.tensor) == ("2", "weight")
    report = capsys.readouterr()
    text = report.out + report.err
    assert "no data" not in text
    frame = text[text.rindex(" 2 SeenLinear"):].splitlines()
    assert frame[1].split()[1:] == ["inf", "weight"]
    assert remaining_hooks(model) == {}


def test_dropin_traced_batch_says_which_offloaded_weight_has_infs(capsys):
    model = _model()
    with torch.no_grad():
        model[0].bias[0] = math.inf
    cpu_offload(model, execution_device="cpu")
    with tw.DebugUnderflowOverflow(model, trace_batch_nums=[0]):
        model(torch.randn(2, 4))
    text = capsys.readouterr().out
    assert "bias has infs" in text and "no data" not in text


def test_transformers_model_with_a_block_offloaded_to_disk(tmp_path):
    transformers = pytest.importorskip("transformers")
    from _hf import BAD, VOCAB, tiny_gpt2

    model = tiny_gpt2()
    with torch.no_grad():
        model.get_submodule(BAD).weight[3, 5] = math.inf
    model.save_pretrained(tmp_path / "ckpt")
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu",
                  "transformer.h.0": "cpu", "transformer.h.1": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu"}
    offloaded = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path / "ckpt", device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert offloaded.get_submodule(BAD).weight.is_meta  # on disk between forwards
    sink = Collect()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteDetected) as info:
        with watch(offloaded, sinks=[sink]):
            offloaded(input_ids=ids)
    event = info.value.event
    assert (event.module, event.module_class, event.tensor) == (BAD, "Conv1D", "weight")
    frames = {f.module: f for f in event.frames}
    proj = _tensors(frames["transformer.h.1.attn.c_proj"])  # offloaded too, finite
    w = model.get_submodule("transformer.h.1.attn.c_proj").weight.detach().abs()
    assert (proj["weight"].abs_min, proj["weight"].abs_max) == pytest.approx((w.min().item(), w.max().item()))
    assert remaining_hooks(offloaded) == {}
