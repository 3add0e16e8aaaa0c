"""The model-integrity check (core/frames/param_index.py's ParamIndex.current): whether every
module still holds the parameters and submodules last seen, at each batch's first call and
at each optimizer step. Where the CPU kernel is loaded its C function `same_entries` walks the
dicts (cpu_kernel_host.c); it must answer as the Python compare does for every change a model
can go through, and the watcher must find a replacement on either route."""

from __future__ import annotations

import array
from collections import OrderedDict
from itertools import chain

import pytest
import torch
from torch import nn

from _collect import Collect
from _models import TwoLinear as Net
from tensorwatch_otel import watch
from tensorwatch_otel.core.measure import cpu_kernel


@pytest.fixture(scope="module")
def same_entries():
    kernel = cpu_kernel.KERNEL.wait(120)
    assert kernel is not None, "the CPU kernel did not build (a C compiler and Python's headers are needed)"
    fn = getattr(kernel, "same_entries", None)
    assert fn is not None, "the kernel's extension module has no same_entries"
    return fn


def _dicts(model: nn.Module):
    return [d for m in model.modules() for d in (m._parameters, m._modules)]


def _snapshot(dicts):
    ids = list(map(id, chain.from_iterable(map(dict.values, dicts))))
    return list(chain.from_iterable(dicts)), ids, array.array("Q", ids)


def _python_same(dicts, keys, ids) -> bool:
    """ParamIndex.current's compare without the kernel."""
    return list(chain.from_iterable(dicts)) == keys and \
        list(map(id, chain.from_iterable(map(dict.values, dicts)))) == ids


def _replace_weight(m):
    m.a.weight = nn.Parameter(m.a.weight.detach().clone())


def _same_values_new_parameter(m):  # equal values, another object: must read as changed
    m.b.bias = nn.Parameter(m.b.bias.detach())


def _add_parameter(m):
    m.a.extra = nn.Parameter(torch.zeros(1))


def _remove_parameter(m):
    del m.b._parameters["bias"]


def _set_to_none(m):
    m.b.bias = None


def _swap_module(m):
    m.b = nn.Linear(16, 4)


def _reorder(m):  # the same entries in another order
    d = m.a._parameters
    d["weight"] = d.pop("weight")


def _rename(m):
    d = m.a._parameters
    d["weight2"] = d.pop("weight")


def _swap_two_parameters(m):  # both still held, each under the other's name
    m.a._parameters["weight"], m.b._parameters["weight"] = m.b._parameters["weight"], m.a._parameters["weight"]


def _nothing(m):
    pass


def _load_state_dict_assign(m):
    m.load_state_dict(Net().state_dict(), assign=True)


@pytest.mark.parametrize("change", [_nothing, _replace_weight, _same_values_new_parameter, _add_parameter,
                                    _remove_parameter, _set_to_none, _swap_module, _reorder, _rename,
                                    _swap_two_parameters, _load_state_dict_assign])
def test_same_entries_answers_as_the_python_compare(same_entries, change):
    torch.manual_seed(0)
    model = Net()
    dicts = _dicts(model)
    keys, ids, words = _snapshot(dicts)
    assert same_entries(dicts, keys, words) is True and _python_same(dicts, keys, ids)
    change(model)
    expected = _python_same(dicts, keys, ids)
    assert same_entries(dicts, keys, words) is expected
    assert expected is (change is _nothing)


def test_same_entries_says_false_where_it_cannot_compare_and_refuses_bad_arguments(same_entries):
    model = Net()
    dicts = _dicts(model)
    keys, ids, words = _snapshot(dicts)
    assert same_entries(dicts, keys, words[:-1]) is False  # one id short
    assert same_entries(dicts, keys[:-1], words[:-1]) is False  # the dicts hold one entry more
    assert same_entries(dicts + [{}], keys, words) is True  # an empty dict adds nothing
    ordered = [OrderedDict(d) for d in dicts]  # not plain dicts: the Python compare decides
    assert same_entries(ordered, keys, words) is False and _python_same(ordered, keys, ids)
    odd = [{10 ** 6: None}]  # a key that is not a plain string (an equal one, another object)
    assert same_entries(odd, [int("1000000")], array.array("Q", [id(None)])) is False
    assert _python_same(odd, [int("1000000")], [id(None)])
    with pytest.raises(TypeError):
        same_entries(tuple(dicts), keys, words)
    with pytest.raises(TypeError):
        same_entries(dicts, keys)
    with pytest.raises(TypeError):
        same_entries(dicts, keys, ids)  # a list is not a buffer


@pytest.mark.parametrize("route", ["kernel", "python"])
def test_the_watcher_finds_replaced_parameters_on_either_route(same_entries, route, monkeypatch):
    """A parameter replaced after watch() is found at the next batch: its gradient named under
    its module (the step guard reads it), with the compare in C or in Python."""
    if route == "python":
        monkeypatch.setattr(cpu_kernel.KERNEL, "loaded", lambda: None)
    else:
        assert cpu_kernel.KERNEL.loaded() is not None
    _finds_a_replaced_weight()


def _finds_a_replaced_weight():
    torch.manual_seed(0)
    model = Net()
    w = watch(model, sinks=[Collect()])
    index = w._session.hooks.index
    model(torch.randn(4, 8)).sum().backward()
    scans = index.scans
    assert index.current()
    model(torch.randn(4, 8)).sum().backward()
    assert index.scans == scans  # nothing replaced: nothing scanned again
    _replace_weight(model)
    assert not index.current()
    model(torch.randn(4, 8)).sum().backward()
    assert index.scans == scans + 1 and index.current()
    assert index.owner(model.a.weight) is not None and index.owner(model.a.weight)[1] == "weight"
    w.detach()


def test_a_failing_compare_in_c_leaves_the_python_compare_to_decide(monkeypatch):
    """(never expected) `same_entries` raising: training goes on, replacements still found."""
    class Broken:
        @staticmethod
        def same_entries(*_args):
            raise TypeError("broken")

    monkeypatch.setattr(cpu_kernel.KERNEL, "loaded", lambda: Broken())
    _finds_a_replaced_weight()
