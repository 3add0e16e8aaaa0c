"""The suite's key cases on a CUDA GPU (marked `cuda`; skipped where torch sees no GPU): the fused
Triton kernel exact against torch on CUDA tensors of every dtype it reads and on the edge values;
a watched model records on the device path the frames the torch-ops route records; a detection
names the same module and tensor eagerly and compiled (the inf born in an activation included);
compiled values equal eager's within 1e-3 of their magnitude, `mode="reduce-overhead"` included;
the counts of a watched step (table launches of deferred frames, at most one per 8 module calls,
one copy of the slot buffer per batch, frames written in place later still exact, the guard's
one sync, none with a fused optimizer, whose step takes the guard's flag
and skips a bad step itself); an fp16 GradScaler run whose overflows are the scaler's is not
a detection; an inf in an unsampled batch is localized by replay as a recorded batch names it.

Run on a GPU machine: ``python -m pytest -m cuda tests/test_cuda.py``. The interpreted device-path
tests (tests/test_device_*.py) need TRITON_INTERPRET=1 in a pytest process of their own there."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: these tests need one")]

from _collect import Collect  # noqa: E402
from tensorwatch_otel import NonFiniteEvent, watch  # noqa: E402
from tensorwatch_otel.core.measure import device_path, device_stats  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _prenorm import Stack  # noqa: E402

CUDA = torch.device("cuda")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _expected(t):
    a = t.detach().double().abs().cpu()
    if torch.isnan(a).any():
        return math.nan, math.nan
    return a.min().item(), a.max().item()


def _same(got, want):
    return all((math.isnan(g) and math.isnan(w)) or g == w for g, w in zip(got, want))


def _rows(frames):
    def v(x):
        return "nan" if isinstance(x, float) and math.isnan(x) else x
    return [(f.module, f.phase, t.name, v(t.abs_min), v(t.abs_max), t.dtype) for f in frames for t in f.tensors]


def _values(frames):
    return {(f.module, f.phase, t.name): (t.abs_min, t.abs_max) for f in frames for t in f.tensors}


@pytest.fixture(autouse=True)
def _auto_mode():
    device_path.set_mode("auto")
    yield
    device_path.set_mode("auto")


def test_the_device_path_is_taken_on_cuda():
    pytest.importorskip("triton")
    stats = device_stats.DeviceStats()
    frame = stats.frame()
    assert frame.add(torch.randn(8, device=CUDA))
    (slot,) = frame.launch()
    slot.buffer.read()
    assert slot.hi > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_is_exact_on_edge_values_and_sizes(dtype):
    pytest.importorskip("triton")
    fi = torch.finfo(dtype)
    base = [0.0, -0.0, fi.tiny, -fi.tiny, fi.tiny / 4, fi.max, -fi.max, 1.0, -3.5]
    g = torch.Generator().manual_seed(7)
    cases = [torch.tensor(base, dtype=dtype),
             torch.tensor([-0.0, -0.0], dtype=dtype),
             torch.tensor([fi.tiny / 8, -fi.tiny / 2], dtype=dtype),
             torch.tensor(base + [math.inf], dtype=dtype),
             torch.tensor(base + [-math.inf], dtype=dtype),
             torch.tensor(base + [math.nan], dtype=dtype),
             torch.tensor([math.inf, 1.0, math.nan], dtype=dtype)]
    cases += [(torch.randn(n, generator=g) * 100).to(dtype) for n in (1, 7, 1023, 4097, 1 << 20)]
    big = (torch.randn(3 << 20, generator=g) * 1e3).to(dtype)
    cases.append(big[5:])  # a storage offset
    cases = [t.to(CUDA) for t in cases]
    stats = device_stats.DeviceStats()
    frame = stats.frame()
    assert all(frame.add(t) for t in cases)
    slots = frame.launch()
    slots[0].buffer.read()
    for t, s in zip(cases, slots):
        assert _same((s.lo, s.hi), _expected(t)), (t.numel(), (s.lo, s.hi), _expected(t))


def _train(model, xs, mode, autocast=None, **options):
    sink = Collect()
    device_path.set_mode(mode)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with watch(model, sinks=[sink], on_detect="report", trace_batches=range(len(xs)), **options):
            for x in xs:
                with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
                    out = model(x)
                out.float().square().mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        device_path.set_mode("auto")
    return [f for b in sink.batches for f in b.frames], sink.events


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, None), (torch.float32, torch.bfloat16),
                                            (torch.float16, None)], ids=["fp32", "bf16-autocast", "fp16"])
def test_a_watched_stack_records_the_torch_ops_routes_frames(dtype, autocast):
    torch.manual_seed(0)
    model = Stack(n_blocks=2, d=64, heads=4).to(CUDA, dtype)
    twin = Stack(n_blocks=2, d=64, heads=4).to(CUDA, dtype)
    twin.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 32, 64, generator=g).to(CUDA, dtype) for _ in range(3)]
    off, _ = _train(model, xs, "off", autocast)
    auto, _ = _train(twin, xs, "auto", autocast)
    assert len(off) == 3 * 23 and _rows(auto) == _rows(off)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_detection_names_the_same_module_and_tensor(bad):
    found = []
    for mode in ("off", "auto"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 4)).to(CUDA)
        with torch.no_grad():
            m[2].weight[3, 5] = bad
        _, events = _train(m, [torch.randn(4, 8, device=CUDA)], mode)
        ev = [e for e in events if isinstance(e, NonFiniteEvent)][0]
        found.append((ev.module, ev.tensor, ev.kind, _rows(ev.frames)))
    assert found[0] == found[1] and found[0][:2] == ("2", "weight")


def _close(a, b, scale):
    return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "reduce-overhead"])
def test_compiled_values_equal_eager_and_the_inf_is_named_where_born(mode):
    """The in-graph statistics (rows written into a table at a fixed address) on CUDA: values as
    eager's on every replay, and under mode="reduce-overhead" CUDA graphs capture them (no
    cudagraph skip)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Stack(n_blocks=3, d=64, heads=4).to(CUDA)
    x = torch.randn(2, 16, 64, device=CUDA)
    ref = Collect()
    with watch(model, sinks=[ref], on_detect="report"):
        model(x)
    eager = _values(ref.batches[-1].frames)
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report")
    call = torch.compile(model, mode=mode)
    for _ in range(3):  # reduce-overhead records the graph on a later call: every replay measured
        with torch.no_grad():
            call(x)
    assert len(sink.batches) == 3
    assert counters["inductor"]["cudagraph_skips"] == 0 and not counters["graph_break"]
    for batch in sink.batches:
        got = _values(batch.frames)
        assert set(got) == set(eager)
        for key, (mn, mx) in eager.items():
            assert _close(got[key][1], mx, mx) and _close(got[key][0], mn, mx), (key, got[key], (mn, mx))
    with torch.no_grad():
        model.blocks[1].mlp.fc1.weight.fill_(1e38)
        call(x)
    ev = sink.of(NonFiniteEvent)[-1]
    assert (ev.module, ev.tensor, ev.batch_number) == ("blocks.1.mlp.fc1", "output", 3)
    w.detach()


