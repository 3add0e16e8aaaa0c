"""The pre-norm transformer block stack the compiled-step benchmark times and the compiled-frame
tests watch: LayerNorm, causal attention through Linear layers, a GELU MLP, residuals, a final
LayerNorm and a Linear head. One definition for both, so the tests watch the model the
benchmark measures."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2, self.mlp = nn.LayerNorm(d), Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Stack(nn.Module):
    """`n_blocks` pre-norm blocks of width `d` with `heads` attention heads."""

    def __init__(self, n_blocks: int = 3, d: int = 16, heads: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n_blocks))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class MlpBlock(nn.Module):
    """A pre-norm MLP block alone (no attention): the MLP-heavy shape."""

    def __init__(self, d: int):
        super().__init__()
        self.ln, self.mlp = nn.LayerNorm(d), Mlp(d)

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class MlpStack(nn.Module):
    """`n_blocks` MLP blocks of width `d`, a final LayerNorm and a Linear head, under a root of
    its own (`mlp_stack(..., sequential=True)`: the same modules under an nn.Sequential)."""

    def __init__(self, n_blocks: int = 3, d: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(MlpBlock(d) for _ in range(n_blocks))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def mlp_stack(n_blocks: int, d: int, sequential: bool = False) -> nn.Module:
    if sequential:
        return nn.Sequential(*(MlpBlock(d) for _ in range(n_blocks)), nn.LayerNorm(d), nn.Linear(d, d))
    return MlpStack(n_blocks, d)
