"""The eager hot path's cheaper measurement (issue 17): CPU statistics as host floats from
the compiled kernel, one kernel call per frame, the step guard's gradients in one call, and the
ParamIndex compare. Values must be exactly those of the per-tensor path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from tensorwatch_otel import NonFiniteDetected, watch
from tensorwatch_otel.core.measure import cpu_kernel, stats
from tensorwatch_otel.core.measure.host_batch import HostBatch
from tensorwatch_otel.core.measure.stats import measure, measure_host
from _collect import Collect


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernel.KERNEL.wait()
    if k is None:
        pytest.skip("no compiled CPU kernel on this machine")
    return k


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern_comes_back_as_its_exact_value(kernel, dtype):
    """The kernel's conversion to double (subnormals, inf, NaN) against torch's, for all 65536
    bit patterns, each a tensor of its own in one batched call."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype).reshape(-1, 1).clone()
    hb = HostBatch()
    rows = list(values.unbind())
    assert all(hb.add(r) for r in rows)
    out = hb.measure()
    want = values.abs().double().reshape(-1).tolist()
    got_min, got_max = out[0::2], out[1::2]
    assert all(_same(a, w) and _same(b, w) for a, b, w in zip(got_min, got_max, want))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_host_floats_equal_the_tensor_path(kernel, dtype):
    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(1000, generator=g).to(dtype), torch.randn(70000, generator=g).to(dtype),
             torch.tensor([0.0, -1e-30, 7.0]).to(dtype), torch.tensor([1.0, -math.inf, 2.0]).to(dtype),
             torch.tensor([1.0, math.nan, -math.inf]).to(dtype)]
    for x in cases:
        want = [float(v) for v in stats.abs_minmax_torch_cpu(x)]
        got = measure_host(x)
        assert all(v.__class__ is float for v in got)
        assert all(_same(a, b) for a, b in zip(got, want)), (x, got, want)
    # what the kernel cannot take as it is still goes through measure (tensors, or a note)
    odd = [torch.randn(4, 4).t(), torch.arange(5), torch.empty(0), torch.zeros(3, device="meta")]
    for x in odd:
        assert HostBatch().add(x) is False
        r = measure_host(x)
        assert r.__class__ is str or all(isinstance(v, torch.Tensor) for v in r)


def test_the_per_frame_call_keeps_each_threads_values_apart(kernel):
    """kernel.host on small tensors (the recorder's per-frame call, one C call returning its
    pair, no shared buffer) from 6 threads at once: each gets its own tensor's values."""
    import threading

    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(64, generator=g) * (i + 1) for i in range(6)]
    want = [(t.abs().min().item(), t.abs().max().item()) for t in tensors]
    wrong: list = []

    def run(i: int) -> None:
        for _ in range(3000):
            got = kernel.host(tensors[i])
            if got != want[i]:
                wrong.append((i, got))
                return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


