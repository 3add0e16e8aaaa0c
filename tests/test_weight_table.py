"""The weight table (core/measure/weights.py): a model's small CPU weights read in one kernel call per
batch, each frame still showing its weights as they were at its call."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.nn as nn

from tensorwatch_otel import NonFiniteDetected, watch
from tensorwatch_otel.core.measure import cpu_kernel
from tensorwatch_otel.core.frames.recorder import FrameRecorder
from tensorwatch_otel.core.measure.weights import SMALL
from _collect import Collect

INF, NAN = float("inf"), float("nan")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    k = cpu_kernel.KERNEL.wait()
    if k is None:
        pytest.skip("no compiled CPU kernel on this machine")
    return k


def amm(t):
    a = t.detach().abs()
    return a.min().item(), a.max().item()


def weights_of(batch):
    """{(module, weight name): (abs min, abs max)} of a batch's frames."""
    out = {}
    for f in batch.frames:
        for t in f.tensors:
            if t.name in ("weight", "bias"):
                out[(f.module, t.name)] = (t.abs_min, t.abs_max)
    return out


def train_step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def measured_one_by_one(monkeypatch):
    """The names of the weights measured at their call (not read from the table), as a list
    that fills while the test runs."""
    one_by_one = []
    real = FrameRecorder.param
    monkeypatch.setattr(FrameRecorder, "param", lambda self, rec, p, name, items: (
        one_by_one.append(name), real(self, rec, p, name, items))[1])
    return one_by_one


