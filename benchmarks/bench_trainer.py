"""Step-time overhead of TensorwatchCallback on a real transformers Trainer, side by side in one
process: copies of the same GPT-2-shaped model trained by one Trainer per variant (unwatched,
with the callback, ...), each in its own thread, taking turns step by step (never two at once).
A step is timed from `on_step_begin` to `on_step_end` (forward, backward, optimizer step).

Prints, per variant, the ratio of its median step time to the unwatched Trainer's of the same
round (median, min and max over rounds).

    python benchmarks/bench_trainer.py               # the figures (a few minutes on 2 cores)
    python benchmarks/bench_trainer.py --quick       # a tiny model, seconds (smoke test)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import threading
import time
from typing import Dict, List

import torch



def build_model(quick: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    if quick:
        cfg = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                         eos_token_id=0)
        shape = (4, 32)
    else:  # ~100 modules, d_model 256, 6 layers, batch 8x128
        cfg = GPT2Config(vocab_size=8192, n_positions=128, n_embd=256, n_layer=6, n_head=8, bos_token_id=0,
                         eos_token_id=0)
        shape = (8, 128)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg), cfg.vocab_size, shape


class Turns:
    """Lock-step turns for the Trainers' threads: a step starts only on its Trainer's turn and
    once every other Trainer is parked at its next step start (or done), so no two steps, and
    no step and another Trainer's between-step bookkeeping, ever overlap."""

    def __init__(self, sequence: List[str]):
        self.sequence = sequence
        self.turn = 0
        self.parked: set = set()
        self.done: set = set()
        self.cond = threading.Condition()

    def _others_quiet(self, name: str, names) -> bool:
        return all(n == name or n in self.parked or n in self.done for n in names)

    def start(self, name: str, names) -> None:
        with self.cond:
            self.parked.add(name)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn < len(self.sequence) and self.sequence[self.turn] == name
                               and self._others_quiet(name, names))
            self.parked.discard(name)

    def end(self) -> None:
        with self.cond:
            self.turn += 1
            self.cond.notify_all()

    def finish(self, name: str) -> None:
        with self.cond:
            self.done.add(name)
            self.cond.notify_all()


def timed_callback(name: str, turns: Turns, names, times: List[float]):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            turns.start(name, names)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self._t0)
            turns.end()

    return StepTimer()


def run_lockstep(base, vocab: int, shape, names: List[str], rounds: int, steps: int, warmup: int,
                 out_dir: str) -> Dict[str, dict]:
    """Each variant's Trainer trains in its own thread; steps take turns one by one (who goes
    first rotates pair by pair). Per round, the ratio of a variant's median step to the
    unwatched one's; median, min and max over rounds."""
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from tensorwatch_otel.integrations.transformers import TensorwatchCallback

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (64, shape[1]), generator=g)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    options = {"unwatched": None, "watch": {}, "gradients": {"gradients": True},
               "sampled": {"every_n_batches": 10}}
    names = ["unwatched"] + names
    n_steps = warmup + rounds * steps
    sequence: List[str] = []
    for i in range(n_steps):
        k = i % len(names)
        sequence += names[k:] + names[:k]
    turns = Turns(sequence)
    times: Dict[str, List[float]] = {n: [] for n in names}
    trainers = {}
    for name in names:
        callbacks = [timed_callback(name, turns, names, times[name])]
        if options[name] is not None:
            callbacks.append(TensorwatchCallback(sinks=[], on_detect="report", **options[name]))
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=shape[0], report_to="none",
                                 save_strategy="no", use_cpu=True, disable_tqdm=True, logging_strategy="no",
                                 dataloader_num_workers=0, max_steps=n_steps, seed=0)
        trainers[name] = Trainer(model=copy.deepcopy(base), args=args, train_dataset=dataset, callbacks=callbacks)
        trainers[name].remove_callback(PrinterCallback)  # no metrics dict printed at the end

    errors: List[BaseException] = []

    def train(name):
        try:
            trainers[name].train()
        except BaseException as exc:  # reported after the join
            errors.append(exc)
        finally:
            turns.finish(name)

    threads = [threading.Thread(target=train, args=(n,), name=f"bench-{n}") for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    per_round: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        seg = {n: times[n][warmup + r * steps: warmup + (r + 1) * steps] for n in names}
        medians = {n: statistics.median(seg[n]) for n in names}
        for n in names:
            per_round[n].append(medians[n] / medians["unwatched"])
        print(f"round {r + 1}/{rounds}: " + "  ".join(f"{n} {medians[n] * 1000:.0f} ms" for n in names),
              file=sys.stderr)
    out: Dict[str, dict] = {}
    print(f"\n{'variant':<13} {'ratio median':>12} {'min':>7} {'max':>7} {'step ms (median)':>17}")
    for n in names:
        ratios = per_round[n]
        timed = times[n][warmup:]
        out[n] = {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                  "ratios": ratios, "step_ms_median": statistics.median(timed) * 1000}
        print(f"{n:<13} {out[n]['ratio_median']:>12.3f} {min(ratios):>7.3f} {max(ratios):>7.3f} "
              f"{out[n]['step_ms_median']:>17.0f}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model (smoke test)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant per round (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    p.add_argument("--variants", default="watch", help="comma list of watch,gradients,sampled (default watch)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    bad = [n for n in names if n not in ("watch", "gradients", "sampled")]
    if bad:
        p.error(f"--variants: unknown {', '.join(bad)} (valid: watch, gradients, sampled)")
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    base, vocab, shape = build_model(args.quick)
    n_modules = sum(1 for _ in base.named_modules())
    print(f"model: GPT-2-shaped, {n_modules} modules, batch {shape}, transformers Trainer, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
    with tempfile.TemporaryDirectory() as out_dir:
        result = {"model_modules": n_modules, "batch": list(shape), "rounds": args.rounds,
                  "steps_per_round": args.steps,
                  "variants": run_lockstep(base, vocab, shape, names, args.rounds, args.steps, args.warmup,
                                           out_dir)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
