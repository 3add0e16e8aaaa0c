"""Run under torchrun (2 ranks, CPU, gloo): accelerate prepares (DDP-wraps) a tiny model watched
before prepare; both ranks overflow at batch 2. Writes its observations per rank into the folder
argv[1] (tests/_observed.py)."""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _collect import Collect  # noqa: E402
from _observed import leave, write_observed  # noqa: E402
from _otel_fixtures import OverflowNet  # noqa: E402

from tensorwatch_otel import NonFiniteDetected, watch  # noqa: E402

torch.set_num_threads(1)

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = OverflowNet()
sink = Collect()
watcher = watch(model, sinks=[sink])  # before prepare: the user's module, the user's paths
opt = torch.optim.SGD(model.parameters(), lr=0.01)
prepared, opt = accelerator.prepare(model, opt)
out = {"rank": accelerator.process_index, "wrapper": type(prepared).__name__,
       "unwrapped_is_model": accelerator.unwrap_model(prepared) is model}
try:
    for step in range(5):
        if step == 2:
            model.boom.factor = 1e39
        x = torch.randn(4, 8)
        loss = prepared(x).pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    out["raised"] = None
except NonFiniteDetected as exc:
    ev = exc.event
    out.update(raised="NonFiniteDetected", module=ev.module, tensor=ev.tensor, batch=ev.batch_number,
               event_rank=ev.rank)
finally:
    watcher.detach()
out["paths"] = sorted({f.module for b in sink.batches for f in b.frames})
out["hooks_after"] = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in prepared.modules())
write_observed(sys.argv[1], out["rank"], out)
# Leave as a script should (a process group left to the interpreter's exit can abort a rank),
# then without the interpreter's finalization (tests/_observed.leave)
accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()
leave(0)