def test_small_weights_are_read_once_per_batch_with_their_values_at_each_step(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(40)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    one_by_one = measured_one_by_one(monkeypatch)
    sink = Collect()
    with watch(model, sinks=[sink]):
        train_step(model, opt, x)  # the first batch offers its weights: one by one
        assert len(one_by_one) == 80
        for _ in range(3):
            one_by_one.clear()
            expected = {(str(i), n): amm(getattr(m, n)) for i, m in enumerate(model) for n in ("weight", "bias")}
            train_step(model, opt, x)
            assert one_by_one == []  # every weight from the table's one read
            assert weights_of(sink.batches[-1]) == expected  # exact: the values at this batch


class WritesAhead(nn.Module):
    """Doubles a later module's weight in place during the forward, before that module runs."""

    def __init__(self, later: nn.Linear):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.later = [later]

    def forward(self, x):
        with torch.no_grad():
            self.later[0].weight.mul_(2)
        return self.lin(x)


def test_ten_thousand_small_weights_are_all_rows_from_the_second_batch_on(monkeypatch):
    """Every weight the first batch framed is a row at the second batch's read (the steady
    state of a sampled watch is reached at its second recorded batch, not its fourth)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5000)])  # 10,000 weights
    x = torch.randn(2, 4)
    one_by_one = measured_one_by_one(monkeypatch)
    with watch(model, sinks=[]), torch.no_grad():
        model(x)
        assert len(one_by_one) == 10_000  # the first batch offers them
        one_by_one.clear()
        model(x)
        assert one_by_one == []  # the second reads them all from the table


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_a_weight_written_in_place_before_its_call_shows_the_written_value(grad):
    torch.manual_seed(0)
    last = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), WritesAhead(last), last)
    sink = Collect()
    x = torch.randn(2, 4)
    with watch(model, sinks=[sink]), torch.set_grad_enabled(grad):
        for _ in range(4):
            before = amm(model[0].weight)
            model(x)
            frames = weights_of(sink.batches[-1])
            assert frames[("2", "weight")] == amm(last.weight)  # after this batch's doubling
            assert frames[("0", "weight")] == before


@pytest.mark.parametrize("change", ["same shape", "smaller", "view as another dtype", "half"])
def test_a_weight_given_new_data_between_batches_is_read_from_its_new_data(change):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
    sink = Collect()
    x = torch.randn(2, 6)
    with watch(model, sinks=[sink]), torch.no_grad():
        model(x)
        model(x)  # the table's rows are read
        w = model[1].weight
        if change == "same shape":
            w.data = torch.full((6, 6), 3.0)
        elif change == "smaller":  # the same storage, fewer elements
            w.data = w.data[:3]
            model[1] = nn.Identity()
            model.append(ReadsWeight(w))
        elif change == "view as another dtype":
            w.data = torch.full((6, 6), 1.5).view(torch.int32).view(torch.float32)
        else:
            model[1].half()
            x = x  # the input stays float: the module casts it below
            model[1].register_forward_pre_hook(lambda m, a: (a[0].half(),))
        model(x)
        frames = weights_of(sink.batches[-1])
        name = "2" if change == "smaller" else "1"
        assert frames[(name, "weight")] == amm(w if change == "smaller" else model[1].weight)


class ReadsWeight(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.weight = w

    def forward(self, x):
        return x[..., : self.weight.shape[1]] @ self.weight.t()


def test_replaced_parameters_are_read_and_the_old_ones_are_not_kept():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    sink = Collect()
    x = torch.randn(2, 4)
    with watch(model, sinks=[sink]), torch.no_grad():
        model(x)
        model(x)
        old = weakref.ref(model[1].weight)
        state = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
        model(x)
        assert weights_of(sink.batches[-1])[("1", "weight")] == (0.25, 0.25)
        model(x)
        gc.collect()
        assert old() is None  # the table let the replaced weight go


def test_a_large_weight_is_read_at_its_call():
    torch.manual_seed(0)
    big = nn.Linear(SMALL // 64 + 1, 64)  # more than SMALL elements: not a row
    model = nn.Sequential(big, nn.Linear(64, 4))
    assert big.weight.numel() > SMALL
    sink = Collect()
    x = torch.randn(2, big.in_features)
    with watch(model, sinks=[sink]):
        for _ in range(3):
            with torch.no_grad():
                big.weight[0, 0] = float(len(sink.batches) + 5)
            model(x)
            assert weights_of(sink.batches[-1])[("0", "weight")] == amm(big.weight)


def test_tied_weights_show_the_same_values_in_both_frames():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    model = nn.Sequential(a, b)
    sink = Collect()
    with watch(model, sinks=[sink]), torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 4))
        frames = weights_of(sink.batches[-1])
        assert frames[("0", "weight")] == frames[("1", "weight")] == amm(a.weight)


def test_an_inf_and_nan_weight_read_with_the_table_is_inf_nan():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1, bias=False))
    with watch(model, sinks=[Collect()]), torch.no_grad():
        model(torch.ones(1, 3))
        model(torch.ones(1, 3))  # the table holds both weights now
        model[1].weight.copy_(torch.tensor([[INF, NAN, 1.0]]))
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.ones(1, 3))
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind) == ("1", "weight", "inf,nan")
    assert math.isnan(ev.frames[-1].tensors[0].abs_max)


def test_a_chain_under_inference_mode_from_a_normal_input_is_recorded():
    """One tensor in, one out: an inference-mode output has no version counter, so the frame is
    taken the general way (no cache entry), with the same values."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    x = torch.randn(2, 4)
    sink = Collect()
    with watch(model, sinks=[sink]) as w:
        for _ in range(3):
            with torch.inference_mode():
                model(x)
    assert w.hook_failures == 0
    frames = sink.batches[-1].frames
    assert [f.module for f in frames] == ["0", "1", "2", "3", ""]
    with torch.no_grad():
        h = x
        for i, lin in enumerate(model):
            h = lin(h)
            out = next(t for t in frames[i].tensors if t.name == "output")
            assert (out.abs_min, out.abs_max) == amm(h)


def test_a_model_made_under_inference_mode_is_recorded():
    """Weights made under inference_mode have no version counter: measured at each call (no
    cache, no row), never a failed frame."""
    torch.manual_seed(0)
    with torch.inference_mode():
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    x = torch.randn(2, 4)
    sink = Collect()
    with watch(model, sinks=[sink]) as w:
        for k in range(3):
            with torch.inference_mode():
                model[1].weight[0, 0] = float(k + 3)
                model(x)
            assert weights_of(sink.batches[-1])[("1", "weight")] == amm(model[1].weight)
    assert w.hook_failures == 0
    assert [f.module for f in sink.batches[-1].frames] == ["0", "1", "2", ""]


class FreesItsWeight(nn.Module):
    """As FSDP does with an unsharded weight: the storage is allocated and filled before the
    module runs and freed (resized to 0 bytes) after the batch; the tensor object stays."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.full = self.lin.weight.detach().clone()

    def refill(self, value):
        w = self.lin.weight
        with torch.no_grad():
            w.untyped_storage().resize_(self.full.numel() * self.full.element_size())
            w.copy_(torch.full_like(self.full, value))

    def free(self):
        self.lin.weight.untyped_storage().resize_(0)

    def forward(self, x):
        return self.lin(x)


def test_a_weight_whose_storage_is_freed_between_batches_is_never_read_freed():
    """The table's read comes at a batch's first frame, before later modules refill their
    weights: a freed one must not be read there (a crash), and each frame shows its value."""
    torch.manual_seed(0)
    late = FreesItsWeight()
    model = nn.Sequential(nn.Linear(4, 4), late)
    late.register_forward_pre_hook(lambda m, a: m.refill(float(len(sink.batches) + 2)))
    sink = Collect()
    x = torch.randn(2, 4)
    with watch(model, sinks=[sink]) as w, torch.no_grad():
        for k in range(4):
            model(x)
            assert weights_of(sink.batches[-1])[("1.lin", "weight")] == (k + 2.0, k + 2.0)
            late.free()
    assert w.hook_failures == 0


class Residual(nn.Module):
    """A norm whose input is a sum made in the forward (no module's output), then changed in
    place after the norm returned."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.seen = {}

    def forward(self, x):
        h = x + self.lin(x)
        self.seen["h"] = amm(h)
        y = self.norm(h)
        self.seen["y"] = amm(y)
        h.mul_(1000.0)  # after the norm returned: its frame keeps h as it was
        y.mul_(1000.0)
        return h.sum() + y.sum()


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_a_module_fed_by_the_forward_itself_shows_its_input_and_output_as_at_its_call(grad):
    torch.manual_seed(0)
    model = Residual()
    sink = Collect()
    with watch(model, sinks=[sink]) as w, torch.set_grad_enabled(grad):
        for _ in range(3):
            model(torch.randn(2, 4))
            frames = {f.module: {t.name: (t.abs_min, t.abs_max) for t in f.tensors} for f in sink.batches[-1].frames}
            assert frames["norm"]["input[0]"] == model.seen["h"]
            assert frames["norm"]["output"] == model.seen["y"]
            assert frames["norm"]["weight"] == amm(model.norm.weight)
    assert w.hook_failures == 0


def test_weights_beyond_the_table_s_room_are_measured_at_their_call_and_not_offered_again(monkeypatch):
    """Past ELEMENTS a weight stays off the table for good: its frames measure it at the call
    (the values right) without asking again every batch whether it could be a row."""
    from tensorwatch_otel.core.frames import recorder
    from tensorwatch_otel.core.measure import weights

    monkeypatch.setattr(weights, "ELEMENTS", 40)  # room for two Linear(4, 4) (20 elements each)
    asked = []
    real = recorder.takes
    monkeypatch.setattr(recorder, "takes", lambda p: asked.append(p) or real(p))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    sink = Collect()
    with watch(model, sinks=[sink]), torch.no_grad():
        for k in range(5):
            asked.clear()
            model[5].weight[0, 0] = float(k + 3)
            model(torch.randn(2, 4))
            assert weights_of(sink.batches[-1])[("5", "weight")] == amm(model[5].weight)
    assert asked == []  # the last batch asked nothing
