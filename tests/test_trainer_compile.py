"""transformers Trainer with `torch_compile=True` and TensorwatchCallback: the callback watches
inside the compiled graph (every module eager watching records, by the user's paths), and an inf
put into a weight mid-training is named at its module."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from _collect import Collect  # noqa: E402
from _hf import BAD, Probe, tiny_gpt2, trainer_for  # noqa: E402
from _hooks import remaining_hooks  # noqa: E402
from tensorwatch_otel import NonFiniteDetected  # noqa: E402
from tensorwatch_otel.core.events import NonFiniteEvent  # noqa: E402
from tensorwatch_otel.integrations.transformers import TensorwatchCallback  # noqa: E402


def _pairs(batch):
    return [(f.module, t.name) for f in batch.frames for t in f.tensors]


def _eager_pairs(tmp_path):
    """What the callback records of one eager Trainer step on the same model."""
    sink = Collect()
    trainer_for(tiny_gpt2(), tmp_path / "eager", [TensorwatchCallback(sinks=[sink])], max_steps=1).train()
    return _pairs(sink.batches[0])


@pytest.mark.slow
def test_compiled_trainer_is_watched_inside_the_graph_and_an_inf_named(tmp_path):
    from torch._dynamo.utils import counters

    eager = _eager_pairs(tmp_path)
    model = tiny_gpt2()
    sink = Collect()
    cb = TensorwatchCallback(sinks=[sink])
    # aot_eager: dynamo and AOTAutograd as with inductor (hooks traced the same way), no C++ build
    trainer = trainer_for(model, tmp_path, [cb, Probe(poison_at=3)], torch_compile=True,
                          torch_compile_backend="aot_eager")
    with pytest.raises(NonFiniteDetected) as info:
        trainer.train()
    assert counters["stats"]["unique_graphs"] > 0  # it really ran compiled
    assert [b.batch_number for b in sink.batches[:3]] == [0, 1, 2]
    frames = sink.batches[2].frames
    assert _pairs(sink.batches[2]) == eager  # every module and tensor eager records, inside the graph
    assert {"transformer.h.0.attn", BAD, "lm_head", ""} <= {f.module for f in frames}
    event = info.value.event
    assert (event.module, event.module_class, event.tensor, event.batch_number) == (BAD, "Conv1D", "weight", 3)
    assert sink.of(NonFiniteEvent) == [event]
    assert remaining_hooks(model) == {} and cb.watcher is None
