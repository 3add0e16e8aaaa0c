"""A tiny training job for the multi-rank tests, run under `python -m torch.distributed.run`
(gloo on 127.0.0.1): DDP or FSDP2, one rank's input (or weight shard) made non-finite at a
chosen batch. Each rank writes what happened into OUT (tests/_observed.py).

usage: _dist_train.py OUT --mode ddp|fsdp2|eval --bad RANK[,RANK] --at BATCH [--batches N]
       [--linger S] [--inject input|shard|grad|gradshard] [--accum K] [--straggle RANK:BATCH:SECONDS]
       [--on-detect raise|report|skip] [--compile-step] [--reference] [--shard layers|root]

--inject gradshard: after the backward, that rank's own shard of layers.0's weight gradient is
made inf (FSDP2: the other ranks' shards stay finite).

--accum K: gradient accumulation, DDP `no_sync()` for K-1 micro-batches, then a micro-batch
that all-reduces and the optimizer step. --straggle: that rank sleeps before that batch's forward.

--shard root (fsdp2): fully_shard on the model alone, so its Linears are inside a sharded
module without being sharded themselves (the default, layers, shards each Linear too).

--compile-step: the optimizer step is compiled as PyTorch's recipe has it (a function calling
`opt.step()` under torch.compile). --reference: the run that never saw the bad batch: nothing
injected, no watcher, and no optimizer step at --at (its weights written, to compare with a skip).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _observed import leave, write_observed  # noqa: E402

from tensorwatch_otel import NonFiniteDetected, watch  # noqa: E402
from tensorwatch_otel.sinks import JsonlLog, TextReport  # noqa: E402

torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mode", default="ddp", choices=("ddp", "fsdp2", "eval"))
    ap.add_argument("--bad", default="", help="ranks whose values become non-finite")
    ap.add_argument("--at", type=int, default=4)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--linger", type=float, default=0.0, help="seconds the stopped process stays alive")
    ap.add_argument("--inject", default="input", choices=("input", "shard", "grad", "gradshard"))
    ap.add_argument("--gradients", action="store_true", help="watch(gradients=True)")
    ap.add_argument("--on-detect", default="raise", choices=("raise", "report", "skip"))
    ap.add_argument("--trace", type=int, action="append", default=[], help="batches to trace")
    ap.add_argument("--watch-first", action="store_true", help="watch() before fully_shard()")
    ap.add_argument("--shard", default="layers", choices=("layers", "root"),
                    help="fsdp2: fully_shard each layer and the model, or the model alone (its Linears not)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (DDP no_sync)")
    ap.add_argument("--straggle", default="", help="RANK:BATCH:SECONDS: that rank sleeps before that batch")
    ap.add_argument("--compile-step", action="store_true", help="torch.compile the optimizer step")
    ap.add_argument("--reference", action="store_true", help="unwatched, nothing injected, no step at --at")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    bad = {int(r) for r in args.bad.split(",") if r} if not args.reference else set()
    straggle = [float(v) for v in args.straggle.split(":")] if args.straggle else [-1, -1, 0]
    torch.manual_seed(0)
    net = Net()
    sinks = [JsonlLog(os.path.join(args.out, "events-{rank}.jsonl")), TextReport(stream=sys.stderr)]
    watcher = watch(net, sinks=sinks, trace_batches=args.trace, gradients=args.gradients,
                    on_detect=args.on_detect) if args.watch_first else None
    if args.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if args.shard == "layers":
            for layer in net.layers:
                fully_shard(layer)
        fully_shard(net)
        model = net
    elif args.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(net)
    else:
        model = net
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    result = {"rank": rank, "world_size": dist.get_world_size(), "batches_done": 0, "local_abs_max": {},
              "polls_by_batch": []}
    gen = torch.Generator().manual_seed(100 + rank)
    if not args.reference:
        watcher = watcher or watch(net, sinks=sinks, trace_batches=args.trace, gradients=args.gradients,
                                    on_detect=args.on_detect)

    def opt_step():
        opt.step()

    compiled_step = torch.compile(opt_step) if args.compile_step else opt_step

    def step():
        if not (args.reference and b == args.at):  # the reference run never takes that batch's step
            compiled_step()
    try:
        with watcher or contextlib.nullcontext():
            for b in range(args.batches):
                x = torch.randn(4, 8, generator=gen)
                if rank in bad and b == args.at:
                    if args.inject == "shard":
                        with torch.no_grad():
                            net.layers[0].weight.to_local()[0, 0] = float("inf")
                    elif args.inject == "input":
                        x[0, 0] = float("inf")
                if rank == straggle[0] and b == straggle[1]:
                    time.sleep(straggle[2])
                if b in args.trace:  # what this rank holds of each weight, to compare with the trace
                    result["local_abs_max"][str(b)] = {
                        n: float((p.to_local() if hasattr(p, "to_local") else p).detach().abs().max())
                        for n, p in net.named_parameters()}
                if args.mode == "eval":
                    with torch.no_grad():
                        y = model(x)
                        total = y.sum().reshape(1)
                        dist.all_reduce(total)  # a collective per batch, as a metric would
                elif args.accum > 1:
                    syncs = (b + 1) % args.accum == 0
                    with (contextlib.nullcontext() if syncs else model.no_sync()):
                        loss = model(x).pow(2).mean()
                        loss.backward()  # no_sync: gradients accumulate locally, no all-reduce
                    if syncs:
                        step()
                        opt.zero_grad()
                else:
                    loss = model(x).pow(2).mean()
                    if rank in bad and b == args.at and args.inject == "grad":
                        loss = loss * float("inf")  # the model's forward stays finite, its gradients do not
                    opt.zero_grad()
                    loss.backward()
                    if rank in bad and b == args.at and args.inject == "gradshard":
                        with torch.no_grad():  # this rank's shard of the gradient alone (after FSDP's reduce-scatter)
                            g = net.layers[0].weight.grad
                            (g.to_local() if hasattr(g, "to_local") else g)[0, 0] = float("inf")
                    step()
                result["batches_done"] = b + 1
                if watcher is not None:
                    result["polls_by_batch"].append(watcher._session.fleet.polls)  # store checks after each batch
    except NonFiniteDetected as exc:
        ev = exc.event
        result.update(stopped=True, time=time.time(), event=ev.event, first_rank=ev.first_rank,
                      module=ev.module, module_class=ev.module_class, tensor=ev.tensor, kind=ev.kind,
                      batch_number=ev.batch_number, stopped_at_batch=getattr(ev, "stopped_at_batch", None),
                      message=str(exc))
    except RuntimeError as exc:  # a collective that failed (gloo: "Connection closed by peer")
        result.update(error=f"{type(exc).__name__}: {exc}"[:2000], time=time.time())
    result["weights_finite"] = all(bool(torch.isfinite(p.detach()).all()) for p in net.parameters())
    if (args.on_detect == "skip" or args.reference) and "error" not in result and not result.get("stopped"):
        # the whole weights (FSDP2: gathered from every rank's shard, a collective every rank runs here)
        result["weights"] = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
                             for p in net.parameters()]
    if watcher is not None:
        fleet = watcher._session.fleet
        result.update(polls=fleet.polls, requests=fleet.requests, node_reads=fleet.node_reads,
                      node_file=fleet._node.path if fleet._node else None,
                      local_rank=int(os.environ.get("LOCAL_RANK", "0")), node=int(os.environ.get("GROUP_RANK", "0")))
        # walks of the model: at watch(), then when parameters were replaced
        result["param_scans"] = watcher._session.hooks.index.scans
    result["param_names"] = [n for n, _ in net.named_parameters()]
    result["module_classes"] = sorted({type(m).__name__ for m in net.modules()})
    write_observed(args.out, rank, result)
    if "error" in result:
        return 4
    if result.get("stopped"):
        if result["event"] == "nonfinite_detected":
            time.sleep(args.linger)  # as a Prometheus sink lingering for its last scrape would
        return 3
    if args.on_detect == "skip" or args.reference:
        # every rank runs to here under skip (the gather above relies on it too): leave together,
        # so rank 0, which serves the store, does not tear down while a peer is still tearing down
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main(), sys.argv[1])  # (the results folder: a stopped rank waits there for its peers)
