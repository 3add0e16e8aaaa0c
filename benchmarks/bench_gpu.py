"""The GPU figures of the statistics engine: a GPT-2-medium-shaped training step (24 pre-norm
blocks, d 1024, 16 heads, batch 8x512, bf16 autocast, AdamW), unwatched and watched, eager and
compiled, with per variant the step time and its ratio, the kernels the profiler saw and the
host syncs and copies of one step.

Variants (each on its own copy of the same weights, timed in rounds that rotate their order;
ratios against `unwatched` for the eager variants and against `compiled` for the compiled ones):

    unwatched            the model alone
    watched              watch(model, sinks=[]): on CUDA the fused device path (core/measure/device_stats.py)
    watched_torch_ops    (CUDA) the same with the device path off: two vector_norm reads and two
                         0-d results per tensor, a stack and one copy per batch
    watched_device       (CPU) the device path forced on the CPU under Triton's interpreter: the
                         CUDA code path on CPU tensors (its time says nothing; its counts do)
    compiled             (CUDA) torch.compile(model)
    compiled_watched     (CUDA) watch(model), then torch.compile(model)
    compiled_ro          (CUDA) torch.compile(model, mode="reduce-overhead")
    compiled_ro_watched  (CUDA) watch(model), then torch.compile(model, mode="reduce-overhead")

Per variant, one profiled step apart from the timing: on CUDA the kernels launched (profiler
events on the device), on a CPU the aten ops dispatched; host syncs (`_local_scalar_dense`) and
device-to-host copies counted at the dispatcher; reads of the device path's slot buffer (one copy
and, on CUDA, one event wait each).

    python benchmarks/bench_gpu.py --device cuda                 # the figures (minutes: 4 compiles)
    python benchmarks/bench_gpu.py --device cuda --variants unwatched,watched,watched_torch_ops
    python benchmarks/bench_gpu.py --device cpu --quick          # a tiny shape, seconds (smoke test)
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
from typing import Callable, Dict, List, Optional

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    # the device path on CPU tensors runs in Triton's interpreter, chosen when Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _prenorm import Stack  # noqa: E402

CUDA_VARIANTS = ("unwatched", "watched", "watched_torch_ops", "compiled", "compiled_watched", "compiled_ro",
                 "compiled_ro_watched")
CPU_VARIANTS = ("unwatched", "watched", "watched_device")
aten = torch.ops.aten


class SyncCounter(TorchDispatchMode):
    """Host syncs (`_local_scalar_dense`) and copies from a device to the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            if args[0].device.type != "cpu":  # (a CPU scalar's .item(), as AdamW's step count, is no sync)
                self.syncs += 1
        elif func is aten._to_copy.default:
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cpu" and args[0].device.type != "cpu":
                self.copies += 1
        elif func is aten.copy_.default and args[0].device.type == "cpu" and args[1].device.type != "cpu":
            self.copies += 1
        return func(*args, **kwargs)


def shape(quick: bool, device: torch.device):
    """(blocks, d, heads, (batch, seq))."""
    if quick:
        return 1, 32, 4, (2, 16)
    if device.type == "cuda":
        return 24, 1024, 16, (8, 512)
    return 2, 256, 8, (4, 128)


