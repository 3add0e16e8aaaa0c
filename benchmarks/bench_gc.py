"""What the watcher costs through Python's garbage collector: bench_modules.py's model (a
`Sequential` of N `Linear(16, 16)`, fwd+bwd+SGD, one thread), with the collector left to run
as it does in a training loop.

bench_modules.py collects the garbage before every step, untimed, so no step pays for the one
before it. That also hides a cost of the watcher: the objects it keeps (hooks, handles, weak
references: tens per module) make every full collection longer, and the objects a recorded
batch keeps until its end (a frame and an entry per module call) make full collections come
more often. A training loop pays both. Here each variant runs in a process of its own (the
models of the others would share its collector), the processes alternated in rounds; per
process, after a warm-up, `--steps` steps timed whole (process CPU time), the collector's time
per step (gc.callbacks) and the objects it tracks.

    unwatched   the model alone
    watch       watch(model, sinks=[])
    sampled     watch(model, sinks=[], every_n_batches=10)

Per variant: the ratio of its mean step to the unwatched mean of the same round (median, min,
max over rounds), the collector's milliseconds per step and the tracked objects.

    python benchmarks/bench_gc.py                        # 5000 modules, 5 rounds (about 4 minutes)
    python benchmarks/bench_gc.py --modules 1000 --rounds 3 --steps 30
    python benchmarks/bench_gc.py --quick                # seconds (smoke test)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List

VARIANTS = ("unwatched", "watch", "sampled")


def one_process(variant: str, modules: int, steps: int, warmup: int, threads: int) -> Dict[str, float]:
    """Runs in the child: `warmup` untimed steps, then `steps` timed ones."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(modules)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)  # (bench_modules.py's: the chain stays finite)
    x = torch.randn(32, 16)
    watcher = None
    if variant != "unwatched":
        import tensorwatch_otel as tw
        from tensorwatch_otel.core.measure.cpu_kernel import KERNEL

        KERNEL.wait(300)  # (the first build of the C kernel is not a step's cost)
        watcher = tw.watch(model, sinks=[], every_n_batches=10 if variant == "sampled" else 1)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(warmup):
        step()
    spent = [0.0, 0.0]  # collector seconds, a collection's start

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            spent[1] = time.process_time()
        else:
            spent[0] += time.process_time() - spent[1]

    gc.callbacks.append(on_gc)
    t0 = time.process_time()
    for _ in range(steps):
        step()
    elapsed = time.process_time() - t0
    gc.callbacks.remove(on_gc)
    if watcher is not None and (watcher.detections or watcher.steps_skipped):
        raise RuntimeError("the model went non-finite: the figures would time the detection path")
    return {"step_ms": elapsed * 1e3 / steps, "gc_ms": spent[0] * 1e3 / steps, "tracked": len(gc.get_objects())}


def run(modules: int, rounds: int, steps: int, warmup: int, threads: int) -> dict:
    per: Dict[str, List[Dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]  # (rotated: no variant always runs first)
        for variant in order:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant,
                                  "--modules", str(modules), "--steps", str(steps), "--warmup", str(warmup),
                                  "--threads", str(threads)],
                                 capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
            if out.returncode != 0:
                raise RuntimeError(f"{variant}: {out.stderr[-2000:]}")
            per[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{rounds}: " + "  ".join(
            f"{v} {per[v][-1]['step_ms']:.1f} ms (gc {per[v][-1]['gc_ms']:.1f})" for v in VARIANTS), file=sys.stderr)
    result: dict = {"modules": modules, "rounds": rounds, "steps": steps, "variants": {}}
    for v in VARIANTS:
        ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(per[v], per["unwatched"])]
        result["variants"][v] = {
            "ratios": ratios, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "step_ms_median": statistics.median(a["step_ms"] for a in per[v]),
            "gc_ms_median": statistics.median(a["gc_ms"] for a in per[v]),
            "tracked_median": statistics.median(a["tracked"] for a in per[v])}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modules", type=int, default=5000, help="Linear(16, 16) modules (default 5000)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, a process per variant each (default 5)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per process (default 60)")
    p.add_argument("--warmup", type=int, default=12, help="untimed steps first (default 12)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--quick", action="store_true", help="100 modules, 1 round of 10 steps (smoke test)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("modules", "rounds", "steps", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    if a.child:
        print(json.dumps(one_process(a.child, a.modules, a.steps, a.warmup, a.threads)))
        return 0
    if a.quick:
        a.modules, a.rounds, a.steps, a.warmup = 100, 1, 10, 11
    result = run(a.modules, a.rounds, a.steps, a.warmup, a.threads)
    print(f"\n{a.modules} modules, {a.rounds} rounds of {a.steps} steps, the collector as in a training loop:")
    print(f"{'variant':<10} {'ratio median':>12} {'min':>7} {'max':>7} {'step ms':>8} {'gc ms/step':>10} "
          f"{'tracked objects':>16}")
    for v, r in result["variants"].items():
        print(f"{v:<10} {r['ratio_median']:>12.3f} {r['ratio_min']:>7.3f} {r['ratio_max']:>7.3f} "
              f"{r['step_ms_median']:>8.1f} {r['gc_ms_median']:>10.1f} {int(r['tracked_median']):>16}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