def test_few_launches_per_step_and_one_copy_per_step(monkeypatch):
    """Counted at the dispatcher on CUDA (tests/_op_counts.py): once warm, the module calls'
    tensors wait for table launches (at most one per 8 calls), no aten op or allocation of ours
    per call, the slot buffer's one read per step and the guard's one sync."""
    pytest.importorskip("triton")
    from _op_counts import counted_training

    torch.manual_seed(0)
    model = Stack(n_blocks=2, d=64, heads=4).to(CUDA)
    counts, sink = counted_training(monkeypatch, model, torch.randn(2, 16, 64, device=CUDA))
    frames = len(sink.batches[-1].frames)
    for (syncs, copies, reads, _read_ops, calls), tables in zip(counts.steps[1:], counts.tables[1:]):
        assert len(calls) == frames
        assert 1 <= tables <= frames // 8 and all(c[1:] == [0, 0] for c in calls), (tables, calls)
        assert (reads, copies) == (1, 0) and syncs <= 1  # the guard: one sync at most


class _Residual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.act = nn.ReLU(inplace=True)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        out = self.norm(self.act(self.lin(x)))
        out += x  # norm's output, written after norm returned
        return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deferred_frames_equal_the_torch_ops_route_with_in_place_writes(dtype):
    """Tensors written in place after their module returned (an inplace ReLU, `+=`) keep the
    values they had at the return in every batch: the first batch learns those modules, whose
    frames then launch at once; the others wait for table launches."""
    torch.manual_seed(0)
    base = nn.Sequential(*[_Residual(64) for _ in range(4)]).to(CUDA, dtype)
    xs = [torch.randn(8, 64, device=CUDA, dtype=dtype) for _ in range(4)]

    def frames(mode):
        import copy

        model = copy.deepcopy(base)
        device_path.set_mode(mode)
        sink = Collect()
        try:
            with watch(model, sinks=[sink], on_detect="report", trace_batches=range(4)):
                for x in xs:
                    model(x).float().square().mean().backward()
        finally:
            device_path.set_mode("auto")
        return [f for b in sink.batches for f in b.frames]

    ops, fused = frames("off"), frames("auto")
    assert _rows(fused) == _rows(ops) and not any(t.note for f in fused for t in f.tensors)