class Trainer:
    """One variant: its model copy, optimizer, watcher and the callable its step calls."""

    def __init__(self, name: str, base: torch.nn.Module, x: torch.Tensor, autocast: Optional[torch.dtype],
                 fused: bool = False, on_detect: str = "report"):
        import tensorwatch_otel as tw
        from tensorwatch_otel.core.measure import device_path

        self.name, self.x, self.autocast = name, x, autocast
        self.model = copy.deepcopy(base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=fused or None)
        self.watcher = None
        watched = name.endswith(("_watched", "watched_torch_ops", "watched_device")) or name == "watched"
        if watched:
            device_path.set_mode({"watched_torch_ops": "off", "watched_device": "force"}.get(name, "auto"))
            try:
                self.watcher = tw.watch(self.model, sinks=[], on_detect=on_detect)
            finally:
                device_path.set_mode("auto")
        self.call: Callable[[torch.Tensor], torch.Tensor] = self.model
        if name.startswith("compiled"):
            mode = "reduce-overhead" if name.startswith("compiled_ro") else None
            self.call = torch.compile(self.model, mode=mode)

    def sync(self) -> None:
        if self.x.device.type == "cuda":
            torch.cuda.synchronize(self.x.device)

    def step(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        with torch.autocast(self.x.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            out = self.call(self.x)
        out.float().square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return time.perf_counter() - t0


def counts(trainer: Trainer) -> Dict[str, int]:
    """One step's kernels (CUDA) or aten ops (CPU) seen by the profiler, its host syncs and
    copies, and the device path's slot-buffer reads."""
    from torch.profiler import ProfilerActivity, profile

    from tensorwatch_otel.core.measure import slot_buffer

    reads = []
    readers = set()
    real_read = slot_buffer.SlotBuffer.read

    def read(buf, extra=None):
        if buf.used:
            reads.append(buf.used)
            # where the read came from (a read in an unwatched variant's step is another's)
            import traceback
            readers.add(" < ".join(f"{f.name}:{f.lineno}" for f in traceback.extract_stack(limit=8)[:-1][::-1]))
        return real_read(buf, extra)

    cuda = trainer.x.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    slot_buffer.SlotBuffer.read = read  # type: ignore[method-assign]
    try:
        with profile(activities=activities) as prof:
            trainer.step()
        with SyncCounter() as sc:
            trainer.step()
    finally:
        slot_buffer.SlotBuffer.read = real_read  # type: ignore[method-assign]
    events = prof.events()
    if cuda:
        seen = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        seen = [e.name for e in events if e.name.startswith("aten::")]
    by_name: Dict[str, int] = {}
    for k in seen:
        by_name[k] = by_name.get(k, 0) + 1
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:12])
    return {"kernels" if cuda else "aten_ops": len(seen), "host_syncs": sc.syncs, "d2h_copies": sc.copies,
            "buffer_reads": len(reads) // 2, "slots_read": sum(reads) // 2, "top": top,
            "readers": sorted(readers)}


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="a tiny shape, few steps (smoke test)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 10; --quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per variant (default 3; --quick 1)")
    p.add_argument("--variants", default=None, help="comma-separated (default: all for the device)")
    p.add_argument("--autocast", choices=("bf16", "none"), default=None,
                   help="bf16 autocast (default on CUDA) or none (default on a CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True) (default: torch's choice, foreach on CUDA)")
    p.add_argument("--on-detect", choices=("report", "raise"), default="report",
                   help="the watched variants' on_detect (default report; with --fused, raise hands the step "
                        "guard's verdict to the optimizer as its found_inf)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    names = tuple(args.variants.split(",")) if args.variants else (
        CUDA_VARIANTS if device.type == "cuda" else CPU_VARIANTS)
    if "watched_device" in names:
        try:
            import triton  # noqa: F401
        except ImportError:
            names = tuple(n for n in names if n != "watched_device")
            print("watched_device left out: triton is not installed")
    autocast = {"bf16": torch.bfloat16, "none": None}[args.autocast or ("bf16" if device.type == "cuda" else "none")]
    n, d, heads, (b, t) = shape(args.quick, device)
    torch.manual_seed(0)
    base = Stack(n, d, heads).to(device).train()
    x = torch.randn(b, t, d, generator=torch.Generator().manual_seed(1)).to(device)
    print(f"model: {n} pre-norm blocks, d {d}, {heads} heads, batch {b}x{t}, device {device}, autocast {autocast}, "
          f"torch {torch.__version__}, AdamW{'(fused=True)' if args.fused else ''}, on_detect={args.on_detect!r}")

    trainers = {name: Trainer(name, base, x, autocast, args.fused, args.on_detect) for name in names}
    del base
    compile_s = {}
    for name, tr in trainers.items():
        t0 = time.perf_counter()
        for _ in range(warmup):
            tr.step()
        compile_s[name] = time.perf_counter() - t0
    times: Dict[str, List[float]] = {name: [] for name in names}
    order = list(names)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            gc.collect()
            times[name].append(trainers[name].step())

    from torch._dynamo.utils import counters as dynamo_counters

    result: dict = {"dynamo": {"unique_graphs": dynamo_counters["stats"]["unique_graphs"],
                               "frames": dict(dynamo_counters["frames"]),
                               "recompiles": dict(dynamo_counters["recompiles"]),
                               "graph_breaks": dict(dynamo_counters["graph_break"]),
                               "cudagraph_skips": dynamo_counters["inductor"]["cudagraph_skips"]},
                    "device": str(device), "quick": args.quick, "shape": {"blocks": n, "d": d, "heads": heads,
                    "batch": [b, t]}, "autocast": str(autocast), "rounds": rounds, "fused": args.fused,
                    "on_detect": args.on_detect, "variants": {}}
    print(f"{'variant':22} {'step ms':>9} {'ratio':>7} {'kernels' if device.type == 'cuda' else 'aten ops':>9} "
          f"{'syncs':>6} {'copies':>7} {'reads':>6} {'slots':>6}")
    for name in names:
        med = statistics.median(times[name])
        ref = "compiled" if name.startswith("compiled") and "compiled" in times else "unwatched"
        ratio = med / statistics.median(times[ref]) if ref in times else float("nan")
        c = counts(trainers[name])
        hooked = sum(1 for m in trainers[name].model.modules() if m._forward_hooks or m._forward_pre_hooks)
        row = {"step_ms_median": 1e3 * med, "hooked_modules": hooked, "step_ms": [1e3 * v for v in times[name]],
               "ratio": ratio, "ratio_to": ref, "warmup_s": compile_s[name], **c}
        result["variants"][name] = row
        k = c.get("kernels", c.get("aten_ops"))
        print(f"{name:22} {1e3 * med:9.2f} {ratio:7.3f} {k:9d} {c['host_syncs']:6d} {c['d2h_copies']:7d} "
              f"{c['buffer_reads']:6d} {c['slots_read']:6d}  (spread {1e3 * min(times[name]):.2f}-"
              f"{1e3 * max(times[name]):.2f})")
    v = result["variants"]
    for watched, plain in (("watched", "unwatched"), ("watched_torch_ops", "unwatched"),
                           ("compiled_watched", "compiled"), ("compiled_ro_watched", "compiled_ro")):
        key = "kernels" if device.type == "cuda" else "aten_ops"
        if watched in v and plain in v:
            extra = v[watched][key] - v[plain][key]
            v[watched][f"extra_{key}"] = extra
            print(f"{watched}: {extra} {key.replace('_', ' ')} more than {plain} per step")
    if "watched_device" in v:
        print("watched_device: under Triton's interpreter each launch dispatches aten ops of its own (on CUDA a "
              "launch is one kernel); its time is the interpreter's")
    print("dynamo:", result["dynamo"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
