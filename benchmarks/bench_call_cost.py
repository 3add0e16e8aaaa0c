"""The watcher's cost per module call, eager and compiled, on a model of many small modules
(pre-norm blocks of width 32: the step is mostly per-call overhead, as on a fast GPU whose
kernels finish before the host issues the next): four variants (unwatched and watched, eager
and torch.compile'd) timed side by side in rotating rounds; per variant the median step and,
per watched module call, (watched - unwatched) / module calls, eager and compiled.

    python benchmarks/bench_call_cost.py                  # 24 blocks, 15 rounds (a minute or two)
    python benchmarks/bench_call_cost.py --quick          # 1 block, 2 rounds (smoke test)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _prenorm import Stack  # noqa: E402

VARIANTS = ("eager", "eager_watched", "compiled", "compiled_watched")


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=None, help="pre-norm blocks (default 24; --quick 1)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15; --quick 2)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import tensorwatch_otel as tw

    torch.set_num_threads(args.threads)
    blocks = args.blocks or (1 if args.quick else 24)
    rounds = args.rounds or (2 if args.quick else 15)
    torch.manual_seed(0)
    base = Stack(blocks, 32, 4)
    # (--quick: bench_compiled.py --quick's model and input, so that one of the two smoke runs
    # finds the other's compiled graphs in inductor's cache)
    x = torch.randn(2, 16 if args.quick else 8, 32)
    calls = blocks * 10 + 2  # modules called per forward, the root included

    def make(name: str) -> Callable[[], None]:
        m = copy.deepcopy(base)
        watcher = tw.watch(m, sinks=[]) if name.endswith("watched") else None
        call = torch.compile(m) if name.startswith("compiled") else m
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)

        def step() -> None:
            call(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        step.watcher = watcher  # type: ignore[attr-defined]  (kept alive with the step)
        return step

    steps = {name: make(name) for name in VARIANTS}
    for s in steps.values():
        for _ in range(3):
            s()
    times: Dict[str, List[float]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 4:] + VARIANTS[:r % 4]
        for name in order:
            t0 = time.process_time()
            steps[name]()
            times[name].append(time.process_time() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    per_call = {"eager": (med["eager_watched"] - med["eager"]) / calls,
                "compiled": (med["compiled_watched"] - med["compiled"]) / calls}
    result = {"blocks": blocks, "module_calls": calls, "rounds": rounds,
              "step_ms_median": {k: 1e3 * v for k, v in med.items()},
              "step_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
              "per_call_us": {k: 1e6 * v for k, v in per_call.items()}}
    for name in VARIANTS:
        lo, hi = 1e3 * min(times[name]), 1e3 * max(times[name])
        print(f"{name:18} {1e3 * med[name]:8.2f} ms  (min {lo:.2f}, max {hi:.2f})")
    eager_us, compiled_us = 1e6 * per_call["eager"], 1e6 * per_call["compiled"]
    print(f"per watched module call: eager {eager_us:.1f} us, compiled {compiled_us:.1f} us "
          f"({calls} module calls per step, process CPU time)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
