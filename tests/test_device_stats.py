"""The device path's fused kernel and slot buffer (core/measure/device_stats.py, slot_buffer.py), run on CPU
tensors with Triton's interpreter: exact abs min/max against torch on every dtype it reads and on the
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

from tensorwatch_otel.core.measure import device_launch, device_path, device_stats, slot_buffer  # noqa: E402


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = device_launch.BLOCK_INTERPRETED


@pytest.fixture
def stats():
    device_path.force_on_cpu(True)
    try:
        yield device_stats.DeviceStats()
    finally:
        device_path.force_on_cpu(False)


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
    real = slot_buffer.launch
    monkeypatch.setattr(slot_buffer, "launch", lambda *a: (launches.append(len(a[2])), real(*a))[1])
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(50 + i, generator=g).to(DTYPES[i % 3]) * (i + 1) for i in range(device_launch.MAX_TENSORS + 3)]
    got = _measure(stats, ts)
    assert got == [_expected(t) for t in ts]
    assert launches == [device_launch.MAX_TENSORS, 3]


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
    xs = [torch.full((3,), float(i + 1)) for i in range(slot_buffer.INITIAL_SLOTS + 5)]
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
    assert buf.capacity == 2 * slot_buffer.INITIAL_SLOTS and buf.slots is not slots_before
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
    from tensorwatch_otel.core.frame_draft import FrameDraft, ModuleInfo
    from tensorwatch_otel.core.record import Record

    reads = []
    real = slot_buffer.SlotBuffer.read
    monkeypatch.setattr(slot_buffer.SlotBuffer, "read",
                        lambda self, extra=None: (reads.append((self.used, extra)), real(self, extra))[1])
    frame = stats.frame()
    rec = Record(0)
    d = FrameDraft()
    for i in range(5):
        frame.add(torch.full((4,), -float(i)))
        s, = frame.launch()
        d.add(f"t{i}", (s, s), torch.float32)
    d.add("cpu", (0.5, 2.0), torch.float32)  # a float from the CPU kernel among them
    big = 2 ** 53 - 1  # an integer tensor's statistics (0-d float64 tensors, stats.measure)
    d.add("int", (torch.tensor(3.0, dtype=torch.float64), torch.tensor(float(big), dtype=torch.float64)), torch.int64)
    d.add("odd", (torch.tensor(0.25, dtype=torch.float16), torch.tensor(1e-40)), torch.float16)  # odd tensors' 0-d
    rec.add_frame(ModuleInfo("m", torch.nn.Identity(), True, True), d)
    scale = rec.readback(torch.tensor(1024.0))  # the loss scale rides along
    mins, maxs = rec.host_extremes()
    assert [v for pair in zip(mins.tolist(), maxs.tolist()) for v in pair] == \
        [v for i in range(5) for v in (float(i), float(i))] + [0.5, 2.0, 3.0, float(big), 0.25,
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
from tensorwatch_otel.core.measure._device_kernel import build
minmax, scaled, table = build()
head = {"slots": "*i32", "xs": ("*fp32", "*bf16", "*fp16"), "ns": ("i64", "i32", "i32"), "first": "i32",
        "programs": "i32"}
plain = dict(head, ranges="*i32", BLOCK="constexpr", STRIDE="constexpr", RANGES="constexpr", RANGES_P2="constexpr")
second = dict(head, scaled="*fp64", BLOCK="constexpr", STRIDE="constexpr", COLUMN="constexpr", SCALED="constexpr",
              SCALED_P2="constexpr")
variants = {
    "plain": (minmax, plain, {"BLOCK": 2048, "STRIDE": 2, "RANGES": 0, "RANGES_P2": 1}),
    "counts": (minmax, plain, {"BLOCK": 2048, "STRIDE": 10, "RANGES": 5, "RANGES_P2": 8}),
    "scaled": (scaled, second, {"BLOCK": 2048, "STRIDE": 10, "COLUMN": 7, "SCALED": 2, "SCALED_P2": 2}),
    "table": (table, {"slots": "*i32", "table": "*i64", "BLOCK": "constexpr"}, {"BLOCK": 2048}),
}
out = {}
for arch in (80, 90):
    for name, (fn, sig, constexprs) in variants.items():
        c = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", arch, 32))
        ptx = c.asm["ptx"]
        out[f"{arch}/{name}"] = {"cvt": sorted(set(re.findall(r"cvt\.[a-z0-9.]+", ptx))),
                                 "atom": len(re.findall(r"atom\.", ptx)),
                                 "f64": sorted(set(re.findall(r"(?:div|rcp|mul|fma|add)\.[a-z0-9.]*f64", ptx))),
                                 "cubin": len(c.asm["cubin"])}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_kernel_compiles_for_cuda_without_a_gpu():
    """The same kernels through Triton's CUDA compiler (sm_80 and sm_90, no device needed): they
    are valid Triton for the real backend, not only for the interpreter; fp16 widens without
    flushing subnormals (no .ftz), and each of the three tensors has its two atomics (and its
    atomic add of the counts with target_dtypes; the table kernel, one tensor a program row,
    its two). The scaled-underflow pass's float64
    arithmetic is IEEE: a correctly rounded division and plain multiplies (no fma, no
    approximate reciprocal), as torch's ops on the host compute them."""
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
    for key, r in result.items():
        assert "cvt.f32.f16" in r["cvt"] and not any(".ftz" in c for c in r["cvt"]), (key, r)
        assert r["cubin"] > 0, (key, r)
        name = key.split("/")[1]
        assert r["atom"] == {"plain": 6, "counts": 9, "scaled": 3, "table": 2}[name], (key, r)
        assert r["f64"] == ([] if name != "scaled" else ["div.rn.f64", "mul.f64"]), (key, r)


