"""transformers: TensorwatchCallback on a real Trainer training a tiny GPT-2 built from a config
(no downloads) on CPU: every forward watched, an injected inf named by the user's module path and
leaving train() as NonFiniteDetected after the sinks recorded it, no hook left afterwards."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import TrainerCallback  # noqa: E402

from _collect import Collect  # noqa: E402
from _hf import BAD, Probe, Tokens, tiny_gpt2, trainer_for  # noqa: E402
from _hooks import remaining_hooks  # noqa: E402
from tensorwatch_otel import NonFiniteDetected  # noqa: E402
from tensorwatch_otel.core.config import ConfigError  # noqa: E402
from tensorwatch_otel.core.events import NonFiniteEvent  # noqa: E402
from tensorwatch_otel.integrations.transformers import TensorwatchCallback  # noqa: E402
from tensorwatch_otel.sinks import JsonlLog, TextReport  # noqa: E402

def test_clean_run_watches_every_forward_and_leaves_no_hook(tmp_path):
    model = tiny_gpt2()
    assert remaining_hooks(model) == {}
    sink = Collect()
    cb = TensorwatchCallback(sinks=[sink])
    probe = Probe()
    out = trainer_for(model, tmp_path, [cb, probe], gradient_accumulation_steps=2).train()
    assert out.global_step == 6
    # every micro-batch forward is a batch: 6 optimizer steps x 2 accumulated forwards
    assert [b.batch_number for b in sink.batches] == list(range(12))
    assert sink.events == []
    modules = {f.module for f in sink.batches[-1].frames}
    assert {"", "transformer", BAD, "lm_head", "transformer.h.0.attn"} <= modules  # user's paths
    assert all(n > 0 for n in probe.hooks_during) and len(probe.hooks_during) == 6
    assert remaining_hooks(model) == {}
    assert cb.watcher is None


def test_injected_inf_is_named_recorded_and_leaves_train_as_nonfinite(tmp_path):
    model = tiny_gpt2()
    sink = Collect()
    log = tmp_path / "events.jsonl"
    cb = TensorwatchCallback(sinks=[sink, JsonlLog(str(log))], max_frames=5)
    trainer = trainer_for(model, tmp_path, [cb, Probe(poison_at=3)])
    with pytest.raises(NonFiniteDetected) as info:
        trainer.train()
    event = info.value.event
    assert (event.module, event.module_class, event.tensor) == (BAD, "Conv1D", "weight")
    assert "inf" in event.kind.split(",")  # the inf weight (its output may hold nan too)
    assert event.batch_number == 3  # steps 0, 1, 2 were clean
    assert len(event.frames) == 5 and event.frames[-1].module == BAD
    assert sink.of(NonFiniteEvent) == [event]
    # recorded durably before train() raised
    [line] = [json.loads(x) for x in log.read_text().splitlines()]
    assert (line["event"], line["module"], line["batch_number"]) == ("nonfinite_detected", BAD, 3)
    assert remaining_hooks(model) == {}
    assert cb.watcher is None


def test_eval_forwards_inside_train_are_watched_batches(tmp_path):
    model = tiny_gpt2()
    sink = Collect()
    cb = TensorwatchCallback(sinks=[sink])
    # evaluation after steps 2, 4, 6, two eval forwards each (8 examples, batches of 4)
    trainer_for(model, tmp_path, [cb], eval_dataset=Tokens(8, seed=1), eval_strategy="steps",
                eval_steps=2).train()
    assert len(sink.batches) == 6 + 3 * 2
    assert remaining_hooks(model) == {}

    model = tiny_gpt2()
    sink = Collect()
    cb = TensorwatchCallback(sinks=[sink])
    trainer = trainer_for(model, tmp_path, [cb, Probe(poison_after=2)], eval_dataset=Tokens(8, seed=1),
                          eval_strategy="steps", eval_steps=2)
    with pytest.raises(NonFiniteDetected) as info:
        trainer.train()
    # the first forward after step 2 is the evaluation's: batch 2 (two training forwards before it)
    assert info.value.event.batch_number == 2 and info.value.event.module == BAD
    assert remaining_hooks(model) == {}


def test_on_detect_report_goes_on_and_detaches_at_train_end(tmp_path):
    model = tiny_gpt2()
    sink = Collect()
    cb = TensorwatchCallback(sinks=[sink], on_detect="report")
    trainer_for(model, tmp_path, [cb, Probe(poison_at=4)], max_steps=6).train()
    events = sink.of(NonFiniteEvent)
    assert events and events[0].batch_number == 4 and events[0].module == BAD
    assert remaining_hooks(model) == {}


def test_added_later_and_trained_twice(tmp_path):
    model = tiny_gpt2()
    sink = Collect()
    cb = TensorwatchCallback(sinks=[sink])
    trainer = trainer_for(model, tmp_path, max_steps=2)
    trainer.add_callback(cb)
    trainer.train()
    assert remaining_hooks(model) == {} and len(sink.batches) == 2
    # the second train() is guarded even for a callback added after construction: a raise
    # leaves no hook behind
    Probe(poison_at=0)._poison(model)
    with pytest.raises(NonFiniteDetected):
        trainer.train()
    assert remaining_hooks(model) == {}


def test_other_exceptions_leave_no_hook(tmp_path):
    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                raise RuntimeError("data pipeline broke")

    model = tiny_gpt2()
    cb = TensorwatchCallback(sinks=[Collect()])
    with pytest.raises(RuntimeError, match="data pipeline broke"):
        trainer_for(model, tmp_path, [cb, Boom()]).train()
    assert remaining_hooks(model) == {} and cb.watcher is None


def _theirs(model) -> int:
    """Forward hooks of transformers' own DebugUnderflowOverflow on `model`."""
    from transformers.debug_utils import DebugUnderflowOverflow

    return sum(isinstance(getattr(h, "__self__", None), DebugUnderflowOverflow)
               for m in model.modules() for h in m._forward_hooks.values())


