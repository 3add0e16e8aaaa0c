"""Step-time overhead of TensorwatchCallback on a real transformers Trainer, side by side in one
process: the same GPT-2-shaped model (two copies) trained by two Trainers, one with the callback,
taking turns round by round. A step is timed from `on_step_begin` to `on_step_end` (forward,
backward, optimizer step, the Trainer's own bookkeeping).

Prints, per variant, the ratio of its median step time to the unwatched Trainer's of the same
round (median, min and max over rounds).

    python benchmarks/bench_trainer.py               # the figures (a few minutes on 2 cores)
    python benchmarks/bench_trainer.py --quick       # a tiny model, seconds (smoke test)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import run_rounds  # noqa: E402


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


class StepTimer:
    """A TrainerCallback (built lazily: transformers is imported in main) recording step times."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.times: List[float] = []
                self._t0 = 0.0

            def on_step_begin(self, args, state, control, **kw):
                self._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                self.times.append(time.perf_counter() - self._t0)

        return _Timer()


def make_variants(base, vocab: int, shape, names: List[str], out_dir: str) -> Dict[str, Callable[[int], List[float]]]:
    """name -> run(n_steps): one train() of n steps on that variant's Trainer, its step times."""
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from tensorwatch_otel.integrations.transformers import TensorwatchCallback

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (64, shape[1]), generator=g)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    options = {"watch": {}, "gradients": {"gradients": True}, "sampled": {"every_n_batches": 10}}

    def variant(callback_options):
        timer = StepTimer()
        callbacks = [timer]
        if callback_options is not None:
            callbacks.append(TensorwatchCallback(sinks=[], on_detect="report", **callback_options))
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=shape[0], report_to="none",
                                 save_strategy="no", use_cpu=True, disable_tqdm=True, logging_strategy="no",
                                 dataloader_num_workers=0, max_steps=1, seed=0)
        trainer = Trainer(model=copy.deepcopy(base), args=args, train_dataset=dataset, callbacks=callbacks)
        trainer.remove_callback(PrinterCallback)  # no metrics dict printed after each train()

        def run(n: int) -> List[float]:
            trainer.args.max_steps = n
            timer.times.clear()
            trainer.train()
            return list(timer.times)
        return run

    variants = {"unwatched": variant(None)}
    for name in names:
        variants[name] = variant(options[name])
    return variants


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
    with tempfile.TemporaryDirectory() as out_dir:
        variants = make_variants(base, vocab, shape, names, out_dir)
        print(f"model: GPT-2-shaped, {n_modules} modules, batch {shape}, transformers Trainer, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
        for run in variants.values():
            run(args.warmup)
        result = {"model_modules": n_modules, "batch": list(shape), "rounds": args.rounds,
                  "steps_per_round": args.steps, "variants": run_rounds(variants, args.rounds, args.steps)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
