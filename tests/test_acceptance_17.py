"""Issue 17 acceptance, as a new user meets it: the three ways of compiling record every
(module, tensor) pair eager records for a pre-norm block stack, values within 1e-3 relative,
no graph break, and an inf in a middle block's weight is named at that block; the 5000-module
model is watched whole."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, watch

D = 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class Stack(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(D, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _model() -> Stack:
    torch.manual_seed(0)
    return Stack()


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 16, D)


def _pairs(frames) -> dict:
    """{(module, tensor): (abs_min, abs_max)} of one batch's frames (first call of each)."""
    out = {}
    for f in frames:
        for t in f.tensors:
            if t.abs_max is not None:
                out.setdefault((f.module, t.name), (t.abs_min, t.abs_max))
    return out


def _eager_pairs() -> dict:
    m = _model()
    sink = Collect()
    with watch(m, sinks=[sink]):
        m(_x())
    return _pairs(sink.batches[0].frames)


def _compile(mode: str, m: Stack, sink: Collect):
    """(what the user calls, the watcher) for each way of compiling."""
    if mode == "watch_then_compile":
        w = watch(m, sinks=[sink])
        return torch.compile(m), w
    if mode == "compile_in_place_then_watch":
        m.compile()
        return m, watch(m, sinks=[sink])
    if mode == "watch_then_compile_in_place":
        w = watch(m, sinks=[sink])
        m.compile()
        return m, w
    cm = torch.compile(m)
    return cm, watch(cm, sinks=[sink])


MODES = ["watch_then_compile", "compile_in_place_then_watch", "watch_then_compile_in_place",
         "watch_the_compiled_module"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_compiled_frames_match_eager_and_name_the_block(mode):
    from torch._dynamo.utils import counters

    eager = _eager_pairs()
    torch._dynamo.reset()
    counters.clear()
    m = _model()
    sink = Collect()
    call, w = _compile(mode, m, sink)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    try:
        with w:
            out = call(_x())
            got = _pairs(sink.batches[0].frames)
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
            missing = sorted(set(eager) - set(got))
            assert not missing, f"{len(missing)} of {len(eager)} eager pairs missing: {missing[:8]}"
            for key, (mn, mx) in eager.items():
                gmn, gmx = got[key]
                assert math.isclose(gmx, mx, rel_tol=1e-3, abs_tol=1e-6), (key, gmx, mx)
                assert math.isclose(gmn, mn, rel_tol=1e-3, abs_tol=1e-6), (key, gmn, mn)
            # an inf in a middle block's weight is named at that block
            with torch.no_grad():
                m.blocks[1].fc1.weight[3, 5] = float("inf")
            with pytest.raises(NonFiniteDetected) as ei:
                call(_x())
            ev = ei.value.event
            assert ev.module == "blocks.1.fc1", (ev.module, ev.tensor)
            assert ev.tensor == "weight"
    finally:
        torch._dynamo.reset()


def test_five_thousand_tiny_modules_are_all_watched():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(5000)])
    with torch.no_grad():
        for lin in model:
            lin.weight.mul_(0.25)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sink = Collect()
    x = torch.randn(4, 16)
    with watch(model, sinks=[sink], every_n_batches=2):
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            model[2500].weight[0, 0] = float("nan")
        with pytest.raises(NonFiniteDetected) as unsampled:
            model(x)  # batch 3: not sampled; its output is checked, a replay names the module
        # it ran its 5000 modules on torch's fast path: their hooks are off until batch 4 begins
        # (the replay's own hooks are gone again)
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model)
        with pytest.raises(NonFiniteDetected) as ei:
            model(x)  # batch 4: sampled
    forward = [b for b in sink.batches if b.phase == "forward"]
    assert [b.batch_number for b in forward] == [0, 2, 4]
    frames = forward[0].frames
    assert len([f for f in frames if f.module]) == 5000
    assert {t.name for t in frames[0].tensors} == {"weight", "bias", "input[0]", "output"}
    for event, batch in ((unsampled.value.event, 3), (ei.value.event, 4)):
        assert (event.module, event.tensor, event.batch_number) == ("2500", "weight", batch)
