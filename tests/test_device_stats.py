"""The device path's fused kernel and slot buffer (core/device_stats.py), run on CPU tensors
with Triton's interpreter: exact abs min/max against torch on every dtype it reads and on the
edge values, one launch per call, the buffer reused batch to batch.

TRITON_INTERPRET=1 as tests/_interpreted.py sets it (before Triton is imported); skipped where
Triton is not installed."""

from __future__ import annotations

import math
import os

from _interpreted import INTERPRETED, REASON  # first: before Triton is imported
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the fused device kernel cannot be tested")
pytestmark = pytest.mark.skipif(not INTERPRETED, reason=REASON)

from tensorwatch_otel.core import device_stats  # noqa: E402


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = device_stats._BLOCK_INTERPRETED


@pytest.fixture
def stats():
    device_stats.force_on_cpu(True)
    try:
        yield device_stats.DeviceStats()
    finally:
        device_stats.force_on_cpu(False)


def _expected(t):
    """(abs min, abs max) by torch in float64 (exact for these dtypes); NaN anywhere: both NaN."""
    a = t.detach().double().abs()
    if torch.isnan(a).any():
        return math.nan, math.nan
    return a.min().item(), a.max().item()


def _measure(stats, tensors):
    frame = stats.frame()
    assert all(frame.add(t) for t in tensors)
    slots = frame.launch()
    slots[0].buffer.read()  # the read-back of the batch
    return [(s.lo, s.hi) for s in slots]


def _same(got, want):
    return all((math.isnan(g) and math.isnan(w)) or g == w for g, w in zip(got, want))


