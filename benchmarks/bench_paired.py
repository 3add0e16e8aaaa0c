"""Always-on cost at the limit: the watched step against the unwatched one and against the peer
(transformers.debug_utils.DebugUnderflowOverflow), paired round by round in one process.

Every variant starts from the same weights. By default each round runs one step of every
variant, in an order rotated each round, with a step of the unwatched model before and after
each one: a variant's ratio in that round is its step over the mean of those two, a few seconds
apart, so machine drift hits both sides alike. The unwatched step and the variants that only
add hooks train one shared copy (a watcher attached for the step, untimed); `sampled` and
`peer` train copies of their own, so their ratios also hold the difference between two copies
of one model in memory (a few percent here). A full garbage collection precedes every step,
untimed. (`--schedule segments`: the older scheme, --steps steps per variant in turn on the
shared copy, each segment's first step dropped, ratio of the segment medians.)
The table gives the median, quartiles, min and max of the per-round ratios, and the bar lines a
90% interval of the median (order statistics: it needs no assumption about the noise).
Variants:

    watch             watch(model, sinks=[])                 the bar: <= 1.05x (stretch 1.03x)
    sampled           every_n_batches=10                     the bar: <= 1.01x
    budget            max_overhead=0.02 (--max-overhead)     the bar: attributed <= 1.025x in steady
                      state (the steps after the first quarter, in blocks of the chosen interval)
    gradients         gradients=True
    optimizer_state   optimizer_state=True
    prometheus        watch + PrometheusMetrics(port=0) scraped every --scrape-interval s
                      (the always-on default set-up)
    module            check="module" (a readback per module call)
    fp8               target_dtypes=["float8_e4m3fn"] (precision headroom: exact counts)
    fp8_fp16_bf16     target_dtypes=["float8_e4m3fn", "float16", "bfloat16"]
    null              the unwatched step again: its spread around 1.0 is the machine's noise,
                      the resolution of every other figure
    peer              transformers' DebugUnderflowOverflow (its own copy: it cannot detach)

Then, on a CPU, the attributed ratio of each watched variant: the time spent inside the
watcher's hooks, timed within each step by the step's own clock, as step / (step - hooks). Both
parts come from the same seconds, so it resolves what the paired ratios cannot on a noisy
machine; it leaves out indirect costs (evicted caches), which only the paired ratios see.

Then, per variant, one probed step apart from the timing: aten ops dispatched (watched minus
unwatched: the work the watcher adds; on CUDA each is at least one kernel launch; on a CPU the
compiled statistics kernel is not an aten op, so its calls, one per measured tensor, are not in
this count), host syncs
(.item() and the like) and copies to the host; on CUDA also the kernels the profiler saw and
the extra peak device memory.

    python benchmarks/bench_paired.py                  # T5-shaped, fp32, CPU, 2 threads (minutes)
    python benchmarks/bench_paired.py --quick          # seconds (smoke test)
    python benchmarks/bench_paired.py --device cuda    # GPT-2-medium-shaped, bf16 autocast
    python benchmarks/bench_paired.py --rounds 21 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_step import VARIANTS, WATCH_OPTIONS, Trainer, build_model, make_variants, run_rounds  # noqa: E402
from _attribution import attribute  # noqa: E402
from _bracketed import Copies, median_interval, run_bracketed  # noqa: E402

DEFAULT_VARIANTS = "null,watch,peer,sampled,gradients,optimizer_state,prometheus"
_aten = torch.ops.aten


class _Probe(TorchDispatchMode):
    """Counts, within one step: aten ops dispatched, host syncs, copies to the host."""

    def __init__(self):
        super().__init__()
        self.ops = self.syncs = self.to_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if func is _aten._local_scalar_dense.default:
            self.syncs += 1
        elif func is _aten._to_copy.default:
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cpu" and args[0].device.type != "cpu":
                self.to_host += 1
        elif func is _aten.copy_.default:
            if args[0].device.type == "cpu" and args[1].device.type != "cpu":
                self.to_host += 1
        return func(*args, **kwargs)


class StepProbe:
    """Entered around each step (Trainer.step_context): keeps one dict of counts per step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.steps: List[dict] = []

    @contextlib.contextmanager
    def __call__(self):
        probe = _Probe()
        cuda = self.device.type == "cuda"
        prof = None
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start_mem = torch.cuda.memory_allocated(self.device)
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        try:
            with probe:
                yield
        finally:
            counts = {"ops": probe.ops, "host_syncs": probe.syncs, "copies_to_host": probe.to_host}
            if cuda:
                torch.cuda.synchronize(self.device)
                prof.__exit__(None, None, None)
                kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                counts["cuda_kernels"] = sum(1 for e in kernels if not e.name.startswith("Memcpy"))
                counts["cuda_dtoh"] = sum(1 for e in kernels if e.name.startswith("Memcpy DtoH"))
                counts["peak_mem_mib"] = (torch.cuda.max_memory_allocated(self.device) - start_mem) / 2 ** 20
            self.steps.append(counts)


