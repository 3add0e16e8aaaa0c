"""Helpers for the exporter tests: hand-built frames and batches, tiny real models, a small
Prometheus text parser, and a side-by-side step timer."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from tensorwatch_otel.core.events import NonFiniteEvent
from tensorwatch_otel.core.frame_stats import BatchStats, Frame, TensorStat

FP16_MAX = 65504.0


def stat(name: str, lo, hi, dtype: str = "float16", note: str = "") -> TensorStat:
    ru = None
    if hi is not None and dtype.startswith("float"):
        ru = hi / (FP16_MAX if dtype == "float16" else 3.4028234663852886e38)
    return TensorStat(name, lo, hi, dtype if hi is not None else "", note, ru)


def frame(module: str, cls: str, *tensors: TensorStat, batch: int = 0, start: bool = False) -> Frame:
    return Frame(module, cls, tuple(tensors), batch, start)


def linear_frames(n: int, batch: int = 0, bad_at: int = -1) -> Tuple[Frame, ...]:
    """n Linear frames `layers.i` with weight/bias/input[0]/output; `bad_at` gets an inf output."""
    out = []
    for i in range(n):
        hi = float("inf") if i == bad_at else float(i + 1)
        out.append(frame(f"layers.{i}", "Linear", stat("weight", 0.001 * (i + 1), 0.5 + i),
                         stat("bias", 0.0, 0.25), stat("input[0]", 0.0, float(i)),
                         stat("output", 0.0, hi), batch=batch, start=(i == 0)))
    return tuple(out)


def detection(frames: Tuple[Frame, ...], batch: int = 0, rank: int = 0) -> NonFiniteEvent:
    last = frames[-1]
    first = last.first_nonfinite()
    return NonFiniteEvent(batch, rank, last.module, last.module_class, first.name if first else "output",
                          last.kind or "inf", frames, time.time())


def batch(frames: Tuple[Frame, ...], number: int = 0, rank: int = 0) -> BatchStats:
    return BatchStats(number, rank, time.time(), frames)


# ---------------------------------------------------------------- prometheus text
def parse_prom(text: str) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """{(name, sorted label pairs): value} from the text exposition format."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(parsed, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    if key not in parsed:
        names = sorted({k for k in parsed if k[0] == name})
        raise AssertionError(f"no sample {key}; have {names[:10]}")
    return parsed[key]


# ---------------------------------------------------------------- tiny real models
class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.ff = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + torch.relu(self.ff(x)))


class TinyNet(nn.Module):
    """Two blocks and a head; `scale` multiplies the input so a test can overflow fp16 on cue."""

    def __init__(self, d: int = 16, blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Overflow(nn.Module):
    """Multiplies by `factor` from batch `at` on: an inf in fp32 at a named module."""

    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


class OverflowNet(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.boom = Overflow()
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        return self.out(self.boom(self.inp(x)))


# ---------------------------------------------------------------- timing
def interleaved_medians(a: Callable[[], None], b: Callable[[], None], rounds: int = 60):
    """(median step of a, median step of b, median of the per-round ratios a/b): a and b take
    turns step by step (who goes first alternates), so load from other processes hits both
    alike and each ratio compares two steps taken moments apart."""
    ta: List[float] = []
    tb: List[float] = []
    ratios: List[float] = []
    for f in (a, b):
        for _ in range(3):
            f()
    for i in range(rounds):
        pair = {}
        for name, f in ((("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))):
            t = time.perf_counter()
            f()
            pair[name] = time.perf_counter() - t
        ta.append(pair["a"])
        tb.append(pair["b"])
        ratios.append(pair["a"] / pair["b"])
    return statistics.median(ta), statistics.median(tb), statistics.median(ratios)
