"""rerun_on_detect replays a batch on the caller's inputs: the replay must leave every input as
it found it (a transformers cache, a tensor or list the forward changes in place), and must not
replay a batch whose inputs it cannot give back as they were."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from _collect import Collect
from _hf import tiny_gpt2
from tensorwatch_otel import NonFiniteEvent, watch

BAD_TOKEN = 63  # its lm_head row (tied to the embedding) is set to inf; the inputs never use it


def _gpt2_steps(watched: bool):
    from transformers import DynamicCache

    model = tiny_gpt2().eval()
    with torch.no_grad():
        model.lm_head.weight[BAD_TOKEN].fill_(math.inf)
    ids = torch.arange(1, 8).unsqueeze(0)  # 7 tokens, none is BAD_TOKEN
    cache = DynamicCache(config=model.config)
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report", rerun_on_detect=True) if watched else None
    try:
        with torch.no_grad():
            first = model(ids[:, :6], past_key_values=cache, use_cache=True).logits
            length_after_first = cache.get_seq_length()
            second = model(ids[:, 6:], past_key_values=cache, use_cache=True).logits
    finally:
        if w is not None:
            w.detach()
    return first, second, length_after_first, cache.get_seq_length(), sink


def test_a_replay_leaves_a_transformers_cache_as_the_forward_left_it(caplog):
    caplog.set_level(logging.INFO, logger="tensorwatch_otel")
    f0, s0, l0, end0, _ = _gpt2_steps(watched=False)
    f1, s1, l1, end1, sink = _gpt2_steps(watched=True)
    events = sink.of(NonFiniteEvent)
    assert events and events[0].module == "transformer.wte" and events[0].kind == "inf"  # tied to lm_head
    assert (l1, end1) == (l0, end0) == (6, 7)
    torch.testing.assert_close(f1, f0, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(s1, s0, rtol=0, atol=0, equal_nan=True)
    finite = torch.isfinite(s0)
    assert finite.sum() == s0.numel() - 1  # only the poisoned token's logit is not finite
    # the cache is an object a replay cannot give back as it was: no replay, said once
    assert events[0].reproduced is None
    said = [r.getMessage() for r in caplog.records if "rerun_on_detect" in r.getMessage()]
    assert len(said) == 1 and "DynamicCache" in said[0] and "past_key_values" in said[0]


class InPlace(nn.Module):
    """Changes its inputs in place: scales `x`, appends to `seen`."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, seen, *, also=None):
        seen.append(x.shape[0])
        if also is not None:
            also.mul_(2)
        return self.lin(x)


def test_a_replay_leaves_in_place_changed_inputs_as_the_forward_left_them(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="tensorwatch_otel")
    torch.manual_seed(0)
    model = InPlace()
    x = torch.randn(3, 4)
    x[0, 0] = math.inf
    also = torch.ones(2)
    seen: list = []
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report", rerun_on_detect=True, capture_dir=str(tmp_path)):
        out = model(x, seen, also=also)
    ev = sink.of(NonFiniteEvent)[0]
    assert seen == [3] and torch.equal(also, torch.full((2,), 2.0))
    assert not torch.isfinite(out).all()
    # `also` changed in place: the replay would not see the batch as it was
    assert ev.reproduced is None
    said = [r.getMessage() for r in caplog.records if "rerun_on_detect" in r.getMessage()]
    assert len(said) == 1 and "kwargs['also']" in said[0]
    # the capture says it holds `also` as the forward left it
    noted = [r.getMessage() for r in caplog.records if "changed inputs in place" in r.getMessage()]
    assert len(noted) == 1 and "kwargs['also']" in noted[0] and ev.capture in noted[0]


def test_a_list_the_forward_appends_to_is_replayed_as_it_was_and_left_alone():
    torch.manual_seed(0)
    model = InPlace()
    x = torch.randn(3, 4)
    x[0, 0] = math.inf
    seen: list = ["before"]
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report", rerun_on_detect=True):
        model(x, seen)
        model(x, seen)
    evs = sink.of(NonFiniteEvent)
    assert seen == ["before", 3, 3]  # one append per call of the caller, none from the replays
    assert [e.reproduced for e in evs] == [True, True]
    assert torch.isinf(x[0, 0]) and x[1:].isfinite().all()
