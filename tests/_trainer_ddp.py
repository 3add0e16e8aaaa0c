"""Run under torchrun (2 ranks, CPU, gloo): a transformers Trainer with TensorwatchCallback trains
a tiny GPT-2 wrapped by the Trainer in DistributedDataParallel; both ranks poison the same weight
at step 3. argv[1]: an output folder; each rank writes its observations there (tests/_observed.py)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _collect import Collect  # noqa: E402
from _hf import Probe, tiny_gpt2, trainer_for  # noqa: E402
from _hooks import remaining_hooks  # noqa: E402
from _observed import leave, write_observed  # noqa: E402

from pathlib import Path  # noqa: E402

from tensorwatch_otel import NonFiniteDetected  # noqa: E402
from tensorwatch_otel.integrations.transformers import TensorwatchCallback  # noqa: E402

torch.set_num_threads(1)
model = tiny_gpt2()
sink = Collect()
cb = TensorwatchCallback(sinks=[sink])
trainer = trainer_for(model, Path(sys.argv[1]), [cb, Probe(poison_at=3)], ddp_backend="gloo")
out = {"rank": trainer.args.process_index, "world": trainer.args.world_size}
try:
    trainer.train()
    out["raised"] = None
except NonFiniteDetected as exc:
    ev = exc.event
    out.update(raised="NonFiniteDetected", module=ev.module, batch=ev.batch_number, event_rank=ev.rank)
out["wrapped"] = type(trainer.model_wrapped).__name__
out["paths_ok"] = all(not f.module.startswith("module.") for b in sink.batches for f in b.frames)
out["batches"] = len(sink.batches)
out["hooks_after"] = sum(remaining_hooks(model).values())
write_observed(sys.argv[1], out["rank"], out)
# Leave as a script should (a process group left to the interpreter's exit can abort a rank),
# then without the interpreter's finalization (tests/_observed.leave)
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
leave(0)
