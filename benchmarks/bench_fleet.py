"""Cost of stopping the ranks together: the store check per optimizer step, and a DDP step with
and without it, taken in turns. Run under torchrun (gloo on one machine by default):

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_fleet.py [--rounds 12 --steps 40]

Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from tensorwatch_otel import watch
from tensorwatch_otel.core import fleet


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--checks", type=int, default=500)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    store = fleet._store()
    check_us = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(args.checks):
            store.check([fleet.STORE_KEY])
        check_us.append((time.perf_counter() - t0) / args.checks * 1e6)
    dist.barrier()
    net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    w = watch(net, sinks=[])
    x = torch.randn(32, 256)

    def steps(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.perf_counter() - t0) / n * 1e6

    steps(5)
    times = {"on": [], "off": []}
    polls = w._session.fleet.polls
    for rnd in range(args.rounds):
        for v in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
            w._session.fleet._stops = v == "on"  # off: no store check at all
            times[v].append(steps(args.steps))
    polls = w._session.fleet.polls - polls
    if dist.get_rank() == 0:
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(json.dumps({"store_check_us_median": round(statistics.median(check_us), 1),
                          "store_check_us": [round(v, 1) for v in check_us],
                          "step_us_with_check": round(on), "step_us_without": round(off),
                          "ratio": round(on / off, 3), "checks_per_step": polls / (args.rounds * args.steps)}))
    w.detach()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
