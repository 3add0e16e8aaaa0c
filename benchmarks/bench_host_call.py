"""The watcher's host work per watched module call: what a GPU step waits for once its kernels
are short. A stack of 24 pre-norm blocks at width 8 (242 module calls a step; compute is
negligible), forward and backward, one thread, process CPU time, in paired rounds that rotate
the variants' order:

    unwatched        the model alone
    watched          watch(model, sinks=[]): the default CPU path (the C kernel per frame)
    watched_device   the device path (the CUDA code path) forced on the CPU with its kernels
                     stubbed at the launcher: every launch is counted and does nothing, so the
                     time is the host's work alone (Triton is not needed)

Per watched variant: (step - unwatched step) / module calls, median and interquartile range
over the rounds, and the launches per step of the device path.

    python benchmarks/bench_host_call.py                 # 40 rounds (a minute or two)
    python benchmarks/bench_host_call.py --quick         # 3 rounds, 2 blocks (smoke test)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _prenorm import Stack  # noqa: E402

VARIANTS = ("unwatched", "watched", "watched_device")


class _Stub:
    """A stand-in for a Triton kernel: `kernel[grid](...)` counts, and makes the slots read as
    finite values (a zeroed slot reads as NaN), so no detection runs."""

    def __init__(self, counts: List[int]) -> None:
        self.counts = counts

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def run(slots: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            self.counts[0] += 1
            slots.fill_(0x3F800000)  # 1.0's pattern in every word
        return run


def _quartiles(v: List[float]) -> List[float]:
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return [q[0], q[2]]


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=None, help="pre-norm blocks (default 24; --quick 2)")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--rounds", type=int, default=None, help="paired rounds (default 40; --quick 3)")
    p.add_argument("--steps", type=int, default=5, help="steps timed per variant in a round")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import tensorwatch_otel as tw
    from tensorwatch_otel.core.measure import device_path

    from tensorwatch_otel.core.measure.cpu_kernel import KERNEL

    KERNEL.wait(120)  # the C kernel the default path measures with, built (or loaded) before any timing
    torch.set_num_threads(1)
    blocks = args.blocks or (2 if args.quick else 24)
    rounds = args.rounds or (3 if args.quick else 40)
    torch.manual_seed(0)
    base = Stack(blocks, args.width, 2)
    x = torch.randn(2, 8, args.width)
    calls = blocks * 10 + 2
    launches = [0]
    stub = (_Stub(launches), _Stub(launches), _Stub(launches))
    # the device path on CPU tensors, its kernels stubbed: no Triton needed, no kernel run
    device_path.DEVICE_PATH.kernels[True] = stub
    os.environ["TRITON_INTERPRET"] = "1"  # (read by the device path's choice; Triton is never imported)

    def make(name: str) -> Callable[[], None]:
        m = copy.deepcopy(base)
        watcher = None
        if name != "unwatched":
            device_path.set_mode("force" if name == "watched_device" else "off")
            try:
                watcher = tw.watch(m, sinks=[])
            finally:
                device_path.set_mode("auto")

        def step() -> None:
            m(x).square().mean().backward()
            m.zero_grad(set_to_none=True)
        step.watcher = watcher  # type: ignore[attr-defined]  (kept alive with the step)
        return step

    steps = {name: make(name) for name in VARIANTS}
    for s in steps.values():
        for _ in range(3):
            s()
    times: Dict[str, List[float]] = {name: [] for name in VARIANTS}
    counted = []
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for name in order:
            before = launches[0]
            t0 = time.process_time()
            for _ in range(args.steps):
                steps[name]()
            times[name].append((time.process_time() - t0) / args.steps)
            if name == "watched_device":
                counted.append((launches[0] - before) / args.steps)
    per_call = {name: [(w - u) / calls * 1e6 for w, u in zip(times[name], times["unwatched"])]
                for name in VARIANTS[1:]}
    result = {"blocks": blocks, "width": args.width, "module_calls": calls, "rounds": rounds,
              "step_ms_median": {k: 1e3 * statistics.median(v) for k, v in times.items()},
              "host_us_per_call": {k: {"median": statistics.median(v), "iqr": _quartiles(v)}
                                   for k, v in per_call.items()},
              "device_launches_per_step": statistics.median(counted)}
    for name in VARIANTS:
        print(f"{name:15} {1e3 * statistics.median(times[name]):8.3f} ms a step")
    for name, v in per_call.items():
        lo, hi = _quartiles(v)
        print(f"{name:15} +{statistics.median(v):6.2f} us a module call (IQR {lo:.2f}-{hi:.2f})")
    print(f"watched_device: {result['device_launches_per_step']:.1f} launches a step for {calls} module calls "
          "(stubbed: counted, not run)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