def probe_counts(variants, device: torch.device, steps: int = 2) -> Dict[str, dict]:
    """Per variant, the median counts of `steps` probed steps (after one unprobed), and for
    watched variants the difference to the unwatched step."""
    out: Dict[str, dict] = {}
    for name, run in variants.items():
        probe = StepProbe(device)
        Trainer.step_context = probe
        try:
            run(steps + 1)
        finally:
            Trainer.step_context = None
        kept = probe.steps[1:]
        out[name] = {k: statistics.median(s[k] for s in kept) for k in kept[0]}
    base = out.get("unwatched", {})
    for name, c in out.items():
        if name != "unwatched":
            c["extra_ops"] = c["ops"] - base.get("ops", 0)
            if "cuda_kernels" in c:
                c["extra_cuda_kernels"] = c["cuda_kernels"] - base.get("cuda_kernels", 0)
                c["extra_peak_mem_mib"] = c["peak_mem_mib"] - base.get("peak_mem_mib", 0)
    print(f"\n{'variant':<16} {'ops/step':>9} {'extra ops':>10} {'host syncs':>11} {'to host':>8}"
          + (f" {'kernels':>8} {'extra':>6} {'DtoH':>5} {'extra MiB':>10}" if device.type == "cuda" else ""))
    for name, c in out.items():
        line = (f"{name:<16} {c['ops']:>9.0f} {c.get('extra_ops', 0):>10.0f} {c['host_syncs']:>11.0f} "
                f"{c['copies_to_host']:>8.0f}")
        if device.type == "cuda":
            line += (f" {c['cuda_kernels']:>8.0f} {c.get('extra_cuda_kernels', 0):>6.0f} {c['cuda_dtoh']:>5.0f}"
                     f" {c.get('extra_peak_mem_mib', 0):>10.1f}")
        print(line)
    return out


BARS = {"watch": 1.05, "prometheus": 1.05, "sampled": 1.01, "budget": 1.025}