class Scaler(nn.Module):
    """The parent modifies its child's output in place after the child returned."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = None

    def forward(self, x):
        y = self.lin(x)
        self.seen = y.detach().clone()
        y.mul_(1000.0)  # after lin returned: lin's frame must show y as it was then
        return y


def test_an_output_modified_in_place_later_is_reported_as_it_was_at_return(kernel):
    torch.manual_seed(0)
    model = Scaler()
    sink = Collect()
    with torch.no_grad(), watch(model, sinks=[sink]):
        out = model(torch.randn(3, 4))
    frames = {f.module: {t.name: (t.abs_min, t.abs_max) for t in f.tensors} for f in sink.batches[0].frames}
    a = model.seen.abs()
    assert frames["lin"]["output"] == (a.min().item(), a.max().item())
    b = out.abs()
    assert frames[""]["output"] == (b.min().item(), b.max().item())
    assert frames[""]["output"] != frames["lin"]["output"]


class Twice(nn.Module):
    """One tensor as two inputs, and an input that is also the output (an in-place op)."""

    def __init__(self):
        super().__init__()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(x)


def test_one_frame_holds_each_value_at_its_place(kernel):
    """Weights, inputs and outputs of one frame come from one kernel call and land at their own
    places; values equal the per-tensor path's; a detection still names the tensor and kind."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Twice(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    sink = Collect()
    with watch(model, sinks=[sink]):
        model(x)
    f = {fr.module: {t.name: (t.abs_min, t.abs_max) for t in fr.tensors} for fr in sink.batches[0].frames}

    def amm(t):
        a = t.detach().abs()
        return a.min().item(), a.max().item()

    assert f["0"]["weight"] == amm(model[0].weight) and f["0"]["bias"] == amm(model[0].bias)
    assert f["2"]["weight"] == amm(model[2].weight)
    h = model[1](model[0](x))
    assert f["1"]["output"] == f["1"]["input[0]"] == amm(h) == f["2"]["input[0]"]
    with torch.no_grad():
        model[2].weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteDetected) as ei, watch(model, sinks=[Collect()]):
        model(x)
    assert (ei.value.event.module, ei.value.event.tensor, ei.value.event.kind) == ("2", "weight", "inf")


def test_the_guard_reads_every_cpu_gradient_in_one_kernel_call(kernel, monkeypatch):
    calls = []
    real = HostBatch.measure

    def counted(self):
        calls.append(len(self.ns))
        return real(self)

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, sinks=[Collect()]):
        model(torch.randn(2, 4)).square().mean().backward()
        monkeypatch.setattr(HostBatch, "measure", counted)
        opt.step()
        assert calls == [12]  # every weight and bias gradient, one call
        monkeypatch.setattr(HostBatch, "measure", real)
        opt.zero_grad()
        model(torch.randn(2, 4)).square().mean().backward()
        model[3].bias.grad[1] = float("nan")
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
    assert (ei.value.event.module, ei.value.event.tensor) == ("3", "bias.grad")


