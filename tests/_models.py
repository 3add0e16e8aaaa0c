"""Tiny real transformers models built from configs (random weights, fixed seeds) and a helper
that injects a real fp16 overflow, for the side-by-side tests against transformers.debug_utils;
and TwoLinear, the two-layer model of the gradient and optimizer-step tests.

Nothing here downloads anything: every model comes from a config small enough for 2 CPU cores.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional, Tuple

import torch

VOCAB = 64
SEQ = 8
BATCH = 2
FP16_MAX = 65504.0


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                     eos_token_id=1)
    return GPT2LMHeadModel(cfg)


def _bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertModel(cfg)


BUILDERS: Dict[str, Callable[[], torch.nn.Module]] = {"t5": _t5, "gpt2": _gpt2, "bert": _bert}

# A Linear/Conv1D early enough that the overflow is the first non-finite value of the batch,
# and not behind one of T5's fp16 clamps (those act on the block's hidden states afterwards).
OVERFLOW_AT = {
    "t5": "encoder.block.0.layer.1.DenseReluDense.wi",
    "gpt2": "transformer.h.0.mlp.c_fc",
    "bert": "encoder.layer.0.intermediate.dense",
}


def build(arch: str, dtype: torch.dtype = torch.float16, seed: int = 0) -> torch.nn.Module:
    """A fresh tiny model of `arch` in `dtype`, eval mode (no dropout randomness), eager attention
    so every attention module shows up as a frame the same way on every torch build."""
    torch.manual_seed(seed)
    model = BUILDERS[arch]()
    model.config._attn_implementation = "eager"
    return model.to(dtype).eval()


def twins(arch: str, dtype: torch.dtype = torch.float16, seed: int = 0) -> Tuple[torch.nn.Module, torch.nn.Module]:
    """Two identical copies (deepcopy before anything is attached: the peer's hooks stay forever)."""
    a = build(arch, dtype, seed)
    return a, copy.deepcopy(a)


def batches(arch: str, n: int, seed: int = 1) -> List[dict]:
    """`n` keyword-argument batches for `arch` (HF models are called with keyword inputs only)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        kw = {"input_ids": ids}
        if arch == "t5":
            kw["decoder_input_ids"] = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        if arch == "bert":
            kw["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
        out.append(kw)
    return out


def inject_overflow(model: torch.nn.Module, path: str, peak: float = 6.0e4) -> None:
    """Scale the weight of module `path` in place so its largest entry is `peak` (finite in fp16):
    the module's matmul then sums several such terms and its output exceeds 65504 (inf)."""
    w = model.get_submodule(path).weight
    with torch.no_grad():
        w.mul_(peak / w.abs().max().float().item())


def run(model: torch.nn.Module, arch: str, n: int, inject_before: Optional[int] = None,
        inject_path: Optional[str] = None, seed: int = 1) -> int:
    """Run `n` forwards; before batch `inject_before`, inject an overflow. Returns batches run.
    Exceptions propagate (the caller compares them)."""
    done = 0
    for i, kw in enumerate(batches(arch, n, seed)):
        if i == inject_before:
            inject_overflow(model, inject_path or OVERFLOW_AT[arch])
        with torch.no_grad():
            model(**kw)
        done += 1
    return done


class KeywordOnly(torch.nn.Module):
    """A wrapper whose forward takes keyword-only inputs and returns a tensor (not a ModelOutput),
    so the root frame shows no input lines and a measured output."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *, input_ids: torch.Tensor, **kw) -> torch.Tensor:
        out = self.inner(input_ids=input_ids, **kw)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


class LogLogits(torch.nn.Module):
    """Root that returns log(logits): NaN appears first in the root's own output (negative
    logits), the case where the peer reports a batch number one too high."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, **kw) -> torch.Tensor:
        return torch.log(self.inner(input_ids=input_ids, **kw).logits)


class TwoLinear(torch.nn.Module):
    """Linear(8, 16), relu, Linear(16, 4): modules `a` and `b`."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))
