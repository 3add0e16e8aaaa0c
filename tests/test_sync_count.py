"""The transfer count, proven at the dispatcher rather than by reading the code: a
TorchDispatchMode counts every `_local_scalar_dense` (a host sync: .item(), bool(), format)
and every copy to the CPU while real training steps run with the watcher on.

A watched training step makes two reads: the batch's statistics (one copy when the batch
ends) and the optimizer-step guard (one `bool()` over all the step's gradients, before the
step runs: it has to stop the step before the weights change, so it cannot wait for the next
batch's copy). `guard_steps=False` or `gradients=True` leave the copy alone.

These counts are the device path's (CUDA, or a CPU without the compiled statistics kernel,
which every test here but the last one forces): on a CPU with the kernel the statistics are
Python floats as soon as they are measured, and a step transfers nothing at all."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from tensorwatch_otel import watch
from _collect import Collect
from _op_counts import torch_ops_path

aten = torch.ops.aten
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _device_path(request, monkeypatch):
    if not request.node.name.startswith("test_the_cpu_kernel_path"):
        torch_ops_path(monkeypatch)


class SyncCounter(TorchDispatchMode):
    """Counts host syncs and copies whose destination is the CPU."""

    def __init__(self):
        super().__init__()
        self.scalar = 0
        self.cpu_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            self.scalar += 1
        elif func is aten._to_copy.default:
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cpu":
                self.cpu_copies += 1
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type != "cpu":
                self.cpu_copies += 1
        return func(*args, **kwargs)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _train_step(model, opt, x):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _counted_steps(model, opt, x, n):
    out = []
    for _ in range(n):
        with SyncCounter() as c:
            _train_step(model, opt, x)
        out.append((c.scalar, c.cpu_copies))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_one_transfer_per_training_step_and_no_scalar_sync(device):
    torch.manual_seed(0)
    model = Small().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)  # SGD does no .item()
    x = torch.randn(4, 8, device=device)
    assert _counted_steps(model, opt, x, 1) == [(0, 0)]  # the harness sees no sync without us
    sink = Collect()
    with watch(model, sinks=[sink]):
        counts = _counted_steps(model, opt, x, 4)
    assert counts == [(1, 1)] * 4  # the batch's copy, and the step guard's one read
    with watch(model, sinks=[Collect()], guard_steps=False):
        assert _counted_steps(model, opt, x, 2) == [(0, 1)] * 2
    n_frames = len(sink.batches[-1].frames)
    assert n_frames == 1 + 3 * 5 + 1 + 1  # the stats of every module call came back in that one copy
    assert all(t.abs_max is not None for f in sink.batches[-1].frames for t in f.tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_check_module_transfers_once_per_module_call(device):
    torch.manual_seed(0)
    model = Small().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, device=device)
    sink = Collect()
    with watch(model, sinks=[sink], check="module"):
        counts = _counted_steps(model, opt, x, 2)
    n_frames = len(sink.batches[-1].frames)
    assert counts == [(1, n_frames)] * 2  # + the step guard's read


def test_sampled_batches_transfer_only_the_guards_read():
    model = Small()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, sinks=[Collect()], every_n_batches=3):
        counts = _counted_steps(model, opt, torch.randn(2, 8), 6)
    # an unsampled batch copies no statistics; its output is checked (one read) and its step is
    # still guarded (one read)
    assert counts == [(1, 1), (2, 0), (2, 0), (1, 1), (2, 0), (2, 0)]


def _inf_bias_model():
    model = Small()
    with torch.no_grad():
        model.blocks[1][1].bias[0] = float("inf")
    return model, torch.optim.SGD(model.parameters(), lr=0.0)


def test_report_mode_with_detection_still_one_transfer():
    model, opt = _inf_bias_model()
    with watch(model, sinks=[Collect()], on_detect="report") as w:
        counts = _counted_steps(model, opt, torch.randn(2, 8), 2)
        # each step: the forward detection, and the guard's on the gradients the inf made,
        # located with one more copy (the slow path runs only when a gradient is bad)
        assert w.detections == 4
    # the second batch's detection also reads its tensor's inf/nan flags (below)
    assert counts == [(1, 2), (1, 3)]
    model, opt = _inf_bias_model()
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report", guard_steps=False) as w:
        counts = _counted_steps(model, opt, torch.randn(2, 8), 2)
        assert w.detections == 2
    # the step made a weight nan (0 * nan): abs min/max show NaN whether or not an inf is there
    # too, so that detection reads the named tensor's inf/nan flags in one more transfer (the
    # exact kind); a detection whose tensor shows only inf needs none
    kinds = [(e.tensor, e.kind) for e in sink.events if e.event == "nonfinite_detected"]
    assert kinds == [("bias", "inf"), ("weight", "nan")]
    assert counts == [(0, 1), (0, 2)]


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _hf_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def _hf_counts(model, opt, ids, n):
    out = []
    for _ in range(n):
        with SyncCounter() as c:
            _hf_step(model, opt, ids)
        out.append((c.scalar, c.cpu_copies))
    return out


def test_transformers_model_one_transfer_per_batch():
    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # AdamW on CPU calls .item() itself
    ids = torch.randint(0, 64, (2, 12))
    base = _hf_counts(model, opt, ids, 2)[-1]
    sink = Collect()
    with watch(model, sinks=[sink]):
        watched = _hf_counts(model, opt, ids, 3)
    assert watched == [(base[0] + 1, base[1] + 1)] * 3  # the batch's copy and the step guard's read
    frames = sink.batches[-1].frames
    assert len(frames) > 20 and frames[-1].module == ""
    assert any(t.name == "output.logits" for t in frames[-1].tensors)


def test_peer_syncs_many_times_per_batch_in_the_same_harness():
    """The harness can fail: transformers' DebugUnderflowOverflow syncs per tensor."""
    debug_utils = pytest.importorskip("transformers.debug_utils")
    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 64, (2, 12))
    base = _hf_counts(model, opt, ids, 2)[-1]
    debug_utils.DebugUnderflowOverflow(model)
    try:
        peer = _hf_counts(model, opt, ids, 2)
    finally:
        for m in model.modules():
            m._forward_hooks.clear()
    n_modules = len(list(model.modules()))
    for scalar, _ in peer:
        assert scalar - base[0] > 2 * n_modules


def test_the_cpu_kernel_path_transfers_nothing():
    """With the compiled CPU kernel the batch's statistics and the guard's gradients are
    measured straight into host memory: no sync, no copy, and the values are the exact ones."""
    from tensorwatch_otel.core.measure import cpu_kernel

    if cpu_kernel.KERNEL.wait() is None:
        pytest.skip("no compiled CPU kernel on this machine")
    torch.manual_seed(0)
    model = Small()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    sink = Collect()
    with watch(model, sinks=[sink]):
        counts = _counted_steps(model, opt, x, 3)
        w = model.head.weight.detach().abs()
    assert counts == [(0, 0)] * 3
    head = next(f for f in sink.batches[-1].frames if f.module == "head")
    t = {s.name: s for s in head.tensors}["weight"]
    # the head's weight as the last batch saw it (before that step's update)
    assert t.abs_max == pytest.approx(w.max().item(), rel=1e-2) and t.abs_max > 0
