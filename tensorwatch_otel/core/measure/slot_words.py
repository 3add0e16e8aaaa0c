"""What the device kernels write into a buffer's slots, and what the words mean after the read:
a tensor's two words (its abs min and abs max), its counts row with target dtypes (`CountLayout`),
their decoding (`decode_words`), the host words a read copies them into (`HostWords`) and the
decoded reads that slot codes still look up (`KeptReads`).

Each measured tensor gets a slot of two int32s: the abs min and abs max as sign-cleared float32
bit patterns (with the sign bit clear, the integer order of the patterns is the order of the
magnitudes, subnormals, inf, and NaN above inf included). Both are kept with atomic max: the abs
max as the pattern, the abs min as 0x7FFFFFFF minus the pattern, so a zeroed slot is the neutral
start of both and the buffer is reset with one fill.

With target_dtypes (core/measure/magnitude.py) a tensor's slot is wider: after its two words come
its counts row (a `CountLayout`: how many elements fall in each range of sign-cleared patterns,
and, for 8-bit targets, how many the scaled cast flushes), int32 words counted by atomic add in
the same read, or, for the 8-bit targets, in a second launch over the same tensors once the abs
max is in the slot (that threshold needs it); the counts come back in the same one copy per batch.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import torch

from .device_path import KERNEL_DTYPES

#: reads whose values slot codes can still look up (KeptReads): a cached weight's code is reused
#: until the weights are measured again (at the latest every 32 batches)
KEPT_READS = 64
#: the reads within which a cached slot code is used again (the rest of KEPT_READS: the reads a
#: frame's own record may still make before it reads back); an older one is measured again
FRESH_READS = 48
_MASK = 0x7FFFFFFF  # the sign-cleared pattern's largest value; also the abs-min slot's complement base
#: the sign-cleared pattern of inf: an abs max word at least this is inf or NaN
INF_BITS = 0x7F800000


class CountLayout:
    """What the kernels count per tensor for one tuple of target dtypes (made by
    magnitude.Plan.device_layout, the same counts as its row): `width` words after the slot's
    two, in the Plan's column order. `ranges` maps each kernel dtype to its (lo, hi) float32
    patterns, inclusive, one pair per direct column (the first: the non-zero finite elements);
    `scaled` holds a (fmax, bound) pair per 8-bit target, whose column follows the ranges'
    (see _device_kernel.scaled_underflow_slots). `words` is the slot's whole length, two words
    a slot unit (even, so slots stay aligned to the pair layout)."""

    __slots__ = ("width", "ranges", "scaled", "words", "ranges_p2", "scaled_p2", "_args")

    def __init__(self, ranges: Dict[torch.dtype, List[Tuple[int, int]]], scaled: List[Tuple[float, float]]) -> None:
        counts = {len(r) for r in ranges.values()}
        assert len(counts) == 1 and set(ranges) == KERNEL_DTYPES
        n_ranges = counts.pop()
        self.ranges = ranges
        self.scaled = scaled
        self.width = n_ranges + len(scaled)
        self.words = 2 + self.width + (self.width & 1)
        self.ranges_p2 = _pow2(n_ranges)
        self.scaled_p2 = _pow2(len(scaled))
        self._args: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    def args(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """The kernels' (ranges, scaled) tensors on `device` (int32 and float64), made once per
        device: a warm launch allocates nothing."""
        a = self._args.get(device)
        if a is None:
            rows: List[int] = []
            for dt in (torch.float32, torch.float16, torch.bfloat16):  # the kernel's row order
                pairs = self.ranges[dt] + [(1, 0)] * (self.ranges_p2 - len(self.ranges[dt]))
                rows += [v for p in pairs for v in p]
            scaled = self.scaled + [(1.0, -1.0)] * (self.scaled_p2 - len(self.scaled))
            a = (torch.tensor(rows, dtype=torch.int32, device=device),
                 torch.tensor([v for p in scaled for v in p], dtype=torch.float64, device=device))
            self._args[device] = a
        return a


def _pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1) (tl.arange's lengths)."""
    p = 1
    while p < n:
        p *= 2
    return p


def decode_words(words: torch.Tensor) -> torch.Tensor:
    """The float values of a 1-d int32 CPU tensor of (abs-min complement, abs-max pattern)
    pairs, in torch ops: a float64 tensor of (abs min, abs max) pairs, NaN in both when the abs
    max is NaN (the contract of stats.measure)."""
    pairs = words.view(-1, 2)
    hi = pairs[:, 1]
    lo = torch.where(hi > INF_BITS, hi, _MASK - pairs[:, 0])
    return torch.stack([lo, hi], dim=1).view(torch.float32).to(torch.float64).view(-1)


class HostWords:
    """The host end of a buffer's one copy per read: int32 words (pinned for a CUDA buffer, so
    the copy is asynchronous) and, on CUDA, the event the read waits on."""

    __slots__ = ("event", "_pinned", "_words")

    def __init__(self, cuda: bool) -> None:
        self._pinned = cuda
        self._words = torch.empty(0, dtype=torch.int32)
        self.event: Optional[torch.cuda.Event] = torch.cuda.Event() if cuda else None

    def resize(self, n: int) -> None:
        """New words, `n` of them (the buffer's slots grew)."""
        self._words = torch.empty(n, dtype=torch.int32, pin_memory=self._pinned)

    def first(self, n: int) -> torch.Tensor:
        """The first `n` words, made anew (at least twice as many) when there are fewer."""
        words = self._words
        if words.numel() < n:
            words = self._words = torch.empty(max(n, 2 * words.numel()), dtype=torch.int32,
                                              pin_memory=self._pinned)
        return words[:n]


class KeptReads:
    """A buffer's last KEPT_READS reads, by read number, for the slot codes given before each
    (SlotBuffer.take_one): the decoded values (a float64 tensor: abs min, abs max of slot i at
    2i, 2i + 1) and the slots whose values were lost (`changed`: written in place before their
    deferred launch)."""

    __slots__ = ("_reads", "_lost")

    def __init__(self) -> None:
        self._reads: Dict[int, Tuple[torch.Tensor, Set[int]]] = {}
        self._lost: Set[int] = set()  # of the read to come

    def lose(self, slot: int) -> None:
        """Slot `slot`'s value at the read to come is lost."""
        self._lost.add(slot)

    def keep(self, epoch: int, decoded: torch.Tensor) -> None:
        """Read number `epoch`'s decoded values, with the slots lost since the previous read; the
        read KEPT_READS before it is dropped."""
        reads = self._reads
        reads[epoch] = (decoded, self._lost)
        reads.pop(epoch - KEPT_READS, None)
        self._lost = set()

    def get(self, epoch: int) -> Optional[Tuple[torch.Tensor, Set[int]]]:
        """Read number `epoch`'s values and lost slots; None when it is no longer kept."""
        return self._reads.get(epoch)
