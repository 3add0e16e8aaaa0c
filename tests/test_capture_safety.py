"""Captures are copied between machines and replayed: load_capture(path) never unpickles
arbitrary objects (a pickled object in the file must not run), a file it cannot read safely is
one ValueError naming the file, and what the writer stores is exactly what the safe loader
reads (tensors, containers of them, plain values, RNG states)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import random

import torch
from torch import nn

import pytest
from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, load_capture, watch
from tensorwatch_otel.core.batch.capture import FORMAT


class Evil:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def _capture_dict(**extra) -> dict:
    d = {"format": FORMAT, "batch_number": 3, "rank": 0, "args": (torch.ones(2),), "kwargs": {},
         "rng": {"cpu": torch.get_rng_state()}}
    d.update(extra)
    return d


def test_the_malicious_pickle_is_live_when_loaded_unsafely(tmp_path):
    # the attack the tests below defend against really runs code on an unsafe load
    marker = tmp_path / "marker"
    p = tmp_path / "evil.pt"
    torch.save(_capture_dict(kwargs={"x": Evil(str(marker))}), p)
    torch.load(p, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("where", ["whole_file", "kwargs", "args", "legacy_format"])
def test_a_pickled_object_in_the_file_does_not_run_and_is_refused(tmp_path, where):
    marker = tmp_path / "marker"
    p = tmp_path / "evil.pt"
    evil = Evil(str(marker))
    if where == "whole_file":
        torch.save(evil, p)
    elif where == "kwargs":
        torch.save(_capture_dict(kwargs={"attention_mask": torch.ones(2), "cache": evil}), p)
    elif where == "args":
        torch.save(_capture_dict(args=(torch.ones(2), [torch.zeros(1), {"deep": evil}])), p)
    else:
        torch.save(_capture_dict(kwargs={"x": evil}), p, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError) as ei:
        load_capture(str(p))
    msg = str(ei.value)
    assert str(p) in msg and "trusted=True" in msg
    assert not marker.exists()


def test_trusted_is_the_explicit_opt_in_for_a_file_you_trust(tmp_path):
    p = tmp_path / "odd.pt"
    torch.save(_capture_dict(kwargs={"when": collections.Counter(a=1), "ok": torch.ones(1)}), p)
    cap = load_capture(str(p))  # Counter is an allowed type: safe
    assert cap.kwargs["when"] == {"a": 1}
    p2 = tmp_path / "opt.pt"
    torch.save(_capture_dict(kwargs={"slice": slice(1, 3)}), p2)  # not an allowed global
    with pytest.raises(ValueError, match="trusted=True"):
        load_capture(str(p2))
    assert load_capture(str(p2), trusted=True).kwargs == {"slice": slice(1, 3)}


@pytest.mark.parametrize("damage", ["truncated", "random", "empty", "text"])
def test_a_damaged_file_is_one_value_error_naming_the_file(tmp_path, damage):
    good = tmp_path / "good.pt"
    torch.save(_capture_dict(), good)
    p = tmp_path / f"{damage}.pt"
    raw = good.read_bytes()
    noise = bytes(random.Random(damage).randrange(256) for _ in range(4096))  # fixed: no flaky opcodes
    p.write_bytes({"truncated": raw[: len(raw) // 2], "random": noise, "empty": b"",
                   "text": b"hello, not a capture\n"}[damage])
    with pytest.raises(ValueError) as ei:
        load_capture(str(p))
    assert type(ei.value) is ValueError and str(p) in str(ei.value)
    assert "trusted=True" not in str(ei.value)  # not a file that more trust would read


def test_a_file_that_is_not_a_capture_is_refused(tmp_path):
    p = tmp_path / "w.pt"
    torch.save({"weight": torch.ones(2)}, p)
    with pytest.raises(ValueError, match="not a tensorwatch_otel capture") as ei:
        load_capture(str(p))
    assert str(p) in str(ei.value)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, nested, *, mask=None, scale=1.0, tag="", extra=None, dims=None, dt=None, **rest):
        y = self.drop(self.lin(x)) * scale
        y = y + nested[0] + nested[1][0] + nested[1][1]["b"].sum()
        return y


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor


Pair = collections.namedtuple("Pair", "a b")


class Cache:
    """Like transformers' DynamicCache: an object the safe loader cannot hold."""

    def __init__(self):
        self.keys = [torch.ones(1, 2)]