def _edge_values(dtype):
    fi = torch.finfo(dtype)
    return [0.0, -0.0, fi.tiny, -fi.tiny, fi.tiny / 4, fi.smallest_normal * 2 ** -(fi.bits // 4),
            fi.max, -fi.max, 1.0, -3.5]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_edge_values_exact(stats, dtype):
    base = torch.tensor(_edge_values(dtype), dtype=dtype)
    cases = {
        "edges": base,
        "negative zero only": torch.tensor([-0.0, -0.0], dtype=dtype),
        "one element": torch.tensor([-2.5], dtype=dtype),
        "subnormals only": torch.tensor([torch.finfo(dtype).tiny / 8, -torch.finfo(dtype).tiny / 2], dtype=dtype),
        "+inf": torch.cat([base, torch.tensor([math.inf], dtype=dtype)]),
        "-inf": torch.cat([base, torch.tensor([-math.inf], dtype=dtype)]),
        "nan": torch.cat([base, torch.tensor([math.nan], dtype=dtype)]),
        "-nan": torch.cat([base, -torch.tensor([math.nan], dtype=dtype)]),
        "inf and nan": torch.tensor([math.inf, 1.0, math.nan], dtype=dtype),
    }
    got = _measure(stats, list(cases.values()))
    for (name, t), g in zip(cases.items(), got):
        assert _same(g, _expected(t)), (name, g, _expected(t))
    assert math.isnan(got[6][0]) and math.isnan(got[6][1])  # NaN anywhere: both NaN
    assert got[4] == (0.0, math.inf)
    assert got[2] == (2.5, 2.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sizes_offsets_and_mixed_launches_exact(stats, dtype):
    g = torch.Generator().manual_seed(7)
    sizes = (1, 7, BLOCK - 1, BLOCK + 3, 5 * BLOCK + 11)
    ts = [(torch.randn(n, generator=g) * 100).to(dtype) for n in sizes]
    big = (torch.randn(3 * BLOCK + 17, generator=g) * 1e3).to(dtype)
    ts.append(big[5:])  # a storage offset
    ts.append(big[: 2 * BLOCK].view(2, BLOCK)[1])  # a row of a matrix (offset BLOCK)
    ts.append(torch.randn(4, 33, generator=g).to(dtype).t().contiguous())
    ts[2][BLOCK - 2] = 0.0  # the abs min is the last block's last element
    got = _measure(stats, ts)
    assert [g for g in got] == [_expected(t) for t in ts]


def test_many_dtypes_and_more_tensors_than_one_launch(stats, monkeypatch):
    launches = []
    real = device_stats.launch
    monkeypatch.setattr(device_stats, "launch", lambda *a: (launches.append(len(a[2])), real(*a))[1])
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(50 + i, generator=g).to(DTYPES[i % 3]) * (i + 1) for i in range(device_stats.MAX_TENSORS + 3)]
    got = _measure(stats, ts)
    assert got == [_expected(t) for t in ts]
    assert launches == [device_stats.MAX_TENSORS, 3]


def test_odd_tensors_are_not_taken(stats):
    frame = stats.frame()
    x = torch.randn(4, 6)
    odd = [x.t(), torch.randn(3, dtype=torch.float64), torch.empty(0), torch.ones(3, dtype=torch.int64),
           torch.ones(2, dtype=torch.bool), torch.empty(3, device="meta"), x.to_sparse()]
    if hasattr(torch, "float8_e4m3fn"):
        odd.append(torch.randn(4).to(torch.float8_e4m3fn))
    assert [frame.add(t) for t in odd] == [False] * len(odd)
    assert frame.launch() == []


def test_the_slot_buffer_is_reused_and_grows_geometrically(stats):
    xs = [torch.full((3,), float(i + 1)) for i in range(device_stats.INITIAL_SLOTS + 5)]
    frame = stats.frame()
    first = []
    for x in xs[:10]:
        frame.add(x)
        first += frame.launch()
    buf = first[0].buffer
    slots_before = buf.slots
    for x in xs[10:]:  # past the capacity in the same batch: one growth, earlier slots kept
        frame.add(x)
        first += frame.launch()
    assert buf.capacity == 2 * device_stats.INITIAL_SLOTS and buf.slots is not slots_before
    buf.read()
    assert [(s.lo, s.hi) for s in first] == [(float(i + 1), float(i + 1)) for i in range(len(xs))]
    assert buf.used == 0 and not buf.slots.any()  # reset at the read
    grown = buf.slots
    for _ in range(3):  # later batches: the same buffer, nothing grown
        frame.add(xs[0])
        s, = frame.launch()
        buf.read()
        assert (s.lo, s.hi) == (1.0, 1.0)
    assert buf.slots is grown


def test_a_record_reads_each_device_buffer_once_per_batch(stats, monkeypatch):
    from tensorwatch_otel.core.record import Record

    reads = []
    real = device_stats.SlotBuffer.read
    monkeypatch.setattr(device_stats.SlotBuffer, "read",
                        lambda self, extra=None: (reads.append((self.used, extra)), real(self, extra))[1])
    frame = stats.frame()
    rec = Record(0)
    for i in range(5):
        frame.add(torch.full((4,), -float(i)))
        s, = frame.launch()
        rec.stats += (s, s)
    rec.stats += (0.5, 2.0)  # a float from the CPU kernel among them
    big = 2 ** 53 - 1  # an integer tensor's statistics (0-d float64 tensors, stats.measure)
    rec.stats += (torch.tensor(3.0, dtype=torch.float64), torch.tensor(float(big), dtype=torch.float64))
    rec.stats += (torch.tensor(0.25, dtype=torch.float16), torch.tensor(1e-40))  # odd tensors' 0-d results
    scale = rec.readback(torch.tensor(1024.0))  # the loss scale rides along
    assert rec.host == [v for i in range(5) for v in (float(i), float(i))] + [0.5, 2.0, 3.0, float(big), 0.25,
                                                                              torch.tensor(1e-40).item()]
    assert scale == 1024.0
    (used, extra), = reads  # one read: the slots, and the 0-d tensors in the same copy
    assert used == 5 and extra.dtype == torch.float64 and extra.numel() == 5


_AOT = r"""
import json, os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tensorwatch_otel.core._device_kernel import build
sig = {"slots": "*i32", "xs": ("*fp32", "*bf16", "*fp16"), "ns": ("i64", "i32", "i32"), "first": "i32",
       "programs": "i32", "BLOCK": "constexpr"}
out = {}
for arch in (80, 90):
    c = triton.compile(ASTSource(build(), sig, constexprs={"BLOCK": 2048}), target=GPUTarget("cuda", arch, 32))
    ptx = c.asm["ptx"]
    out[arch] = {"cvt": sorted(set(re.findall(r"cvt\.[a-z0-9.]+", ptx))), "atom": len(re.findall(r"atom\.", ptx)),
                 "cubin": len(c.asm["cubin"])}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_kernel_compiles_for_cuda_without_a_gpu():
    """The same kernel through Triton's CUDA compiler (sm_80 and sm_90, no device needed): it is
    valid Triton for the real backend, not only for the interpreter; fp16 widens without
    flushing subnormals (no .ftz), and each of the three tensors has its two atomics."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no CUDA backend")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("Triton's CUDA backend has no ptxas here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch, r in result.items():
        assert "cvt.f32.f16" in r["cvt"] and not any(".ftz" in c for c in r["cvt"]), (arch, r)
        assert r["atom"] == 6 and r["cubin"] > 0, (arch, r)


def test_the_mode_is_checked_and_force_needs_the_interpreter(monkeypatch):
    with pytest.raises(ValueError, match="auto, force, off"):
        device_stats.set_mode("on")
    try:
        device_stats.set_mode("off")
        assert not device_stats.wanted() and not device_stats.DeviceStats().cpu
        device_stats.set_mode("force")
        assert device_stats.wanted() and device_stats.DeviceStats().cpu
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # forced, but Triton would compile for a GPU
        assert not device_stats.wanted() and not device_stats.DeviceStats().cpu
    finally:
        device_stats.set_mode("auto")