def test_a_frame_the_kernel_fails_on_leaves_no_unread_places(kernel, monkeypatch, caplog):
    """A failing kernel call drops that frame (counted, logged once); the batch is still read."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def broken(*_):
        raise RuntimeError("kernel says no")

    sink = Collect()
    with watch(model, sinks=[sink]) as w:
        monkeypatch.setattr(HostBatch, "measure", broken)  # a frame's many tensors
        monkeypatch.setattr(kernel, "host", broken)  # one tensor (the one-in-one-out frames)
        model(torch.randn(2, 4))
        monkeypatch.undo()
        model(torch.randn(2, 4))
    assert w.hook_failures == 3 and w.detections == 0
    assert [len(b.frames) for b in sink.batches] == [0, 3] or [len(b.frames) for b in sink.batches] == [3]
    assert all(t.abs_max is not None for f in sink.batches[-1].frames for t in f.tensors)


def test_measure_still_returns_device_style_pairs(kernel):
    """The per-tensor API other parts use is unchanged: 0-d tensors."""
    mn, mx = measure(torch.tensor([-3.0, 2.0]))
    assert isinstance(mn, torch.Tensor) and (mn.item(), mx.item()) == (2.0, 3.0)
    lo, hi = kernel(torch.tensor([-3.0, 2.0]))
    assert (lo.item(), hi.item()) == (2.0, 3.0)


def test_the_guard_gathers_plain_cpu_gradients_without_a_python_call_each(kernel, monkeypatch):
    """The guard's cost at thousands of parameters is its per-gradient Python: plain dense CPU
    gradients are gathered in bulk (no HostBatch.add per gradient), and still one kernel call."""
    adds = []
    real_add = HostBatch.add

    def counted(self, t):
        adds.append(t)
        return real_add(self, t)

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(50)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, sinks=[Collect()]):
        model(torch.randn(2, 4)).square().mean().backward()
        monkeypatch.setattr(HostBatch, "add", counted)
        opt.step()  # healthy: no detection
        assert adds == []
        opt.zero_grad()
        model(torch.randn(2, 4)).square().mean().backward()
        model[49].weight.grad[3, 3] = float("inf")  # the last gradient the bulk read covers
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
    assert (ei.value.event.module, ei.value.event.tensor) == ("49", "weight.grad")


@pytest.mark.parametrize("odd", ["transposed", "empty", "sparse", "none"])
def test_the_guard_still_reads_odd_gradients_among_plain_ones(kernel, odd):
    """One gradient the bulk gather cannot take (not contiguous, empty, sparse, missing)
    sends the guard down the per-gradient path: an inf anywhere is still found."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    if odd == "empty":
        model[2].register_parameter("empty", nn.Parameter(torch.zeros(0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model, sinks=[Collect()]):
        model(torch.randn(2, 4)).square().mean().backward()
        g = model[2].weight.grad
        if odd == "transposed":
            model[2].weight.grad = g.t().contiguous().t()
        elif odd == "sparse":
            model[2].weight.grad = g.to_sparse()
        elif odd == "none":
            model[2].bias.grad = None
        elif odd == "empty":
            model[2].empty.grad = torch.zeros(0)
        opt.step()  # healthy: no detection
        opt.zero_grad()
        model(torch.randn(2, 4)).square().mean().backward()
        if odd == "transposed":
            model[2].weight.grad = model[2].weight.grad.t().contiguous().t()
        elif odd == "sparse":
            model[2].weight.grad = model[2].weight.grad.to_sparse()
        elif odd == "none":
            model[2].bias.grad = None
        elif odd == "empty":
            model[2].empty.grad = torch.zeros(0)
        model[6].bias.grad[0] = float("nan")
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
    assert (ei.value.event.module, ei.value.event.tensor) == ("6", "bias.grad")


def test_a_one_in_one_out_cpu_frame_leaves_autograd_alone(kernel, monkeypatch):
    """On the C kernel's route a frame of one tensor in and one out runs no torch op, so its hook
    does not switch autograd off and on around it (two calls a frame, about 0.2 us); a frame the
    route does not take (two inputs) still does. The frames' values are the tensors' own."""
    from tensorwatch_otel.core.batch import forward_hook
    from tensorwatch_otel.core.frames import recorder

    switches = []
    real = torch._C._set_grad_enabled
    for module in (forward_hook, recorder):  # (each keeps torch's call as a module-level alias)
        monkeypatch.setattr(module, "_set_grad", lambda on: (switches.append(on), real(on))[1], raising=False)

    class Pair(nn.Module):
        def forward(self, a, b):
            return a * b

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    pair = Pair()
    sink = Collect()
    with watch(model, sinks=[sink]), watch(pair, sinks=[]):
        x = torch.randn(3, 8)
        model(x).square().mean().backward()  # (its frames offer the weights as rows of the next read)
        del switches[:]
        for _ in range(2):
            model(x).square().mean().backward()
        assert switches == []
        pair(x, x)
        assert switches == [False, True]
    frames = {f.module: f for f in sink.batches[-1].frames}
    with torch.no_grad():
        h = model[0](x)
        want = {"0": (x, h), "1": (h, h.relu()), "2": (h.relu(), model(x))}
        weights = {"0": model[0].weight, "2": model[2].bias}
    for name, (inp, out) in want.items():
        got = {t.name: (t.abs_min, t.abs_max) for t in frames[name].tensors}
        for key, t in (("input[0]", inp), ("output", out)):
            a = t.abs()
            assert got[key] == (a.min().item(), a.max().item()), (name, key, got[key])
    for name, w in weights.items():
        a = w.detach().abs()
        assert frames[name].tensors[0].name in ("weight", "bias")
        assert {t.name: (t.abs_min, t.abs_max) for t in frames[name].tensors}[
            "weight" if w.dim() == 2 else "bias"] == (a.min().item(), a.max().item())