def print_bars(result: Dict[str, dict], attributed: Dict[str, dict]) -> None:
    """Where the issue's bars stand: the paired median (with its third quartile) and, where
    measured, the attributed ratio."""
    lines = []
    for name, bar in BARS.items():
        v = result.get(name)
        if v is None:
            continue
        lo, hi = v.get("median_interval_90", (v["ratio_min"], v["ratio_max"]))
        line = (f"{name}: median {v['ratio_median']:.3f} (90% interval of the median {lo:.3f}..{hi:.3f}) "
                f"vs bar {bar:g}: " + ("holds" if v["ratio_median"] <= bar else "missed")
                + (" (interval within it)" if hi <= bar else "")
                + (", stretch 1.03 holds" if name == "watch" and v["ratio_median"] <= 1.03 else ""))
        a = attributed.get(name)
        if a is not None and "steady_pooled" in a:
            line += (f"; attributed in steady state {a['steady_pooled']:.4f} (blocks {a['steady_min']:.4f}.."
                     f"{a['steady_max']:.4f}, one batch in {a['interval']}): "
                     + ("holds" if a["steady_pooled"] <= bar else "missed"))
        elif a is not None:
            line += f"; attributed {a['ratio_median']:.3f}: " + ("holds" if a["ratio_median"] <= bar else "missed")
        lines.append(line)
    if "null" in result:
        v = result["null"]
        lo, hi = v.get("median_interval_90", (v["ratio_min"], v["ratio_max"]))
        lines.append(f"noise (null variant): median {v['ratio_median']:.3f} (90% interval {lo:.3f}..{hi:.3f}), "
                     f"quartiles {v['ratio_q1']:.3f}..{v['ratio_q3']:.3f}, "
                     f"min..max {v['ratio_min']:.3f}..{v['ratio_max']:.3f}")
    if "peer" in result and "watch" in result:
        lines.append(f"peer / watch step time: {result['peer']['ratio_median'] / result['watch']['ratio_median']:.2f}x")
    print("\n" + "\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, one short round (smoke test)")
    p.add_argument("--rounds", type=int, default=15, help="paired rounds (default 15)")
    p.add_argument("--schedule", choices=("bracketed", "segments"), default="bracketed",
                   help="bracketed (default): each variant's step between two unwatched steps, one "
                        "model copy per variant; segments: --steps steps per variant in turn on a "
                        "shared copy")
    p.add_argument("--steps", type=int, default=3,
                   help="segments: timed steps per variant per round (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma list of {','.join(VARIANTS)} (default {DEFAULT_VARIANTS})")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto")
    p.add_argument("--model", choices=("auto", "t5", "gpt2-medium"), default="auto",
                   help="auto: t5 on CPU, gpt2-medium on CUDA")
    p.add_argument("--autocast", choices=("auto", "none", "bf16", "fp16"), default="auto",
                   help="autocast dtype of forward (auto: none on CPU, bf16 on CUDA)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--scrape-interval", type=float, default=15.0,
                   help="seconds between scrapes of the prometheus variant (default 15; 0: none)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time (default), or the process' CPU time: immune to preemption on a "
                        "shared machine, but blind to time spent waiting (CPU only)")
    p.add_argument("--attribute-steps", type=int, default=4, metavar="N",
                   help="steps per watched variant for the attributed ratio (CPU only; default 4, 0: skip)")
    p.add_argument("--max-overhead", type=float, default=0.02,
                   help="the budget variant's max_overhead (default 0.02)")
    p.add_argument("--no-counts", action="store_true", help="skip the probed step (op and sync counts)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = min(args.rounds, 2), 1, 1
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    arch = args.model if args.model != "auto" else ("gpt2-medium" if device.type == "cuda" else "t5")
    autocast = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                "auto": torch.bfloat16 if device.type == "cuda" else None}[args.autocast]
    if args.threads:
        torch.set_num_threads(args.threads)
    from tensorwatch_otel.core.measure.cpu_kernel import KERNEL
    KERNEL.wait()  # the CPU kernel is built on a thread of its own: time the kernel, not its build
    if args.clock == "cpu":
        if device.type != "cpu":
            p.error("--clock cpu: CPU only (a GPU step's time is not the process' CPU time)")
        Trainer.clock = time.process_time
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    WATCH_OPTIONS["budget"]["max_overhead"] = args.max_overhead
    base, ids, labels = build_model(args.quick, arch, str(device))
    n_modules = sum(1 for _ in base.named_modules())
    print(f"model: {arch}-shaped, {n_modules} modules, batch {tuple(ids.shape)}, device {device}, "
          f"autocast {autocast}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.clock} clock",
          file=sys.stderr)
    result = {"model": arch, "model_modules": n_modules, "batch": list(ids.shape), "device": str(device),
              "autocast": str(autocast), "threads": torch.get_num_threads(), "clock": args.clock,
              "rounds": args.rounds, "schedule": args.schedule}
    if args.schedule == "bracketed":
        copies = Copies(base, ids, labels, names, autocast, args.scrape_interval)
        copies.warm_up(args.warmup)
        try:
            result["variants"] = run_bracketed(copies.steps, args.rounds, settle=gc.collect)
        finally:
            copies.close()
        del copies
    variants = make_variants(base, ids, labels, names, autocast, args.scrape_interval)
    if args.schedule == "segments":
        for run in variants.values():
            run(args.warmup)
        result["steps_per_round"] = args.steps
        result["variants"] = run_rounds(variants, args.rounds, args.steps)
    else:  # the shared copy the attribution and the counts use: a fresh copy's first steps are
        variants["unwatched"](max(args.warmup, 2))  # slower (optimizer state, allocator growth)
    for entry in result["variants"].values():
        entry["median_interval_90"] = list(median_interval(entry["ratios"]))
    if args.attribute_steps > 0 and device.type == "cpu":  # on CUDA the hooks only launch the work
        result["attributed"] = attribute(variants, names, args.attribute_steps, args.scrape_interval)
    print_bars(result["variants"], result.get("attributed", {}))
    if not args.no_counts:
        result["counts"] = probe_counts(variants, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
