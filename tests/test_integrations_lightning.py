"""Lightning: TensorwatchCallback on a real Trainer (CPU, a few steps, no logger, no checkpoints):
every forward watched, an injected overflow named by the LightningModule's module path and
leaving fit() as NonFiniteDetected after the sinks recorded it, no hook left afterwards."""

from __future__ import annotations

import json

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from _collect import Collect  # noqa: E402
from _lit import Regressor, loader, trainer  # noqa: E402
from _hooks import remaining_hooks  # noqa: E402
from tensorwatch_otel import NonFiniteDetected  # noqa: E402
from tensorwatch_otel.core.config import ConfigError  # noqa: E402
from tensorwatch_otel.core.events import NonFiniteEvent  # noqa: E402
from tensorwatch_otel.integrations.lightning import TensorwatchCallback  # noqa: E402
from tensorwatch_otel.sinks import JsonlLog  # noqa: E402


def test_clean_fit_watches_every_step_and_leaves_no_hook():
    torch.manual_seed(0)
    model = Regressor()
    sink = Collect()
    cb = TensorwatchCallback(sinks=[sink])
    during = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            during.append(sum(remaining_hooks(pl_module).values()))

    trainer([cb, Probe()]).fit(model, loader())
    assert [b.batch_number for b in sink.batches] == [0, 1, 2, 3, 4]
    assert {f.module for f in sink.batches[-1].frames} == {"", "inp", "boom", "out"}
    assert sink.events == [] and len(during) == 5 and all(n > 0 for n in during)
    assert remaining_hooks(model) == {} and cb.watcher is None


def test_injected_overflow_is_named_recorded_and_leaves_fit_as_nonfinite(tmp_path):
    torch.manual_seed(0)
    model = Regressor(overflow_at=3)
    sink = Collect()
    log = tmp_path / "events.jsonl"
    cb = TensorwatchCallback(sinks=[sink, JsonlLog(str(log))], max_frames=6)
    with pytest.raises(NonFiniteDetected) as info:
        trainer([cb]).fit(model, loader())
    event = info.value.event
    assert (event.module, event.module_class, event.tensor, event.kind) == ("boom", "Scale", "output", "inf")
    assert event.batch_number == 3
    assert [f.module for f in event.frames][-2:] == ["inp", "boom"]
    assert sink.of(NonFiniteEvent) == [event]
    [line] = [json.loads(x) for x in log.read_text().splitlines()]
    assert (line["event"], line["module"], line["batch_number"]) == ("nonfinite_detected", "boom", 3)
    assert remaining_hooks(model) == {} and cb.watcher is None


def test_sanity_check_and_validation_forwards_are_batches():
    torch.manual_seed(0)
    model = Regressor()
    sink = Collect()
    # 2 sanity-check forwards, 4 training steps, validation (2 forwards) after steps 2 and 4
    trainer([TensorwatchCallback(sinks=[sink])], max_steps=4, num_sanity_val_steps=2, val_check_interval=2,
            limit_val_batches=2).fit(model, loader(), loader(8, seed=1))
    assert len(sink.batches) == 2 + 4 + 2 * 2
    assert remaining_hooks(model) == {}


def test_other_exceptions_leave_no_hook():
    class Boom(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 2:
                raise RuntimeError("data pipeline broke")

    model = Regressor()
    cb = TensorwatchCallback(sinks=[Collect()])
    with pytest.raises(RuntimeError, match="data pipeline broke"):
        trainer([cb, Boom()]).fit(model, loader())
    assert remaining_hooks(model) == {} and cb.watcher is None


def test_training_step_that_calls_submodules_directly():
    """The LightningModule's own forward never runs: the callback holds each training step in
    `watcher.batch()`, so the three outermost calls (inp, boom, out) of step 3 are batch 3."""
    torch.manual_seed(0)
    model = Regressor(overflow_at=3, call_root=False)
    sink = Collect()
    with pytest.raises(NonFiniteDetected) as info:
        trainer([TensorwatchCallback(sinks=[sink])]).fit(model, loader())
    event = info.value.event
    assert (event.module, event.tensor, event.batch_number) == ("boom", "output", 3)
    assert [f.module for f in event.frames][-2:] == ["inp", "boom"]
    assert [b.batch_number for b in sink.batches] == [0, 1, 2, 3]
    assert [[f.module for f in b.frames] for b in sink.batches[:3]] == [["inp", "boom", "out"]] * 3
    assert [f.module for f in sink.batches[3].frames] == ["inp", "boom"]  # stopped at the detection
    assert remaining_hooks(model) == {}


def test_each_training_step_is_one_batch_with_its_backward_and_step():
    torch.manual_seed(0)
    model = Regressor(call_root=False)
    sink = Collect()
    steps = []

    class Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            steps.append(cb.watcher.batch_number)  # the step's batch is still open

    cb = TensorwatchCallback(sinks=[sink], gradients=True)
    # 2 micro-batches per optimizer step: every micro-batch (training_step call) is a batch
    trainer([cb, Probe()], max_steps=3, accumulate_grad_batches=2).fit(model, loader())
    forward = [b for b in sink.batches if b.phase == "forward"]
    assert [b.batch_number for b in forward] == list(range(6))
    assert all([f.module for f in b.frames] == ["inp", "boom", "out"] for b in forward)
    backward = sorted(b.batch_number for b in sink.batches if b.phase == "backward")
    assert backward == list(range(6))
    assert steps == [1, 3, 5]
    assert remaining_hooks(model) == {}


def test_an_exception_in_training_step_leaves_fit_unchanged_with_the_step_recorded():
    class Breaks(Regressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.global_step == 2:
                raise RuntimeError("broke after the forward")
            return loss

    model = Breaks(call_root=False)
    sink = Collect()
    cb = TensorwatchCallback(sinks=[sink])
    with pytest.raises(RuntimeError, match="broke after the forward"):
        trainer([cb]).fit(model, loader())
    assert [b.batch_number for b in sink.batches] == [0, 1, 2]
    assert [f.module for f in sink.batches[2].frames] == ["inp", "boom", "out"]
    assert remaining_hooks(model) == {} and cb.watcher is None and cb._step is None


def test_options_are_checked_when_the_callback_is_built():
    with pytest.raises(ConfigError, match="every_n_batches"):
        TensorwatchCallback(every_n_batches=0)
    with pytest.raises(TypeError, match="bogus"):
        TensorwatchCallback(bogus=1)
    assert isinstance(TensorwatchCallback(), pl.Callback)


def test_standalone_pytorch_lightning_package():
    """`pytorch_lightning` has Callback and LightningModule classes of its own."""
    ptl = pytest.importorskip("pytorch_lightning")
    from tensorwatch_otel.integrations.pytorch_lightning import TensorwatchCallback as PtlCallback

    class PtlRegressor(ptl.LightningModule):
        def __init__(self):
            super().__init__()
            self.inner = Regressor(overflow_at=2)

        def forward(self, x):
            return self.inner(x)

        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                self.inner.boom.factor = 1e39
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    model = PtlRegressor()
    cb = PtlCallback(sinks=[Collect()])
    assert isinstance(cb, ptl.Callback) and not isinstance(cb, pl.Callback)
    t = ptl.Trainer(max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, accelerator="cpu", devices=1, callbacks=[cb])
    with pytest.raises(NonFiniteDetected) as info:
        t.fit(model, loader())
    assert (info.value.event.module, info.value.event.batch_number) == ("inner.boom", 2)
    assert remaining_hooks(model) == {} and cb.watcher is None