def test_the_mode_is_checked_and_force_needs_the_interpreter(monkeypatch):
    with pytest.raises(ValueError, match="auto, force, off"):
        device_path.set_mode("on")
    try:
        device_path.set_mode("off")
        assert not device_path.wanted() and not device_stats.DeviceStats().cpu
        device_path.set_mode("force")
        assert device_path.wanted() and device_stats.DeviceStats().cpu
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # forced, but Triton would compile for a GPU
        assert not device_path.wanted() and not device_stats.DeviceStats().cpu
    finally:
        device_path.set_mode("auto")


# ---------------------------------------------------------------------------- target_dtypes
# The counts rows the kernels give with a CountLayout (core/measure/magnitude.py Plan.device_layout)
# against the torch ops' rows (magnitude.counts_torch, the route a device tensor takes without
# the device path) on the same tensors: equal as integers, column by column.

TARGET_SETS = (("float16",), ("float8_e4m3fn",), ("bfloat16", "float8_e5m2"),
               ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
               ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                "float8_e5m2fnuz"))


def _counted(stats, plan, tensors):
    """(abs min, abs max, counts row) of each tensor from the device path, after the read."""
    frame = stats.frame()
    assert all(frame.add(t, counted=True) for t in tensors)
    slots = frame.launch(plan.device_layout())
    slots[0].buffer.read()
    return [(s.lo, s.hi, list(s.counts)) for s in slots]


def _torch_counted(plan, t):
    """The same by the torch ops: abs min/max, and counts_torch with that abs max."""
    from tensorwatch_otel.core.measure import magnitude, stats

    mn, mx = stats.abs_minmax_torch_cpu(t)
    return float(mn), float(mx), [int(c) for c in magnitude.counts_torch(t, mx, plan).tolist()]


def _same_counted(got, want):
    return len(got) == len(want) and all(_same(g[:2], w[:2]) and g[2] == w[2] for g, w in zip(got, want))


def _around_thresholds(plan, dtype):
    """Values of `dtype` on and next to every direct threshold of `plan` (patterns -2..+2 of
    each range's ends), both signs, with zeros, subnormals, the max, inf and nan elsewhere."""
    from tensorwatch_otel.core.measure import magnitude

    inf = magnitude._INF_BITS[dtype]
    pairs, _ = plan.ranges(dtype)
    edges = [b for a, w in pairs for b in (a, a + w - 1) if w > 0]
    pats = sorted({b + d for b in edges for d in (-2, -1, 0, 1, 2) if 0 < b + d < inf})
    v = torch.tensor(pats, dtype=magnitude._INT[dtype]).view(dtype)
    return torch.cat([v, -v, torch.tensor(_edge_values(dtype), dtype=dtype)])


def _scaled_edges(plan, dtype):
    """Tensors whose abs max puts a scaled target's threshold on one of their patterns: for
    several abs maxima, the patterns -2..+2 around amax * Y / fmax (the threshold moves with
    amax), and the abs max itself."""
    from tensorwatch_otel.core.measure import magnitude

    out = []
    for amax in (1.0, 3.0, 0.7, 448.0 * 3, 1e-3, 57344.0 * 0.3):
        a = torch.tensor([amax], dtype=dtype)
        a_bits = int(a.view(magnitude._INT[dtype])[0])
        for j, y in zip(plan.scaled, plan.flush_y):
            guess = float(a.double()[0]) * y / plan.fmax[j]
            g = int(torch.tensor([guess], dtype=dtype).view(magnitude._INT[dtype])[0])
            pats = sorted({g + d for d in (-2, -1, 0, 1, 2) if 0 < g + d < a_bits} | {a_bits})
            v = torch.tensor(pats, dtype=magnitude._INT[dtype]).view(dtype)
            out.append(torch.cat([v, -v, torch.zeros(2, dtype=dtype)]))
    return out


