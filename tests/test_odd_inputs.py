"""Odd values flowing through a watched model: each gets the right statistics or note, training
goes on (forward, backward, optimizer step), and nothing is logged more than once."""

from __future__ import annotations

import collections
import dataclasses
import logging
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from tensorwatch_otel import NonFiniteEvent, watch
from _collect import Collect


class Echo(nn.Module):
    def forward(self, value):
        return value


class Holder(nn.Module):
    """Passes `value` through a submodule, and trains a real linear layer alongside."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.echo = Echo()

    def forward(self, x, value):
        self.echo(value)
        return self.lin(x)


class Plain(torch.Tensor):
    """A plain Python tensor subclass."""


class Wrapper(torch.Tensor):
    """A __torch_dispatch__ wrapper subclass: its data lives in `.elem`, not in its own storage."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.elem if isinstance(x, Wrapper) else x  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: Wrapper(x) if isinstance(x, torch.Tensor) else x, out)


def _coo(full: bool):
    warnings.filterwarnings("ignore", "Sparse invariant checks")
    if full:
        return torch.sparse_coo_tensor(torch.tensor([[0, 0, 1, 1], [0, 1, 0, 1]]), torch.tensor([-3., 4., 2., -5.]),
                                       (2, 2))
    return torch.sparse_coo_tensor(torch.tensor([[0, 1], [2, 0]]), torch.tensor([-3., 4.]), (3, 3))


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.tensor([-1.0, 0.5, 2.0]), 0.1, 10, torch.quint8)


def _csr():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.tensor([[0., -2.], [3., 0.]]).to_sparse_csr()


def _dense_values(t):
    """Independent reference: the values a tensor stands for, as a dense float64 tensor."""
    if t.layout is not torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.dequantize()
    if t.dtype is torch.bool or t.dtype.is_floating_point and t.element_size() == 1:
        t = t.to(torch.float64)
    return t.as_subclass(torch.Tensor).to(torch.complex128 if t.is_complex() else torch.float64)


def _expect(t):
    a = _dense_values(t).abs()
    return a.min().item(), a.max().item()


# (id, value factory, expected dtype name or None, expected note or None)
TENSORS = [
    ("float32", lambda: torch.tensor([[-1.5, 0.25], [3.0, -0.5]]), "float32", None),
    ("float16", lambda: torch.tensor([-2.0, 1e4]).half(), "float16", None),
    ("bfloat16", lambda: torch.tensor([-2.0, 0.5]).bfloat16(), "bfloat16", None),
    ("float64", lambda: torch.tensor([-1e300, 1e-300], dtype=torch.float64), "float64", None),
    ("scalar", lambda: torch.tensor(-3.0), "float32", None),
    ("int64", lambda: torch.tensor([-7, 5, 3]), "int64", None),
    ("int8_min", lambda: torch.tensor([-128, 5, -3], dtype=torch.int8), "int8", None),
    ("int32", lambda: torch.tensor([-2 ** 31, 9], dtype=torch.int32), "int32", None),
    ("uint8", lambda: torch.tensor([200, 3], dtype=torch.uint8), "uint8", None),
    ("bool", lambda: torch.tensor([True, False, True]), "bool", None),
    ("complex", lambda: torch.tensor([3 + 4j, 1j]), "complex64", None),
    ("sparse_coo", lambda: _coo(False), "float32", None),
    ("sparse_coo_full", lambda: _coo(True), "float32", None),
    ("sparse_csr", _csr, "float32", None),
    ("quantized", _quantized, "quint8", None),
    ("fp8_e4m3", lambda: torch.tensor([-2.0, 0.5, 448.0]).to(torch.float8_e4m3fn), "float8_e4m3fn", None),
    ("fp8_e5m2", lambda: torch.tensor([-2.0, 0.5, 57344.0]).to(torch.float8_e5m2), "float8_e5m2", None),
    ("plain_subclass", lambda: torch.tensor([-1.0, 2.0]).as_subclass(Plain), "float32", None),
    ("empty", lambda: torch.empty(0, 3), None, "empty"),
    ("meta", lambda: torch.empty(2, 3, device="meta"), None, "no data"),
    ("wrapper_subclass", lambda: Wrapper(torch.tensor([-1.0, 2.0])), None, "no data"),
]