def test_a_fused_optimizer_takes_the_guards_flag_no_sync_and_skips_a_bad_step(monkeypatch):
    """AdamW(fused=True), on_detect="raise": per warm step one buffer read and no sync of the
    guard's (its verdict is the optimizer's found_inf on the GPU); a bad gradient makes the step
    write nothing and the detection is raised at the next batch's read-back, named at it."""
    pytest.importorskip("triton")
    from _op_counts import counted_training
    from tensorwatch_otel import NonFiniteDetected

    torch.manual_seed(0)
    model = Stack(n_blocks=2, d=64, heads=4).to(CUDA)
    counts, _ = counted_training(monkeypatch, model, torch.randn(2, 16, 64, device=CUDA),
                                 optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True))
    for syncs, copies, reads, _read_ops, _calls in counts.steps[1:]:
        assert (reads, copies, syncs) == (1, 0, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(2, 16, 64, device=CUDA)
    with watch(model, sinks=[Collect()]):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        model(x).square().mean().backward()
        with torch.no_grad():
            model.blocks[1].mlp.fc1.weight.grad[0, 0] = float("inf")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()  # skipped on the GPU: no raise here
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        opt.zero_grad()
        with pytest.raises(NonFiniteDetected) as ei:
            model(x)
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.phase, ev.batch_number) == ("blocks.1.mlp.fc1", "weight.grad", "backward", 1)


def test_an_fp16_gradscaler_run_is_not_a_detection_and_a_real_inf_is():
    torch.manual_seed(0)
    model = Stack(n_blocks=2, d=64, heads=4).to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 40)  # the first steps overflow in the scaler
    x = torch.randn(4, 32, 64, device=CUDA)
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report"):
        for _ in range(6):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scaler.get_scale() < 2.0 ** 40  # the scaler did skip steps
        assert sink.of(NonFiniteEvent) == []
        with torch.no_grad():
            model.blocks[1].mlp.fc1.weight.fill_(1e38)
        with torch.autocast("cuda", dtype=torch.float16):
            model(x)
    ev = sink.of(NonFiniteEvent)[0]
    assert ev.module.startswith("blocks.1.mlp.fc1")


def test_an_inf_in_an_unsampled_batch_is_localized_by_replay():
    def run(every):
        torch.manual_seed(0)
        model = Stack(n_blocks=2, d=64, heads=4).to(CUDA)
        x = torch.randn(2, 16, 64, device=CUDA)
        sink = Collect()
        with watch(model, sinks=[sink], on_detect="report", every_n_batches=every), torch.no_grad():
            for i in range(4):
                if i == 2:
                    model.blocks[1].mlp.fc1.weight.fill_(1e38)
                model(x)
        ev = sink.of(NonFiniteEvent)[0]
        return ev.module, ev.tensor, ev.phase, ev.batch_number

    assert run(10) == run(1) == ("blocks.1.mlp.fc1", "output", "forward", 2)
