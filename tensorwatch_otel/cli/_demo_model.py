"""The demo's workload: a tiny pre-norm transformer language model (torch only) trained in fp16
mixed precision on synthetic tokens, and the injected overflow."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Tuple

import torch
from torch import nn
from torch.nn import functional as F

#: The module whose fp16 output overflows when an overflow is injected.
OVERFLOW_MODULE = "blocks.1.mlp.fc1"
#: Factor the module's weight is multiplied by (in place, as a runaway optimizer step would):
#: its fp16 output then exceeds 65504, the largest finite float16, and becomes inf.
OVERFLOW_FACTOR = 1.0e5


@dataclass(frozen=True)
class DemoConfig:
    vocab: int = 128
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    d_ff: int = 256
    seq_len: int = 32
    batch_size: int = 8


class Attention(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token and position embeddings, pre-norm blocks, final norm, LM head."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batches(cfg: DemoConfig, seed: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic sequences with structure to learn: each token is a fixed function of the one
    before (plus some noise), so the loss visibly falls within a few steps."""
    gen = torch.Generator().manual_seed(seed + 1)
    table = torch.randperm(cfg.vocab, generator=gen)
    while True:
        ids = torch.empty(cfg.batch_size, cfg.seq_len + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(cfg.vocab, (cfg.batch_size,), generator=gen)
        for i in range(1, cfg.seq_len + 1):
            ids[:, i] = table[ids[:, i - 1]]
        noise = torch.rand(ids.shape, generator=gen) < 0.1
        ids = torch.where(noise, torch.randint(cfg.vocab, ids.shape, generator=gen), ids)
        yield ids[:, :-1], ids[:, 1:]


class Trainer:
    """fp32 master weights, forward under autocast to float16, a GradScaler for the loss: the
    usual fp16 mixed-precision recipe, here on the CPU."""

    def __init__(self, cfg: DemoConfig, seed: int, lr: float = 3e-3):
        torch.manual_seed(seed)
        self.cfg = cfg
        self.model = TinyLM(cfg)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.scaler = _grad_scaler()
        self.data = batches(cfg, seed)

    def step(self) -> float:
        ids, targets = next(self.data)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = self.model(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, self.cfg.vocab), targets.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        return loss.item()

    def inject_overflow(self) -> str:
        """Scale one layer's weight in place so its fp16 activations overflow; returns its path."""
        module = self.model.get_submodule(OVERFLOW_MODULE)
        with torch.no_grad():
            module.weight.mul_(OVERFLOW_FACTOR)
        return OVERFLOW_MODULE


def _grad_scaler():
    """Loss scaling on the CPU (torch >= 2.3); older torch trains without it."""
    try:
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    except (AttributeError, TypeError, RuntimeError):
        return None