def test_trainers_debug_flag_is_served_by_the_callback_alone(tmp_path, capsys):
    from transformers.debug_utils import DebugOption

    class Look(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            seen.append(_theirs(model))

    seen: list = []
    model = tiny_gpt2()
    sink = Collect()
    cb = TensorwatchCallback(sinks=[TextReport(), sink])
    # the flag public scripts pass: transformers places its own checker's hooks in train()
    trainer = trainer_for(model, tmp_path, [cb, Probe(poison_at=3), Look()], debug="underflow_overflow")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(NonFiniteDetected) as info:
            trainer.train()
    event = info.value.event
    assert (event.module, event.tensor, event.batch_number) == (BAD, "weight", 3)
    assert sink.of(NonFiniteEvent) == [event]
    printed = capsys.readouterr()
    assert (printed.out + printed.err).count("Detected inf/nan during batch_number=") == 1  # ours only
    assert not [w for w in caught if "always_call" in str(w.message)]  # ours was not swallowed
    assert seen == [0, 0, 0, 0]  # transformers' hooks were off from the first step
    assert remaining_hooks(model) == {}
    assert trainer.args.debug == [DebugOption.UNDERFLOW_OVERFLOW]  # the user's arguments as given


def test_options_are_checked_when_the_callback_is_built():
    with pytest.raises(ConfigError, match="on_detect"):
        TensorwatchCallback(on_detect="sometimes")
    with pytest.raises(TypeError, match="bogus"):
        TensorwatchCallback(bogus=1)
    assert isinstance(TensorwatchCallback(), TrainerCallback)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 GradScaler training needs a GPU")
def test_fp16_trainer_scaler_is_given_to_the_watcher(tmp_path):
    seen = []

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            seen.append(cb.watcher.grad_scaler)

    model = tiny_gpt2()
    cb = TensorwatchCallback(sinks=[Collect()])
    trainer = trainer_for(model, tmp_path, [cb, Look()], use_cpu=False, fp16=True, max_steps=2)
    trainer.train()
    assert seen and seen[0] is not None and seen[0] is trainer.accelerator.scaler
    assert remaining_hooks(model) == {}


@pytest.mark.slow
def test_every_rank_of_a_ddp_trainer_watches_and_raises(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from _diag_launch import clean_env
    from _observed import read_observed
    from conftest import free_port

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(root / "tests" / "_trainer_ddp.py"), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=clean_env({"PYTHONPATH": str(root)}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = read_observed(tmp_path, 2, proc)
    assert [(o["rank"], o["world"]) for o in seen] == [(0, 2), (1, 2)]
    for o in seen:
        assert o["wrapped"] == "DistributedDataParallel"  # the Trainer wrapped it; the callback got the model
        assert (o["raised"], o["module"], o["batch"], o["event_rank"]) == ("NonFiniteDetected", BAD, 3, o["rank"])
        assert o["paths_ok"] and o["batches"] == 4 and o["hooks_after"] == 0