@pytest.mark.parametrize("targets", TARGET_SETS, ids=lambda t: "+".join(t))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_counts_equal_the_torch_ops_counts(stats, dtype, targets):
    """Exact on every edge: zeros of both signs, subnormals, the max, the patterns on and next
    to each direct threshold, the scaled thresholds for several abs maxima, tensors holding
    inf or nan (the scaled counts then follow the torch ops' arithmetic: an infinite abs max
    scales by 0, a NaN one counts nothing), all-zero and subnormal-only tensors (abs max 0,
    and one that scales by a huge factor), one element, several blocks."""
    from tensorwatch_otel.core.measure import magnitude

    plan = magnitude.plan_for(targets)
    fi = torch.finfo(dtype)
    edges = _around_thresholds(plan, dtype)
    g = torch.Generator().manual_seed(5)
    spread = torch.randn(2 * BLOCK + 3, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-30 if dtype is torch.float16 else -140, 16, (2 * BLOCK + 3,), generator=g).double())
    spread[::7] = 0.0
    cases = [
        edges,
        torch.cat([edges, torch.tensor([math.inf], dtype=dtype)]),
        torch.cat([edges, torch.tensor([-math.nan], dtype=dtype)]),
        torch.zeros(5, dtype=dtype),
        torch.tensor([-0.0], dtype=dtype),
        torch.tensor([fi.smallest_normal * fi.eps * 3, -fi.smallest_normal * fi.eps], dtype=dtype),
        torch.tensor([fi.max, -fi.max, fi.tiny], dtype=dtype),
        spread.to(dtype),
    ] + _scaled_edges(plan, dtype)
    got = _counted(stats, plan, cases)
    want = [_torch_counted(plan, t) for t in cases]
    for i, (g_, w) in enumerate(zip(got, want)):
        assert _same_counted([g_], [w]), (i, g_, w)


def test_counts_of_many_mixed_tensors_in_one_frame(stats, monkeypatch):
    """More tensors than one launch takes, of the three dtypes, each with its own wide slot:
    every row lands in its own tensor's slot (two launches per MAX_TENSORS with an 8-bit
    target), and the buffer's next batch starts from zeroed counts."""
    from tensorwatch_otel.core.measure import magnitude

    launches = []
    real, real_scaled = slot_buffer.launch, slot_buffer.launch_scaled
    monkeypatch.setattr(slot_buffer, "launch", lambda *a: (launches.append(("minmax", len(a[2]))), real(*a))[1])
    monkeypatch.setattr(slot_buffer, "launch_scaled",
                        lambda *a: (launches.append(("scaled", len(a[2]))), real_scaled(*a))[1])
    plan = magnitude.plan_for(("float16", "float8_e4m3fn", "bfloat16"))
    g = torch.Generator().manual_seed(11)
    ts = [(torch.randn(40 + 3 * i, generator=g) * 10.0 ** (i % 9 - 4)).to(DTYPES[i % 3])
          for i in range(device_launch.MAX_TENSORS + 3)]
    want = [_torch_counted(plan, t) for t in ts]
    for _ in range(2):  # two batches on the same buffer
        assert _same_counted(_counted(stats, plan, ts), want)
    n = device_launch.MAX_TENSORS
    assert launches == [("minmax", n), ("scaled", n), ("minmax", 3), ("scaled", 3)] * 2


def test_counted_and_plain_slots_share_a_buffer(stats):
    """Plain slots and counted (wider) ones issued in one batch: each reads back its own values."""
    from tensorwatch_otel.core.measure import magnitude

    plan = magnitude.plan_for(("float16", "float8_e5m2"))
    frame = stats.frame()
    a, b, c = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1e-8, 7e4]), torch.tensor([-3.0, 0.25])
    frame.add(a)
    (sa,) = frame.launch()
    frame.add(b, counted=True)
    (sb,) = frame.launch(plan.device_layout())
    frame.add(c)
    (sc,) = frame.launch()
    sa.buffer.read()
    assert (sa.lo, sa.hi, sa.counts) == (1.0, 2.0, ())
    assert (sb.lo, sb.hi, list(sb.counts)) == _torch_counted(plan, b)
    assert (sc.lo, sc.hi, sc.counts) == (0.25, 3.0, ())


def test_too_many_elements_to_count_are_not_taken_for_counting(stats, monkeypatch):
    monkeypatch.setattr(device_stats, "MAX_COUNTED", 10)
    frame = stats.frame()
    assert not frame.add(torch.ones(10), counted=True)
    assert frame.add(torch.ones(9), counted=True) and frame.add(torch.ones(10))
