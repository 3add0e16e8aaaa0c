"""Accelerate: a model watched before `accelerator.prepare`, or through `unwrap_model` after it, is
watched with the user's module paths whatever prepare wrapped it in (autocast-patched forward in
one process, DistributedDataParallel on two real ranks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from _collect import Collect  # noqa: E402
from _diag_launch import clean_env  # noqa: E402
from _hooks import remaining_hooks  # noqa: E402
from _observed import read_observed  # noqa: E402
from _otel_fixtures import OverflowNet  # noqa: E402
from conftest import free_port  # noqa: E402
from tensorwatch_otel import NonFiniteDetected, watch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def accelerator_bf16():
    # accelerate keeps one process-wide state: the Trainers of other tests made theirs (fp32)
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("when", ["before", "after"])
def test_prepared_model_with_autocast_is_watched_with_user_paths(accelerator_bf16, when):
    torch.manual_seed(0)
    model = OverflowNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = Collect()
    if when == "before":
        w = watch(model, sinks=[sink])
        prepared, opt = accelerator_bf16.prepare(model, opt)
    else:
        prepared, opt = accelerator_bf16.prepare(model, opt)
        w = watch(accelerator_bf16.unwrap_model(prepared), sinks=[sink])
    with w:
        for step in range(4):
            if step == 2:
                model.boom.factor = 1e39
            x = torch.randn(2, 8)
            try:
                loss = prepared(x).float().pow(2).mean()
            except NonFiniteDetected as exc:
                event = exc.event
                break
            accelerator_bf16.backward(loss)
            opt.step()
            opt.zero_grad()
    assert (event.module, event.tensor, event.batch_number) == ("boom", "output", 2)
    frames = {f.module: f for f in sink.batches[0].frames}
    assert set(frames) == {"", "inp", "boom", "out"}
    # the hooks saw prepare's autocast at work: Linear outputs in bfloat16
    assert {t.name: t.dtype for t in frames["inp"].tensors}["output"] == "bfloat16"
    assert remaining_hooks(model) == {}


@pytest.mark.slow
def test_ddp_prepared_model_on_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / "tests" / "_accelerate_ddp.py"), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=clean_env({"PYTHONPATH": str(ROOT)}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = read_observed(tmp_path, 2, proc)
    assert [o["rank"] for o in seen] == [0, 1]
    for o in seen:
        assert o["wrapper"] == "DistributedDataParallel" and o["unwrapped_is_model"]
        assert (o["raised"], o["module"], o["tensor"], o["batch"]) == ("NonFiniteDetected", "boom", "output", 2)
        assert o["event_rank"] == o["rank"]
        assert o["paths"] == ["", "boom", "inp", "out"]  # no "module." prefix from the DDP wrapper
        assert o["hooks_after"] == 0