@pytest.mark.parametrize("case", TENSORS, ids=[c[0] for c in TENSORS])
def test_odd_tensor_gets_right_stat_and_training_goes_on(case, caplog):
    _, make, dtype, note = case
    torch.manual_seed(0)
    model = Holder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    x = torch.randn(4, 2)
    with caplog.at_level(logging.DEBUG, logger="tensorwatch_otel"):
        with watch(model, sinks=[sink]) as w:
            for _ in range(3):
                value = make()
                loss = model(x, value).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            assert w.batch_number == 3
    assert [e for e in sink.events if isinstance(e, NonFiniteEvent)] == []
    assert len(sink.batches) == 3
    for b in sink.batches:
        echo = next(f for f in b.frames if f.module == "echo")
        root = b.frames[-1]
        assert [t.name for t in echo.tensors] == ["input[0]", "output"]
        assert [t.name for t in root.tensors] == ["input[0]", "input[1]", "output"]
        for t in echo.tensors + root.tensors[1:2]:
            if note:
                assert (t.note, t.abs_min, t.abs_max) == (note, None, None)
            else:
                assert t.note == ""
                assert (t.abs_min, t.abs_max) == _expect(value)
                assert t.dtype == dtype
                if dtype.startswith(("float", "bfloat")):
                    assert t.range_used == pytest.approx(t.abs_max / torch.finfo(getattr(torch, dtype)).max)
                else:
                    assert t.range_used is None
        lin = next(f for f in b.frames if f.module == "lin")
        assert [t.note for t in lin.tensors] == ["", "", "", ""]
    # nothing logged more than once (the wrapper subclass may say once that it has no data)
    counts = collections.Counter(r.getMessage() for r in caplog.records)
    assert all(n == 1 for n in counts.values()), counts
    if note == "no data" and "wrapper" in case[0]:
        assert len(counts) <= 1


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    label: str
    extras: list


class Structured(nn.Module):
    def forward(self, x):
        return {"main": x * 2, "aux": (x - 1, [None, 3, x * 0]), "meta": "text",
                "obj": object(), "dc": Out(x + 5, "lbl", [x * -4])}


def test_nested_structures_and_non_tensors():
    model = Structured()
    sink = Collect()
    x = torch.tensor([[1.0, -2.0]])
    with watch(model, sinks=[sink]):
        model(x)
    (frame,) = sink.batches[0].frames
    got = [(t.name, t.note, t.abs_min, t.abs_max) for t in frame.tensors]
    assert got == [
        ("input[0]", "", 1.0, 2.0),
        ("output.main", "", 2.0, 4.0),
        ("output.aux[0]", "", 0.0, 3.0),
        ("output.aux[1][0]", "None", None, None),
        ("output.aux[1][1]", "not a tensor", None, None),
        ("output.aux[1][2]", "", 0.0, 0.0),
        ("output.meta", "not a tensor", None, None),
        ("output.obj", "not a tensor", None, None),
        ("output.dc.hidden", "", 3.0, 6.0),
        ("output.dc.label", "not a tensor", None, None),
        ("output.dc.extras[0]", "", 4.0, 8.0),
    ]


class KwOnly(nn.Module):
    def forward(self, x, *, mask=None, scale=1.0, name="n", extra=None):
        return x * scale


class KwRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.kw = KwOnly()

    def forward(self, x):
        return self.kw(x, mask=None, scale=2.0, name="abc", extra=torch.tensor([-9.0]))


