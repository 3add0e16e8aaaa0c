"""A real transformers Trainer for the integration tests: a tiny GPT-2 built from a config (no
downloads), a tiny in-memory token dataset, CPU arguments, and a probe that poisons a weight."""

from __future__ import annotations

import math

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from _hooks import remaining_hooks

VOCAB = 64
BAD = "transformer.h.1.mlp.c_fc"  # the module whose weight a test sets to inf


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, 8), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def trainer_for(model, tmp_path, callbacks=(), eval_dataset=None, **args) -> Trainer:
    defaults = dict(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=4,
                    per_device_eval_batch_size=4, report_to="none", save_strategy="no", use_cpu=True,
                    disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0, seed=0)
    defaults.update(args)
    return Trainer(model=model, args=TrainingArguments(**defaults), train_dataset=Tokens(32),
                   eval_dataset=eval_dataset, callbacks=list(callbacks))


class Probe(TrainerCallback):
    """Records, at each step end, how many hooks the model carries; sets a weight to inf when
    told (at the end of step `poison_after`, or at the beginning of step `poison_at`)."""

    def __init__(self, poison_at=None, poison_after=None):
        self.poison_at = poison_at
        self.poison_after = poison_after
        self.hooks_during = []

    def _poison(self, model):
        with torch.no_grad():  # an in-place write the watcher sees (the version counter moves)
            model.get_submodule(BAD).weight.fill_(math.inf)

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step == self.poison_at:
            self._poison(model)

    def on_step_end(self, args, state, control, model=None, **kw):
        self.hooks_during.append(sum(remaining_hooks(model).values()))
        if state.global_step == self.poison_after:
            self._poison(model)
