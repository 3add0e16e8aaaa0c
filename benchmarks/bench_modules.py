"""The cost per module: a sweep over the module count (the MoE shape, many small modules), eager.

A `Sequential` of N `Linear(16, 16)` takes fwd+bwd+SGD steps on a small token batch, for each
N (10, 100, 1000, 5000 by default). Per N, in one process, paired in bracketed rounds (each
variant's step between two steps of the unwatched model, order rotated each round, a full
garbage collection before every step, untimed; see benchmarks/_bracketed.py):

    watch     watch(model, sinks=[])                 issue bar at 5000 modules: <= 1.5x
    sampled   watch(model, sinks=[], every_n_batches=10)   issue bar: <= 1.03x (the mean)
    null      a second unwatched copy: copy-to-copy difference plus the machine's noise

Every variant trains a copy of its own (same weights at the start) with its watcher attached
for the whole run, so its steady state is timed, never the first batch after an attach (the
sampled variant takes `every_n_batches` more untimed steps: past its second recorded batch,
where its weight table is full).
Per N and variant: the median ratio with its 90% interval (order statistics), min and max,
and the mean ratio (for `sampled` the mean is the cost: one step in ten is measured, so the
median shows only the unsampled steps).

    python benchmarks/bench_modules.py                       # 10..5000 modules, 20 rounds (minutes)
    python benchmarks/bench_modules.py --quick               # seconds (smoke test)
    python benchmarks/bench_modules.py --sizes 5000 --rounds 30 --json out.json
    python benchmarks/bench_modules.py --clock cpu      # CPU time of the process (loaded machine)
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _bracketed import median_interval, run_bracketed  # noqa: E402

VARIANTS = ("watch", "sampled", "null")
OPTIONS = {"watch": {}, "sampled": {"every_n_batches": 10}}
BARS = {"watch": ("ratio_median", 1.5), "sampled": ("ratio_mean", 1.03)}  # at the largest N


class Chain:
    """One copy of the N-module chain with its own SGD: one fwd+bwd+SGD step per call."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor):
        self.model, self.x = model, x
        # lr 1e-6: the deep chain stays finite (at 1e-4 the 5000-module chain diverged to nan
        # within 4 steps, and every later step timed the detection path, not the watch)
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    #: wall time, or the process' CPU time (time.process_time): on one thread, immune to the
    #: preemption of a loaded shared machine
    clock: Callable[[], float] = time.perf_counter

    def step(self) -> float:
        t0 = Chain.clock()
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return Chain.clock() - t0


def build(n: int, tokens: int, width: int = 16):
    """(model, input): n Linear(width, width) in a Sequential, a batch of `tokens` rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n)])
    with torch.no_grad():  # keep activations O(1) through thousands of layers
        for lin in model:
            lin.weight.copy_(torch.eye(width) + 0.01 * torch.randn(width, width))
            lin.bias.zero_()
    model.train()
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1))
    return model, x


def sweep_one(n: int, names: List[str], rounds: int, warmup: int, tokens: int) -> Dict[str, dict]:
    """Bracketed rounds for one module count; returns the per-variant summaries."""
    import tensorwatch_otel as tw

    base, x = build(n, tokens)
    steps: Dict[str, Callable[[], float]] = {"unwatched": Chain(copy.deepcopy(base), x).step}
    watchers = []
    for name in names:
        own = Chain(copy.deepcopy(base), x)
        if name in OPTIONS:
            watchers.append(tw.watch(own.model, sinks=[], on_detect="report", **OPTIONS[name]))
        steps[name] = own.step
    try:
        for name, step in steps.items():
            # a sampled watch reaches its steady state at its second recorded batch (the weight
            # table holds the weights its first one offered): warm it past that batch too
            for _ in range(warmup + OPTIONS.get(name, {}).get("every_n_batches", 0)):
                step()
        print(f"\n{n} modules:", file=sys.stderr)
        result = run_bracketed(steps, rounds, settle=gc.collect)
        spoilt = [w for w in watchers if w.detections or w.steps_skipped]
        if spoilt:  # the figures would time the detection path: say so, never pass silently
            raise RuntimeError(f"{n} modules: the model went non-finite during the benchmark "
                               f"({sum(w.detections for w in spoilt)} detections)")
    finally:
        for w in watchers:
            w.detach()
    for entry in result.values():
        entry["median_interval_90"] = list(median_interval(entry["ratios"]))
        entry["ratio_mean"] = statistics.fmean(entry["ratios"])
    return result


def print_sweep(rows: List[dict]) -> None:
    print(f"\n{'modules':>8} {'variant':<8} {'median':>7} {'90% interval':>15} {'min':>7} {'max':>7} "
          f"{'mean':>7} {'unwatched ms':>13}")
    for row in rows:
        base_ms = row["variants"]["unwatched"]["step_ms_median"]
        for name, v in row["variants"].items():
            if name == "unwatched":
                continue
            lo, hi = v["median_interval_90"]
            print(f"{row['modules']:>8} {name:<8} {v['ratio_median']:>7.3f} {lo:>7.3f}..{hi:<7.3f} "
                  f"{v['ratio_min']:>7.3f} {v['ratio_max']:>7.3f} {v['ratio_mean']:>7.3f} {base_ms:>13.1f}")
    last = rows[-1]
    for name, (key, bar) in BARS.items():
        v = last["variants"].get(name)
        if v is not None:
            print(f"{name} at {last['modules']} modules: {key.split('_')[1]} {v[key]:.3f} vs bar {bar:.2f}: "
                  + ("holds" if v[key] <= bar else "missed"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 and 100 modules, 2 rounds (smoke test)")
    p.add_argument("--sizes", default="10,100,1000,5000", help="comma list of module counts")
    p.add_argument("--rounds", type=int, default=20, help="bracketed rounds per size (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    p.add_argument("--tokens", type=int, default=32, help="rows of the input batch (default 32)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {','.join(VARIANTS)}")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time (default), or the process' CPU time: immune to preemption on a "
                        "shared machine, blind to time spent waiting")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.warmup = "10,100", min(args.rounds, 2), 1
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {','.join(unknown)} (choose from {','.join(VARIANTS)})")
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.rounds < 1 or not sizes or min(sizes) < 1:
        p.error("--rounds and every size must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        Chain.clock = time.process_time
    print(f"Sequential of Linear(16,16), batch ({args.tokens}, 16), fwd+bwd+SGD, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.clock} clock", file=sys.stderr)
    rows = [{"modules": n, "variants": sweep_one(n, names, args.rounds, args.warmup, args.tokens)}
            for n in sizes]
    print_sweep(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "clock": args.clock, "tokens": args.tokens,
                       "rounds": args.rounds, "sizes": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
