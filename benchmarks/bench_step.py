"""Step-time overhead of the watcher on a T5-shaped training step, side by side in one process.

Prints, per variant, the ratio of its step time to the unwatched step measured in the same
round (median, min and max over rounds), including the peer (transformers.debug_utils).

    python benchmarks/bench_step.py                 # the issue's figures (a few minutes on 2 cores)
    python benchmarks/bench_step.py --quick         # a small model, seconds (smoke test)
    python benchmarks/bench_step.py --variants watch,peer --rounds 7 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import io
import contextlib
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch


def build_model(quick: bool, arch: str = "t5", device: str = "cpu"):
    """(model, input ids, labels). arch "t5": the issue's CPU shape; "gpt2-medium": the GPU one
    (24 layers, d_model 1024, batch 8x512); `quick` shrinks either to seconds on a CPU."""
    if arch == "gpt2-medium":
        return _build_gpt2(quick, device)
    from transformers import T5Config, T5ForConditionalGeneration

    if quick:
        cfg = T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                       num_heads=4, decoder_start_token_id=0, pad_token_id=0)
        shape = (4, 32)
    else:  # the shape: ~190 modules, d_model 256, 4+4 layers, batch 8x128
        cfg = T5Config(vocab_size=32128, d_model=256, d_kv=32, d_ff=1024, num_layers=4, num_decoder_layers=4,
                       num_heads=8, feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0)
        shape = (8, 128)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, cfg.vocab_size, shape, generator=gen)
    labels = torch.randint(1, cfg.vocab_size, shape, generator=gen)
    return model.to(device), ids.to(device), labels.to(device)


def _build_gpt2(quick: bool, device: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    if quick:
        cfg = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)
        shape = (2, 32)
    else:
        cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=24, n_head=16)
        shape = (8, 512)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=gen)
    return model.to(device), ids.to(device), ids.clone().to(device)


class Trainer:
    """A model copy with its own AdamW: one full training step per call. `autocast` (a dtype)
    runs forward and loss under torch.autocast; on CUDA the step is timed to its end."""

    def __init__(self, model, ids, labels, autocast: Optional[torch.dtype] = None):
        self.model = model
        self.ids, self.labels = ids, labels
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.device = ids.device
        self.autocast = autocast

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    #: a callable returning a context manager entered around every step (probes), or None
    step_context: Optional[Callable] = None
    #: the clock steps are timed with: wall time, or the process' CPU time (time.process_time),
    #: which a busy shared machine's preemption does not stretch
    clock: Callable[[], float] = time.perf_counter

    def step(self) -> float:
        if Trainer.step_context is not None:
            with Trainer.step_context():
                return self._step()
        return self._step()

    def _step(self) -> float:
        self._sync()
        clock = Trainer.clock
        t0 = clock()
        if self.autocast is not None:
            with torch.autocast(self.device.type, dtype=self.autocast):
                out = self.model(input_ids=self.ids, labels=self.labels)
        else:
            out = self.model(input_ids=self.ids, labels=self.labels)
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._sync()
        return clock() - t0


# variant -> watch() options (None: not watched by us)
WATCH_OPTIONS = {
    "watch": {},
    "sampled": {"every_n_batches": 10},
    "budget": {"max_overhead": 0.02},  # bench_paired --max-overhead sets it
    "module": {"check": "module"},
    "gradients": {"gradients": True},
    "optimizer_state": {"optimizer_state": True},
    "prometheus": {},  # plus a PrometheusMetrics sink on port 0, scraped (see make_variants)
    "fp8": {"target_dtypes": ["float8_e4m3fn"]},  # precision headroom, one target dtype
    "fp8_fp16_bf16": {"target_dtypes": ["float8_e4m3fn", "float16", "bfloat16"]},
}
VARIANTS = ("watch", "sampled", "budget", "module", "gradients", "optimizer_state", "prometheus", "peer", "null",
            "fp8", "fp8_fp16_bf16")
#: variant -> the interval between measured batches its last watcher ended with (budget: its choice)
INTERVALS: Dict[str, int] = {}


def make_variants(base, ids, labels, names: List[str], autocast: Optional[torch.dtype] = None,
                  scrape_interval: float = 15.0) -> Dict[str, Callable[[int], List[float]]]:
    """name -> run(n_steps) returning step times. Variants that hook share one model copy and
    attach/detach around their segment; the peer cannot detach, so it gets its own copy (same
    weights at the start). "prometheus" keeps one PrometheusMetrics on port 0 for the whole run,
    scraped every `scrape_interval` seconds by a thread (Prometheus' default is 15 s)."""
    import tensorwatch_otel as tw

    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {','.join(unknown)} (choose from {','.join(VARIANTS)})")
    shared = Trainer(copy.deepcopy(base), ids, labels, autocast)
    variants: Dict[str, Callable[[int], List[float]]] = {}

    def plain(n):
        return [shared.step() for _ in range(n)]

    def watched(name, options, sinks=()):
        def run(n):
            with tw.watch(shared.model, sinks=list(sinks), on_detect="report", **options) as w:
                times = [shared.step() for _ in range(n)]
                INTERVALS[name] = w.measure_every_n_batches
                return times
        return run

    variants["unwatched"] = plain
    if "null" in names:  # the unwatched step again, in its own segment: the noise floor
        variants["null"] = lambda n: plain(n)
    for name in names:
        if name == "prometheus":
            variants[name] = watched(name, WATCH_OPTIONS[name], [_prometheus_sink(scrape_interval)])
        elif name in WATCH_OPTIONS:
            variants[name] = watched(name, WATCH_OPTIONS[name])
    if "peer" in names:
        from transformers.debug_utils import DebugUnderflowOverflow

        peer = Trainer(copy.deepcopy(base), ids, labels, autocast)
        DebugUnderflowOverflow(peer.model)

        def run_peer(n):
            with contextlib.redirect_stdout(io.StringIO()):
                return [peer.step() for _ in range(n)]
        variants["peer"] = run_peer
    return variants


PROMETHEUS_SINKS: list = []  # the sinks _prometheus_sink made, newest last (for the scrape cost)


def _prometheus_sink(scrape_interval: float):
    """The always-on set-up: a PrometheusMetrics served on 127.0.0.1 (port 0: any free port),
    scraped by a daemon thread every scrape_interval seconds (0: never)."""
    import threading
    import urllib.request

    from prometheus_client import CollectorRegistry

    from tensorwatch_otel.sinks import PrometheusMetrics

    sink = PrometheusMetrics(port=0, registry=CollectorRegistry(), linger_s=0)
    PROMETHEUS_SINKS.append(sink)
    if scrape_interval > 0 and sink.url:
        def scrape():
            while True:
                time.sleep(scrape_interval)
                try:
                    urllib.request.urlopen(sink.url, timeout=10).read()
                except OSError:
                    return
        threading.Thread(target=scrape, daemon=True, name="bench-scraper").start()
    return sink


def run_rounds(variants: Dict[str, Callable[[int], List[float]]], rounds: int, steps: int) -> Dict[str, dict]:
    """Interleaved rounds; per variant the ratio of its median step to the unwatched one of the
    same round (median, quartiles, min, max over rounds). Prints progress to stderr and a table
    to stdout."""
    per_round: Dict[str, List[float]] = {n: [] for n in variants}
    step_s: Dict[str, List[float]] = {n: [] for n in variants}
    order = list(variants)
    for r in range(rounds):
        medians = {}
        # Rotate the order each round, and drop each segment's first step: switching between
        # model copies (the peer has its own) costs the next step its caches, whoever runs it.
        for name in order[r % len(order):] + order[:r % len(order)]:
            times = variants[name](steps + 1)[1:]
            step_s[name] += times
            medians[name] = statistics.median(times)
        for name in variants:
            per_round[name].append(medians[name] / medians["unwatched"])
        print(f"round {r + 1}/{rounds}: " + "  ".join(
            f"{n} {medians[n] * 1000:.0f} ms" for n in order), file=sys.stderr)
    return summarise(per_round, step_s)


def summarise(per_round: Dict[str, List[float]], step_s: Dict[str, List[float]]) -> Dict[str, dict]:
    """Per variant the median, quartiles, min and max of its per-round ratios, its step times;
    prints them as a table to stdout."""
    out: Dict[str, dict] = {}
    print(f"\n{'variant':<16} {'ratio median':>12} {'q1':>7} {'q3':>7} {'min':>7} {'max':>7} "
          f"{'step ms (median)':>17}")
    for name, ratios in per_round.items():
        med = statistics.median(ratios)
        q1, q3 = quartiles(ratios)
        out[name] = {"ratio_median": med, "ratio_q1": q1, "ratio_q3": q3, "ratio_min": min(ratios),
                     "ratio_max": max(ratios), "ratios": ratios,
                     "step_ms_median": statistics.median(step_s[name]) * 1000,
                     "step_ms": [t * 1000 for t in step_s[name]]}
        print(f"{name:<16} {med:>12.3f} {q1:>7.3f} {q3:>7.3f} {min(ratios):>7.3f} {max(ratios):>7.3f} "
              f"{out[name]['step_ms_median']:>17.0f}")
    return out


def quartiles(values: List[float]) -> Tuple[float, float]:
    """First and third quartiles (inclusive method: they stay within the values)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model (smoke test)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    p.add_argument("--variants", default="watch,sampled,peer",
                   help=f"comma list of {','.join(VARIANTS)} (default watch,sampled,peer)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from tensorwatch_otel.core.measure.cpu_kernel import KERNEL
    KERNEL.wait()  # the CPU kernel is built on a thread of its own: time the kernel, not its build
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    base, ids, labels = build_model(args.quick)
    n_modules = sum(1 for _ in base.named_modules())
    variants = make_variants(base, ids, labels, names)
    print(f"model: T5-shaped, {n_modules} modules, batch {tuple(ids.shape)}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    for run in variants.values():
        run(args.warmup)
    result = {"model_modules": n_modules, "batch": list(ids.shape), "rounds": args.rounds,
              "steps_per_round": args.steps,
              "variants": run_rounds(variants, args.rounds, args.steps)}
    if "peer" in variants and "watch" in variants:
        w, pr = result["variants"]["watch"]["ratio_median"], result["variants"]["peer"]["ratio_median"]
        print(f"\npeer / watch step time: {pr / w:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
