"""Whether a watched model really runs compiled: per configuration (device path on/off,
autocast on/off, eager-first or not) one small pre-norm stack is watched, compiled and trained
a few steps; printed are dynamo's counters (graphs, frames, recompiles, graph breaks), how many
of our ops ran, the frames recorded, and the profiled step's kernels by origin (inductor's
triton_* kernels against eager aten kernels).

    python benchmarks/compiled_check.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _prenorm import Stack  # noqa: E402


def one(device: str, blocks: int, d: int, mode: str, autocast: bool, steps: int = 4) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    import tensorwatch_otel as tw
    from tensorwatch_otel.core.frames import compiled
    from tensorwatch_otel.core.measure import device_path

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Stack(blocks, d, 8).to(device)
    x = torch.randn(4, 64, d, device=device)
    device_path.set_mode(mode)
    w = tw.watch(model, sinks=[], on_detect="report")
    device_path.set_mode("auto")
    call = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ran0 = compiled.ran.calls
    t0 = time.perf_counter()

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = call(x)
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(steps):
        step()
    warm = time.perf_counter() - t0
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
    names = [e.name for e in prof.events()
             if (e.device_type == torch.autograd.DeviceType.CUDA if device == "cuda" else e.name.startswith("aten::"))]
    w.detach()
    ran = (compiled.ran.calls - ran0) / (steps + 1)
    return {"mode": mode, "autocast": autocast, "warm_s": round(warm, 1), "ran_per_step": ran,
            "graphs": counters["stats"]["unique_graphs"], "frames": dict(counters["frames"]),
            "recompiles": dict(counters["recompiles"]), "breaks": dict(counters["graph_break"]),
            "kernels": len(names), "triton_kernels": sum(1 for n in names if n.startswith("triton_")),
            "our_kernels": sum(1 for n in names if "abs_minmax" in n)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for mode, autocast in (("auto", True), ("off", True), ("auto", False)):
        try:
            row = one(args.device, args.blocks, args.d, mode, autocast)
        except Exception as exc:  # noqa: BLE001 (a diagnostic: print and go on)
            row = {"mode": mode, "autocast": autocast, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