def _detect(tmp_path, *args, **kwargs):
    torch.manual_seed(0)
    model = Model()
    with watch(model, sinks=[Collect()], capture_dir=str(tmp_path / "cap")):
        model(torch.randn(2, 4), [torch.zeros(4), (torch.zeros(4), {"b": torch.zeros(1)})])
        rng = torch.get_rng_state()
        with pytest.raises(NonFiniteDetected) as ei:
            model(*args, **kwargs)
    return ei.value.event, rng


def test_a_normal_capture_round_trips_through_the_safe_loader(tmp_path):
    x = torch.randn(2, 4)
    x[0, 0] = float("inf")
    nested = [torch.randn(4), (torch.randn(4, dtype=torch.float64), {"b": torch.arange(3)})]
    mask = torch.tensor([[True, False]])
    ev, rng = _detect(tmp_path, x, nested, mask=mask, scale=2.5, tag="step", extra=None, dims=torch.Size([2, 4]),
                      dt=torch.float16, count=7, flags=(True, 3, 1.5, None), half=torch.ones(2, dtype=torch.bfloat16))
    cap = load_capture(ev.capture)
    assert cap.batch_number == 1 and cap.rank == 0 and cap.not_captured == ()
    assert torch.equal(cap.args[0], x)
    assert isinstance(cap.args[1], list) and isinstance(cap.args[1][1], tuple)
    assert torch.equal(cap.args[1][0], nested[0]) and torch.equal(cap.args[1][1][0], nested[1][0])
    assert cap.args[1][1][0].dtype == torch.float64 and torch.equal(cap.args[1][1][1]["b"], nested[1][1]["b"])
    assert torch.equal(cap.kwargs["mask"], mask) and cap.kwargs["half"].dtype == torch.bfloat16
    assert {k: cap.kwargs[k] for k in ("scale", "tag", "extra", "dims", "dt", "count", "flags")} == dict(
        scale=2.5, tag="step", extra=None, dims=torch.Size([2, 4]), dt=torch.float16, count=7,
        flags=(True, 3, 1.5, None))
    torch.manual_seed(99)
    cap.restore_rng()
    assert torch.equal(torch.get_rng_state(), rng)


def test_inputs_a_capture_cannot_hold_are_named_once_and_the_file_stays_safe(tmp_path, caplog):
    x = torch.randn(2, 4)
    x[0, 0] = float("inf")
    nested = [torch.zeros(4), (torch.zeros(4), {"b": torch.zeros(1)})]
    caplog.set_level(logging.WARNING, logger="tensorwatch_otel.core.batch.capture")
    ev, _ = _detect(tmp_path, x, nested, extra=Cache(), dims=Batch(torch.ones(2)), dt=Pair(torch.ones(1), 2),
                    od=collections.OrderedDict(a=torch.ones(1)))
    cap = load_capture(ev.capture)  # safe: no trusted=True needed
    assert cap.kwargs["extra"] is None and cap.kwargs["dims"] is None
    dt = cap.kwargs["dt"]  # a namedtuple, held as a plain tuple
    assert type(dt) is tuple and torch.equal(dt[0], torch.ones(1)) and dt[1] == 2
    assert type(cap.kwargs["od"]) is dict and torch.equal(cap.kwargs["od"]["a"], torch.ones(1))
    assert cap.not_captured == ("kwargs['extra']: Cache", "kwargs['dims']: Batch")
    said = [r.getMessage() for r in caplog.records if "not captured" in r.getMessage()]
    assert len(said) == 1 and "kwargs['extra']: Cache" in said[0] and "kwargs['dims']: Batch" in said[0]
