"""Models entered other than through their root forward (encode()/decode(), submodules called
directly) and compiled models: batches end, memory stays bounded, the inf is found and named, and
under torch.compile the modules inside the graph are recorded as in eager mode, said once."""

from __future__ import annotations

import contextlib
import io
import logging

import torch
from torch import nn

import pytest
from _collect import Collect
from tensorwatch_otel import DebugUnderflowOverflow, NonFiniteDetected, NonFiniteEvent, watch
from tensorwatch_otel.core.batch.thread_batch import Phase


class EncDec(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.decoder = nn.Linear(8, 4)

    def encode(self, x):
        return self.encoder(x)

    def decode(self, h):
        return self.decoder(h)

    def forward(self, x):
        return self.decode(self.encode(x))


def test_calls_without_the_root_forward_end_batches_and_stay_bounded():
    model = EncDec()
    w = watch(model, sinks=[Collect()], max_frames=21)
    x = torch.randn(2, 4)
    for _ in range(3000):
        model.decode(model.encode(x))
    assert w.batch_number == 6000  # each outermost call (encode, then decode) is a batch
    assert w._session.life.phase is Phase.IDLE  # nothing left pending (no batch open in this thread)
    assert sum(r.frame_count for r in w._session.history().records) <= 21 + 3  # the ring's history only
    with torch.no_grad():
        model.decoder.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteDetected) as ei:
        model.decode(model.encode(x))
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.batch_number) == ("decoder", "weight", 6001)
    assert [f.module for f in ev.frames][-3:] == ["encoder.1", "encoder", "decoder"]
    w.detach()


def _peer_and_ours(run):
    """stdout and exception text of the peer and of our drop-in on the same scenario."""
    from transformers.debug_utils import DebugUnderflowOverflow as Peer

    out = []
    for cls in (Peer, DebugUnderflowOverflow):
        torch.manual_seed(0)
        model = EncDec()
        dbg = cls(model, max_frames_to_save=5)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                run(model)
                err = None
            except ValueError as exc:
                err = str(exc)
        out.append((buf.getvalue(), err))
        if hasattr(dbg, "detach"):
            dbg.detach()
    return out


def test_dropin_detects_where_the_peer_does_without_root_forward():
    def run(model):
        x = torch.randn(2, 4)
        for i in range(50):
            if i == 37:
                with torch.no_grad():
                    model.decoder.bias[1] = float("nan")
            model.decode(model.encode(x))

    (peer_out, peer_err), (ours_out, ours_err) = _peer_and_ours(run)
    assert peer_err is not None and ours_err == peer_err
    assert "Detected inf/nan during batch_number=0" in peer_out
    assert ours_out == peer_out


def _compile(module):
    # the eager backend keeps the test fast; dynamo traces the hooks the same way for any backend
    return torch.compile(module, backend="eager")


EAGER_FRAMES = ["encoder.0", "encoder.1", "encoder", "decoder", ""]


def test_watch_compiled_model_records_every_module_inside_the_graph_and_says_so(caplog):
    torch.manual_seed(0)
    model = EncDec()
    compiled = _compile(model)
    sink = Collect()
    with caplog.at_level(logging.INFO, logger="tensorwatch_otel"):
        w = watch(compiled, sinks=[sink], on_detect="report")
        x = torch.randn(2, 4)
        compiled(x)
        compiled(x)
    said = [r for r in caplog.records if "torch.compile" in r.getMessage() and "traced" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    frames = sink.batches[-1].frames
    assert [f.module for f in frames] == EAGER_FRAMES  # no _orig_mod. anywhere
    assert frames[-1].module_class == "EncDec"
    root = {t.name: t for t in frames[-1].tensors}
    assert root["output"].abs_max == pytest.approx(compiled(x).abs().max().item())
    inner = {t.name: t for t in frames[0].tensors}
    assert inner["output"].abs_max == pytest.approx(model.encoder[0](x).abs().max().item())
    with torch.no_grad():
        model.encoder[0].weight[0, 0] = float("inf")
    compiled(x)
    w.detach()
    (ev,) = sink.of(NonFiniteEvent)
    assert (ev.module, ev.module_class, ev.tensor) == ("encoder.0", "Linear", "weight")


@pytest.mark.slow
def test_inductor_compiled_training_is_watched_and_an_inf_weight_named():
    """The default backend, as users compile: inductor generates and builds its own kernels
    (a C++ compiler on CPU). Training steps through the compiled model are batches with live
    values, and an inf weight is named on the user's path."""
    torch.manual_seed(0)
    model = EncDec()
    compiled = torch.compile(model)  # inductor
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = Collect()
    x = torch.randn(16, 4)
    with watch(compiled, sinks=[sink], on_detect="report") as w:
        for _ in range(3):
            y = compiled(x)
            # what batch 3 must show: the weights after two steps, and its own output
            want_w = model.decoder.weight.detach().abs().max().item()
            want_out = y.detach().abs().max().item()
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert w.batch_number == 3 and len(sink.batches) == 3
        frames = sink.batches[-1].frames
        assert [f.module for f in frames] == EAGER_FRAMES
        weights = {f.module: {t.name: t for t in f.tensors} for f in frames}
        assert weights["decoder"]["weight"].abs_max == want_w  # live, not stale
        assert {t.name: t for t in frames[-1].tensors}["output"].abs_max == want_out
        with torch.no_grad():
            model.encoder[0].weight[1, 2] = float("-inf")
        compiled(x)
    (ev,) = sink.of(NonFiniteEvent)
    assert (ev.module, ev.module_class, ev.tensor, ev.kind) == ("encoder.0", "Linear", "weight", "inf")


def test_compiled_after_watch_records_inside_the_graph_without_a_warning(caplog):
    model = EncDec()
    sink = Collect()
    with caplog.at_level(logging.WARNING, logger="tensorwatch_otel"):
        w = watch(model, sinks=[sink])
        compiled = _compile(model)
        for _ in range(3):
            compiled(torch.randn(2, 4))
        w.detach()
    assert [r for r in caplog.records if "compile" in r.getMessage()] == []
    assert [b.batch_number for b in sink.batches] == [0, 1, 2]
    assert [f.module for f in sink.batches[-1].frames] == EAGER_FRAMES


def test_model_compiled_in_place_is_said_at_watch_and_recorded(caplog):
    model = EncDec()
    model.compile(backend="eager")
    sink = Collect()
    with caplog.at_level(logging.INFO, logger="tensorwatch_otel"):
        w = watch(model, sinks=[sink])
        said = [r for r in caplog.records if "torch.compile" in r.getMessage()]
        model(torch.randn(2, 4))
        w.detach()
    assert len(said) == 1 and "traced into its graph" in said[0].getMessage()
    assert len([r for r in caplog.records if "torch.compile" in r.getMessage()]) == 1
    assert [f.module for f in sink.batches[-1].frames] == EAGER_FRAMES