def test_keyword_only_inputs():
    model = KwRoot()
    sink = Collect()
    with watch(model, sinks=[sink]):
        model(torch.tensor([1.0, -3.0]))
    kw = sink.batches[0].frames[0]
    assert [(t.name, t.note, t.abs_min, t.abs_max) for t in kw.tensors] == [
        ("input[0]", "", 1.0, 3.0),
        ("input.mask", "None", None, None),
        ("input.scale", "not a tensor", None, None),
        ("input.name", "not a tensor", None, None),
        ("input.extra", "", 9.0, 9.0),
        ("output", "", 2.0, 6.0),
    ]


class NonTensorArgs(nn.Module):
    def forward(self, x, n, s, obj, none):
        return x


def test_non_tensor_positional_inputs_and_outputs():
    model = nn.Sequential()
    model.add_module("m", NonTensorArgs())

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = NonTensorArgs()
            self.r = Echo()

        def forward(self, x):
            self.r(7)
            self.r("text")
            self.r(None)
            return self.m(x, 3, "s", object(), None)

    root = Root()
    sink = Collect()
    with watch(root, sinks=[sink]):
        root(torch.tensor([2.0]))
    frames = sink.batches[0].frames
    assert [f.module for f in frames] == ["r", "r", "r", "m", ""]
    assert [(t.name, t.note) for t in frames[0].tensors] == [("input[0]", "not a tensor"), ("output", "not a tensor")]
    assert [(t.name, t.note) for t in frames[2].tensors] == [("input[0]", "None"), ("output", "None")]
    assert [(t.name, t.note) for t in frames[3].tensors] == [
        ("input[0]", ""), ("input[1]", "not a tensor"), ("input[2]", "not a tensor"),
        ("input[3]", "not a tensor"), ("input[4]", "None"), ("output", "")]


class Tree(nn.Module):
    """Calls itself recursively, and calls its shared child several times."""

    def __init__(self):
        super().__init__()
        self.leaf = nn.Linear(2, 2)

    def forward(self, x, depth=3):
        x = self.leaf(x)
        if depth:
            x = self(x, depth=depth - 1)
        return x


def test_recursive_and_shared_calls_train():
    torch.manual_seed(0)
    model = Tree()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = Collect()
    x = torch.randn(3, 2)
    with watch(model, sinks=[sink]) as w:
        for _ in range(2):
            loss = model(x).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert w.batch_number == 2
        model(x)  # with the weights as they are now
    frames = sink.batches[2].frames
    assert [f.module for f in frames] == ["leaf"] * 4 + [""] * 4
    h = x
    for f in frames[:4]:
        assert (f.tensors[0].abs_min, f.tensors[0].abs_max) == tuple(v.item() for v in torch.aminmax(
            model.leaf.weight.detach().abs()))
        assert (f.tensors[2].abs_min, f.tensors[2].abs_max) == tuple(v.item() for v in torch.aminmax(h.abs()))
        h = model.leaf(h).detach()
    assert [t.name for t in frames[4].tensors] == ["input[0]", "input.depth", "output"]


def test_inference_mode_tensors():
    model = Holder()
    sink = Collect()
    x = torch.tensor([[1.0, -4.0]])
    with watch(model, sinks=[sink]):
        with torch.inference_mode():
            model(x, torch.tensor([-6.0, 0.5]))
            model(x, torch.tensor([-6.0, 0.5]))
    for b in sink.batches:
        echo = next(f for f in b.frames if f.module == "echo")
        assert [(t.abs_min, t.abs_max) for t in echo.tensors] == [(0.5, 6.0), (0.5, 6.0)]
        lin = next(f for f in b.frames if f.module == "lin")
        assert lin.tensors[2].abs_max == 4.0


def test_nan_in_odd_dtypes_is_detected():
    model = Holder()
    with watch(model, sinks=[Collect()]) as w:
        for make in (lambda: torch.tensor([1.0, float("nan")]).half(),
                     lambda: torch.tensor([complex(float("inf"), 0)]),
                     lambda: torch.tensor([1.0, float("inf")]).bfloat16()):
            with pytest.raises(ValueError) as ei:
                model(torch.ones(1, 2), make())
            assert (ei.value.event.module, ei.value.event.tensor) == ("echo", "input[0]")
        assert w.batch_number == 3
