"""A replay leaves no trace (issue: trust, item 8): the inputs held for a replay are let go at
detach() and after NonFiniteDetected, while the watcher is still referenced."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from _collect import Collect
from tensorwatch_otel import NonFiniteDetected, watch

REPLAYS = {"localize": dict(every_n_batches=10), "rerun": dict(rerun_on_detect=True),
           "both": dict(every_n_batches=10, rerun_on_detect=True)}


class ExpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.exp(self.a(x)))


@pytest.mark.parametrize("replay", list(REPLAYS))
def test_the_held_inputs_are_let_go_at_detach(replay):
    """A batch (on a GPU, in a notebook) is not kept alive by a watcher still referenced."""
    torch.manual_seed(0)
    model = ExpNet()
    w = watch(model, sinks=[Collect()], **REPLAYS[replay])
    x = torch.randn(4, 8)
    held = weakref.ref(x)
    model(x)
    del x
    gc.collect()
    assert held() is not None  # the batch's inputs are held until the next batch begins (documented)
    w.detach()
    gc.collect()
    assert held() is None


@pytest.mark.parametrize("replay", list(REPLAYS))
def test_the_held_inputs_are_let_go_after_nonfinite_detected(replay):
    torch.manual_seed(0)
    model = ExpNet()
    w = watch(model, sinks=[Collect()], **REPLAYS[replay])
    x = torch.randn(4, 8) * 300
    held = weakref.ref(x)
    try:
        model(x)
    except NonFiniteDetected as exc:
        assert exc.event.batch_number == 0
    else:
        raise AssertionError("no detection")
    del x
    gc.collect()
    assert held() is None
    assert w.detections == 1  # (still attached, still referenced)
    w.detach()
