"""What is measured: a wrapper tensor subclass (a scaled fp8-like tensor: data + scale, as
torchao's Float8Tensor / NF4Tensor) is measured through its values, a plain result object the
root returns is looked into (`output.loss`), and an event's kind is exactly the named tensor's:
"inf", "nan" or "inf,nan"."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._pytree import tree_map

import pytest
from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, watch

INF, NAN = math.inf, math.nan
aten = torch.ops.aten


class Scaled(torch.Tensor):
    """A wrapper subclass without storage of its own: `data * scale` is its value. Every op sees
    the dequantized value; detach keeps the wrapper (so it can be an nn.Parameter)."""

    @staticmethod
    def __new__(cls, data, scale):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    def __init__(self, data, scale):
        self._data = data
        self._scale = scale

    def __tensor_flatten__(self):
        return ["_data", "_scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Scaled(inner["_data"], inner["_scale"])

    def __repr__(self):
        return f"Scaled({self._data}, {self._scale})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # like torchao's tensors: the few ops a linear layer needs, anything else refused
        if func is aten.detach.default:
            return cls(args[0]._data, args[0]._scale)
        if func is aten.t.default:
            return cls(args[0]._data.t(), args[0]._scale)
        if func in (aten.mm.default, aten.addmm.default, aten.linear.default):
            unwrap = lambda x: x._data.float() * x._scale if isinstance(x, Scaled) else x  # noqa: E731
            return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        raise NotImplementedError(f"{cls.__name__} does not support {func}")


class Dequantizing(Scaled):
    """The same, offering dequantize() (as torchao's tensors do)."""

    def dequantize(self):
        return self._data.float() * self._scale


def _scaled(cls, inf_in: str):
    data = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    scale = torch.tensor(0.5)
    if inf_in == "data":
        data[1, 0] = INF
    return cls(data, scale)


class ScaledLinear(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


@pytest.mark.parametrize("cls", [Dequantizing, Scaled], ids=["dequantize", "inner_tensors"])
def test_a_wrapper_subclass_weight_holding_inf_is_detected_with_kind_inf(cls):
    model = nn.Sequential(ScaledLinear(_scaled(cls, "data")))
    sink = Collect()
    with watch(model, sinks=[sink]):
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.ones(1, 2))
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind) == ("0", "weight", "inf")
    w = ev.frames[-1].tensors[0]
    assert w.name == "weight" and w.abs_max == INF and w.note == ""
    if cls is Dequantizing:  # measured as its values: 0.5 * [1, 2, inf, 4]
        assert w.abs_min == 0.5


def test_a_finite_wrapper_subclass_is_measured_as_its_dequantized_values():
    model = nn.Sequential(ScaledLinear(_scaled(Dequantizing, "none")))
    sink = Collect()
    with watch(model, sinks=[sink]):
        model(torch.ones(1, 2))
    stats = {t.name: t for t in sink.batches[0].frames[0].tensors}
    assert (stats["weight"].abs_min, stats["weight"].abs_max) == (0.5, 2.0)


class MakesScaled(nn.Module):
    def forward(self, x):
        return Dequantizing(x.detach().clone(), torch.tensor(INF))


def test_a_wrapper_subclass_output_holding_inf_is_named():
    model = nn.Sequential(MakesScaled())
    with watch(model, sinks=[Collect()]):
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.tensor([[1.0, 2.0]]))
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind) == ("0", "output", "inf")


class Result:
    """A plain result object (not a dataclass, not a dict)."""

    def __init__(self, loss, logits):
        self.loss = loss
        self.logits = logits
        self.step = 3
        self.cache = [torch.ones(2)]  # lists of tensors in an object (a key/value cache) are not walked
        self._private = torch.tensor(float("nan"))


class ReturnsResult(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, boom=False):
        logits = self.lin(x)
        loss = logits.pow(2).mean() * (INF if boom else 1.0)
        return Result(loss, logits)


def test_a_plain_result_objects_loss_is_looked_into_and_named():
    torch.manual_seed(0)
    model = ReturnsResult()
    sink = Collect()
    with watch(model, sinks=[sink]):
        model(torch.ones(1, 2))
        names = [t.name for t in sink.batches[0].frames[-1].tensors]
        assert "output.loss" in names and "output.logits" in names
        assert not any(n.startswith(("output._private", "output.cache")) or n == "output.step" for n in names)
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.ones(1, 2), boom=True)
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind) == ("", "output.loss", "inf")


class Emits(nn.Module):
    def __init__(self, values):
        super().__init__()
        self.values = values

    def forward(self, x):
        return x + torch.tensor(self.values)


@pytest.mark.parametrize("values,kind", [([INF, 1.0], "inf"), ([-INF, 1.0], "inf"), ([NAN, 1.0], "nan"),
                                         ([INF, NAN, 1.0], "inf,nan"), ([NAN, -INF], "inf,nan"),
                                         ([INF, INF], "inf"), ([NAN, NAN], "nan")])
@pytest.mark.parametrize("check", ["batch", "module"])
def test_the_kind_is_exactly_what_the_named_tensor_holds(values, kind, check):
    model = nn.Sequential(Emits(values))
    with watch(model, sinks=[Collect()], check=check):
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.zeros(len(values)))
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind) == ("0", "output", kind)


def test_the_kind_is_the_named_weights_not_the_frames():
    # an inf weight times a zero input makes a nan output: the weight held only inf
    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[INF, 1.0]]))
    model = nn.Sequential(lin)
    with watch(model, sinks=[Collect()]):
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.tensor([[0.0, 1.0]]))
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind) == ("0", "weight", "inf")
    assert math.isnan(ev.frames[-1].tensors[-1].abs_max)  # the output did hold nan


def test_a_weight_holding_inf_and_nan_is_inf_nan():
    lin = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[INF, NAN, 1.0]]))
    model = nn.Sequential(lin)
    with watch(model, sinks=[Collect()]):
        with pytest.raises(NonFiniteDetected) as ei:
            model(torch.ones(1, 3))
    assert (ei.value.event.tensor, ei.value.event.kind) == ("weight", "inf,nan")
