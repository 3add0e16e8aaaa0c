"""Precision headroom (target_dtypes): the underflow/overflow shares and the magnitude histogram of
every measured tensor, checked against an independent oracle: torch's own casts of the same tensor."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch import nn

from _collect import Collect
from tensorwatch_otel import watch
from tensorwatch_otel.core.measure import magnitude as M
from tensorwatch_otel.core.config import WatchConfig
from tensorwatch_otel.core.measure.cpu_kernel import KERNEL
from tensorwatch_otel.core.env import ENV_TARGET_DTYPES, ConfigError
from tensorwatch_otel.core.frame_stats import Magnitude
from tensorwatch_otel.core.frame_draft import FrameDraft, ModuleInfo
from tensorwatch_otel.core.record import Record

TARGETS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
INPUTS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def oracle(x: torch.Tensor, target: str):
    """(underflow, overflow) shares by casting: 8-bit targets scaled by fmax / amax first."""
    dt = getattr(torch, target)
    x = x.double()
    ok = torch.isfinite(x) & (x != 0)
    n = int(ok.sum())
    if n == 0:
        return 0.0, 0.0
    fmax = torch.finfo(dt).max
    if dt.itemsize <= 1:
        amax = x.abs().max()
        y = (x * (fmax / amax)).float()
    else:
        y = x
    cast = y.to(dt).double()
    under = int(((cast == 0) & ok).sum())
    over = int((ok & (y.abs() > fmax)).sum())
    return under / n, over / n


def kernel_paths():
    """The one-call CPU kernel and the torch ops (the CUDA path and the CPU fallback)."""
    kernel = KERNEL.wait(120)

    def torch_ops(t, plan, hist):
        mn, mx = M.stats.abs_minmax_torch_cpu(t)
        return mn, mx, M.counts_torch(t, mx, plan), M.histogram_torch(t) if hist else None

    paths = [("torch", torch_ops)]
    if kernel is not None:
        assert kernel.counts is not None
        paths.append(("kernel", M.measure_counts))
    return paths


def shares_of(measure, x: torch.Tensor, targets=TARGETS, hist=True):
    rec = Record(0, targets=tuple(targets))
    mn, mx, counts, row = measure(x, rec.precision.plan, hist)
    rec.add_frame(INFO, _draft(mn, mx, x.dtype, counts, row))
    rec.readback()
    return rec


INFO = ModuleInfo("x", nn.Identity(), False, True)


def _draft(mn, mx, dtype, counts, row) -> FrameDraft:
    """One measured tensor with its counts row and histogram row, as the recorder writes it."""
    d = FrameDraft()
    d.add("x", (mn, mx), dtype)
    d.counts.append(counts)
    d.mags.append(row)
    return d


def host_values(rec: Record) -> list:
    """What the record read back: abs min, abs max per measured tensor, in order."""
    return torch.stack(rec.host_extremes(), 1).flatten().tolist()


def near_thresholds(dtype: torch.dtype) -> torch.Tensor:
    """Values each a factor of 2 (or more) away from every threshold of every target, with the
    abs max 1.0 (so fp8 thresholds are tiny/2 * 1/fmax): zeros, subnormals of the input dtype,
    inf/nan, values far above fp16's max where the input dtype holds them."""
    fi = torch.finfo(dtype)
    vals = [0.0, -0.0, 1.0, -0.75, 0.3, 2.0 ** -8, 3 * 2.0 ** -12, 2.0 ** -16, -(2.0 ** -19), 2.0 ** -27,
            2.0 ** -30, float("inf"), float("nan"), -float("inf")]
    vals += [fi.smallest_normal * fi.eps * 4, fi.smallest_normal / 4]  # the input's own subnormals
    if fi.max > 1e6:
        wide = fi.max > 1e40
        vals += [2.0 ** 17, 3e5, 2.0 ** 140 if wide else 2.0 ** 100, 2.0 ** -140 if wide else 2.0 ** -100]
    x = torch.tensor(vals, dtype=torch.float64).to(dtype)
    return x


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_shares_match_casts_a_factor_of_two_from_thresholds(dtype):
    x = near_thresholds(dtype)
    finite = x[torch.isfinite(x)]
    big = finite.double().abs().max()
    for name, measure in kernel_paths():
        for xs in (finite, torch.cat([finite, torch.tensor([float("nan")], dtype=dtype)])):
            rec = shares_of(measure, xs)
            for j, t in enumerate(TARGETS):
                want_u, want_o = oracle(finite, t)
                scaled = getattr(torch, t).itemsize <= 1
                if scaled and not math.isfinite(host_values(rec)[1]):
                    assert math.isnan(rec.underflow[j]) and math.isnan(rec.overflow[j]), (name, t)
                    continue
                assert rec.underflow[j] == pytest.approx(want_u, abs=1e-12), (name, dtype, t, big)
                assert rec.overflow[j] == pytest.approx(want_o, abs=1e-12), (name, dtype, t)


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_inf_nan_elements_are_left_out_of_direct_casts(dtype):
    x = near_thresholds(dtype)
    finite = x[torch.isfinite(x)]
    for name, measure in kernel_paths():
        rec = shares_of(measure, x, ("float16", "bfloat16"))
        for j, t in enumerate(("float16", "bfloat16")):
            want_u, want_o = oracle(finite, t)
            assert rec.underflow[j] == pytest.approx(want_u, abs=1e-12), (name, t)
            assert rec.overflow[j] == pytest.approx(want_o, abs=1e-12), (name, t)
        mag = rec.magnitude(0)
        assert mag.zeros == int((x == 0).sum())
        assert sum(mag.counts) == int((torch.isfinite(x) & (x != 0)).sum())


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_histogram_buckets_are_upper_inclusive_powers_of_two(dtype):
    fi = torch.finfo(dtype)
    sub = fi.smallest_normal * fi.eps
    vals = torch.tensor([1.0, 2.0, 0.5, 1.5, 3.0, 4.0, sub, sub * 3, fi.smallest_normal, 0.0, -2.0],
                        dtype=torch.float64).to(dtype)
    for name, measure in kernel_paths():
        rec = shares_of(measure, vals, ("float16",))
        mag = rec.magnitude(0)
        got = {}
        for i, c in enumerate(mag.counts):
            if c:
                got[mag.offset + i] = c
        want = {}
        for v in vals.double().tolist():
            if v:
                b = math.ceil(math.log2(abs(v))) - 1  # (2**b, 2**(b+1)]
                want[b] = want.get(b, 0) + 1
        assert got == want, (name, dtype)
        assert mag.zeros == 1


def test_all_zero_and_integer_tensors():
    for _name, measure in kernel_paths():
        rec = shares_of(measure, torch.zeros(100))
        assert rec.underflow == [0.0] * 4 and rec.overflow == [0.0] * 4
        assert rec.magnitude(0) == Magnitude(100, 0, ())
    rec = Record(0, targets=TARGETS)
    r = M.measure_counts(torch.arange(10), rec.precision.plan, True)
    assert r[2] is None and r[3] is None
    rec.add_frame(INFO, _draft(r[0], r[1], torch.int64, None, None))
    rec.readback()
    assert len(rec.underflow) == 4 and all(math.isnan(v) for v in rec.underflow + rec.overflow)
    assert rec.magnitude(0) is None


def test_fp8_input_measured_as_float32():
    x = torch.tensor([1.0, 2.0 ** -9, 448.0]).to(torch.float8_e4m3fn)
    plan = M.plan_for(("float16",))
    r = M.measure_counts(x, plan, True)
    assert r[3].numel() == M.row_width(torch.float32)
    assert r[2].tolist() == [3, 0, 0]


ALL_TARGETS = tuple(M.valid_targets())


def random_magnitudes(dtype, n=200_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-30, 14) if dtype is torch.float16 else (-45, 18)  # finite in the input dtype
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(lo, hi, (n,), generator=g).double())
    return x.to(dtype)


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_random_tensor_shares_equal_the_casts_exactly(dtype):
    """Random magnitudes over 60 octaves: each share is exactly the cast's (the counts are)."""
    x = random_magnitudes(dtype)
    x[7] = 0.0
    for name, measure in kernel_paths():
        rec = shares_of(measure, x, ALL_TARGETS, hist=False)
        for j, t in enumerate(ALL_TARGETS):
            want_u, want_o = oracle(x, t)
            assert (rec.underflow[j], rec.overflow[j]) == (want_u, want_o), (name, dtype, t)
        assert rec.magnitude(0) is None


def around(dtype: torch.dtype, bits, amax_bits=None) -> torch.Tensor:
    """The values of `dtype` one pattern either side of each threshold pattern (and on it), both
    signs, with the abs max pattern `amax_bits`."""
    pats = sorted({b + d for b in bits for d in (-2, -1, 0, 1, 2) if 0 < b + d < M._INF_BITS[dtype]})
    if amax_bits is not None:
        pats = [p for p in pats if p <= amax_bits] + [amax_bits]
    v = torch.tensor(pats, dtype=M._INT[dtype]).view(dtype)
    return torch.cat([v, -v])


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
def test_values_on_and_next_to_every_threshold(dtype):
    """Exact at the edges: the patterns next to each direct threshold, and next to each scaled
    threshold for several abs maxima (the thresholds move with amax)."""
    plan = M.plan_for(ALL_TARGETS)
    pairs, _ = plan.ranges(dtype)
    edges = [b for a, w in pairs[1:] for b in (a, a + w - 1)]
    for name, measure in kernel_paths():
        rec = shares_of(measure, around(dtype, edges), ALL_TARGETS, hist=False)
        for j, t in enumerate(ALL_TARGETS):
            if j in plan.direct:
                assert (rec.underflow[j], rec.overflow[j]) == oracle(around(dtype, edges), t), (name, t)
        for e in {b + d for b in edges for d in (-1, 0, 1) if 0 < b + d < M._INF_BITS[dtype]}:
            # a tensor whose smallest or largest non-zero pattern is the edge itself
            for pats in ([e], [e, e + 1 if e + 1 < M._INF_BITS[dtype] else e], [1, e], [0, e]):
                x = torch.tensor(pats, dtype=M._INT[dtype]).view(dtype)
                rec = shares_of(measure, x, ALL_TARGETS, hist=False)
                for j in plan.direct:
                    assert (rec.underflow[j], rec.overflow[j]) == oracle(x, ALL_TARGETS[j]), (name, pats)
        for amax in (1.0, 3.0, 0.7, 448.0 * 3, 1e-3):
            a_bits = int(torch.tensor([amax], dtype=dtype).view(M._INT[dtype])[0])
            for j in plan.scaled:
                fmax, y = plan.fmax[j], plan.flush_y[plan.scaled.index(j)]
                guess = float(torch.tensor([amax], dtype=dtype).double()[0]) * y / fmax
                g_bits = int(torch.tensor([guess], dtype=dtype).view(M._INT[dtype])[0])
                x = around(dtype, [g_bits], a_bits)
                rec = shares_of(measure, x, ALL_TARGETS, hist=False)
                want = oracle(x, ALL_TARGETS[j])
                assert 0 < want[0] < 1 or guess < torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
                assert (rec.underflow[j], rec.overflow[j]) == want, (name, dtype, amax, ALL_TARGETS[j])


@pytest.mark.parametrize("dtype", INPUTS, ids=str)
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_many_blocks_some_crossing_a_threshold(dtype, bad):
    """The kernel counts a range only in the blocks (2048 elements) whose non-zero patterns
    reach it: tiny, huge and zero values in a few blocks of a large tensor, threads on; abs
    min/max and shares stay exact (an inf/nan block: the non-zero finite count by compares)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300_000, generator=g, dtype=torch.float64)
    x[: 100_000].clamp_(min=0)  # zeros in every block of the first third
    x[5 * 2048 + 3] = 2.0 ** -30  # below fp16's flush threshold
    x[40 * 2048 + 9] = -3e-9  # below fp8's scaled ones
    x[41 * 2048 + 1] = 1e-6
    x[70 * 2048 + 100] = 3e5 if dtype is not torch.float16 else 6e4
    x[100 * 2048 + 7] = -4e5 if dtype is not torch.float16 else -6.5e4
    if bad is not None:
        x[120 * 2048 + 11] = bad
    x = x.to(dtype)
    finite = x[torch.isfinite(x)]
    for name, measure in kernel_paths():
        rec = shares_of(measure, x, ALL_TARGETS, hist=False)
        if bad is None:
            assert host_values(rec) == [float(x.abs().min()), float(x.abs().max())], name
        for j, t in enumerate(ALL_TARGETS):
            if bad is not None and t.startswith("float8"):
                assert math.isnan(rec.underflow[j]) and math.isnan(rec.overflow[j]), (name, t)
            else:
                assert (rec.underflow[j], rec.overflow[j]) == oracle(finite, t), (name, dtype, t)


def test_torch_path_with_the_environment(monkeypatch):
    """TENSORWATCH_CPU_KERNEL=torch: the torch-ops path, through measure_counts."""
    KERNEL.reset(None, done=True)
    try:
        x = random_magnitudes(torch.float32, 10_000)
        rec = shares_of(M.measure_counts, x)
        for j, t in enumerate(TARGETS):
            assert (rec.underflow[j], rec.overflow[j]) == oracle(x, t)
        assert sum(rec.magnitude(0).counts) == 10_000
    finally:
        KERNEL.reset()


# ---------------------------------------------------------------------------- options
def test_option_and_variable():
    assert WatchConfig.build(environ={}).target_dtypes == ()
    cfg = WatchConfig.build(target_dtypes=["torch.half", "bfloat16", torch.float8_e4m3fn, "float16"], environ={})
    assert cfg.target_dtypes == ("float16", "bfloat16", "float8_e4m3fn")
    cfg = WatchConfig.build(environ={ENV_TARGET_DTYPES: "float8_e5m2, float16"})
    assert cfg.target_dtypes == ("float8_e5m2", "float16")
    with pytest.raises(ConfigError, match="target_dtypes: 'float9'"):
        WatchConfig.build(target_dtypes=["float9"], environ={})
    with pytest.raises(ValueError, match=ENV_TARGET_DTYPES):
        WatchConfig.build(environ={ENV_TARGET_DTYPES: "float16,int8"})
    with pytest.raises(ConfigError, match="target_dtypes"):
        watch(nn.Linear(2, 2), sinks=[], target_dtypes=["float8_e8m0fnu"])


# ---------------------------------------------------------------------------- frames
class Scale(nn.Module):
    def __init__(self, values):
        super().__init__()
        self.register_buffer("values", values)

    def forward(self, x):
        return self.values * x


def known_tensor():
    """12 non-zero finite values (+ one zero): 3 below fp16's underflow threshold (2**-25), 2
    above its max; 4 below fp8 e4m3's scaled threshold (2**-10 * 2**17 / 448 = 0.29)."""
    v = [2.0 ** -30, 2.0 ** -28, -(2.0 ** -27), 0.01, 0.75, 1.0, 2.0, 4.0, 8.0, -16.0, 2.0 ** 17, 2.0 ** 17, 0.0]
    return torch.tensor(v)


def test_frame_shares_through_watch():
    sink = Collect()
    model = Scale(known_tensor())
    with watch(model, sinks=[sink], target_dtypes=["float16", "bfloat16", "float8_e4m3fn"]):
        model(torch.ones(()))
    [frame] = sink.batches[0].frames
    out = next(t for t in frame.tensors if t.name == "output")
    x = known_tensor()
    for t in ("float16", "bfloat16", "float8_e4m3fn"):
        u, o = oracle(x, t)
        assert out.underflow[t] == pytest.approx(u, abs=1e-12)
        assert out.overflow[t] == pytest.approx(o, abs=1e-12)
    assert out.underflow["float16"] == pytest.approx(3 / 12)
    assert out.overflow["float16"] == pytest.approx(2 / 12)
    assert out.underflow["float8_e4m3fn"] == pytest.approx(4 / 12)
    assert out.overflow["float8_e4m3fn"] == 0.0
    assert out.underflow["bfloat16"] == 0.0
    assert out.magnitude.zeros == 1 and sum(out.magnitude.counts) == 12
    assert pickle.loads(pickle.dumps(out)) == out
    inp = next(t for t in frame.tensors if t.name == "input[0]")
    assert inp.underflow == {"float16": 0.0, "bfloat16": 0.0, "float8_e4m3fn": 0.0}


def test_no_targets_no_fields_and_unsampled_batches_measure_nothing():
    sink = Collect()
    model = Scale(known_tensor())
    with watch(model, sinks=[sink]):
        model(torch.ones(()))
    out = sink.batches[0].frames[0].tensors[-1]
    assert out.underflow is None and out.overflow is None and out.magnitude is None
    sink = Collect()
    with watch(model, sinks=[sink], target_dtypes="float16", every_n_batches=2):
        for _ in range(3):
            model(torch.ones(()))
    assert [b.batch_number for b in sink.batches] == [0, 2]
    assert all(t.underflow is not None for b in sink.batches for t in b.frames[0].tensors)


def test_cached_weights_keep_their_histogram():
    """A weight measured once is reused in the next no-grad batch with its histogram."""
    sink = Collect()
    lin = nn.Linear(4, 4)
    with torch.no_grad(), watch(lin, sinks=[sink], target_dtypes=["float8_e4m3fn"]):
        lin(torch.ones(4))
        lin(torch.ones(4))
    w0, w1 = (next(t for t in b.frames[0].tensors if t.name == "weight") for b in sink.batches)
    assert sum(w0.magnitude.counts) == 16 and w1.magnitude is None  # batch 1: no histogram
    assert w0.underflow == w1.underflow


def test_magnitude_on_the_cadence_batches_only():
    """The histogram on the first watched batch and every HISTOGRAM_EVERY-th watched batch after
    (counted in watched batches: every_n_batches=2 watches 0, 2, 4...); exact shares on all."""
    sink = Collect()
    model = Scale(known_tensor())
    n = 2 * M.HISTOGRAM_EVERY + 2
    with watch(model, sinks=[sink], target_dtypes=["float16", "float8_e4m3fn"], every_n_batches=2):
        for _ in range(2 * n):
            model(torch.ones(()))
    outs = {b.batch_number: b.frames[0].tensors[-1] for b in sink.batches}
    assert sorted(outs) == list(range(0, 2 * n, 2))
    with_hist = [b for b, t in outs.items() if t.magnitude is not None]
    assert with_hist == [0, 2 * M.HISTOGRAM_EVERY, 4 * M.HISTOGRAM_EVERY]
    assert outs[0].magnitude.zeros == 1 and sum(outs[0].magnitude.counts) == 12
    for t in outs.values():
        assert (t.underflow["float16"], t.overflow["float16"]) == (3 / 12, 2 / 12)
        assert (t.underflow["float8_e4m3fn"], t.overflow["float8_e4m3fn"]) == (4 / 12, 0.0)


# ---------------------------------------------------------------------------- where they show
def traced_run(sinks):
    model = Scale(known_tensor())
    with watch(model, sinks=sinks, target_dtypes=["float16", "float8_e4m3fn"], trace_batches=[0],
               on_detect="report"):
        model(torch.ones(()))


def test_jsonl_frames_carry_the_shares_and_read_back(tmp_path):
    from tensorwatch_otel.report.codec import read_events
    from tensorwatch_otel.sinks import JsonlLog

    path = tmp_path / "e.jsonl"
    traced_run([JsonlLog(str(path))])
    import json
    line = json.loads(path.read_text().splitlines()[0])
    out = line["frames"][0]["tensors"][-1]
    assert out["name"] == "output"
    assert out["underflow"] == {"float16": pytest.approx(3 / 12), "float8_e4m3fn": pytest.approx(4 / 12)}
    assert out["overflow"] == {"float16": pytest.approx(2 / 12), "float8_e4m3fn": 0.0}
    [event] = read_events(str(path))
    back = event.frames[0].tensors[-1]
    assert back.underflow == pytest.approx({"float16": 3 / 12, "float8_e4m3fn": 4 / 12})
    assert back.overflow == pytest.approx({"float16": 2 / 12, "float8_e4m3fn": 0.0})


def test_report_text_and_plot_show_the_shares(tmp_path, capsys):
    from tensorwatch_otel.cli import main
    from tensorwatch_otel.sinks import JsonlLog

    path = tmp_path / "e.jsonl"
    traced_run([JsonlLog(str(path))])
    capsys.readouterr()
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if s.endswith("output") or " output " in s)
    assert "underflow float16 25% float8_e4m3fn 33.3%  overflow float16 16.7%" in line, line
    pytest.importorskip("matplotlib")
    svg = tmp_path / "p.svg"
    assert main(["report", str(path), "--plot", str(svg)]) == 0
    text = svg.read_text()
    assert 'id="underflow:float16"' in text and 'id="overflow:float16"' in text
    assert 'id="underflow:float8_e4m3fn"' in text and 'id="overflow:float8_e4m3fn"' not in text


def test_span_frame_events_carry_the_shares():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from tensorwatch_otel.sinks.otel import OtelTelemetry

    spans = InMemorySpanExporter()
    tp = TracerProvider(shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(spans))
    mp = MeterProvider(metric_readers=[InMemoryMetricReader()], shutdown_on_exit=False)
    sink = OtelTelemetry(tp, mp)
    traced_run([sink])
    sink.flush()
    events = [e for s in spans.get_finished_spans() for e in s.events if e.name == "tensorwatch.frame"]
    attrs = events[0].attributes
    names = list(attrs["tensorwatch.tensors"])
    k = names.index("output")
    assert attrs["tensorwatch.underflow.float16"][k] == pytest.approx(3 / 12)
    assert attrs["tensorwatch.overflow.float16"][k] == pytest.approx(2 / 12)
    assert attrs["tensorwatch.underflow.float8_e4m3fn"][k] == pytest.approx(4 / 12)
    assert len(attrs["tensorwatch.underflow.float16"]) == len(names)


def test_torch_histogram_and_counts_make_no_host_sync():
    """The torch-ops counts and histogram (the CUDA path) read nothing back: no .item(), no bincount."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        syncs = 0
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            if func is torch.ops.aten._local_scalar_dense.default or "nonzero" in func.__name__:
                Count.syncs += 1
            return func(*args, **(kwargs or {}))

    x = near_thresholds(torch.bfloat16)
    plan = M.plan_for(ALL_TARGETS)
    plan.ranges(torch.bfloat16)  # the thresholds: found once per dtype pair, with torch's casts
    with Count():
        row = M.histogram_torch(x)
        counts = M.counts_torch(x, x.abs().max(), plan)
    assert Count.syncs == 0 and row.numel() == M.row_width(torch.bfloat16)
    assert counts.shape == (plan.width,)
    assert not any("bincount" in op or "histc" in op for op in Count.ops)


def test_check_module_reads_back_per_call_with_the_same_shares():
    """check="module" reads back after every module call: the shares of each read are kept in
    order (k * len(targets) + j)."""
    model = nn.Sequential(Scale(known_tensor()), Scale(torch.full((13,), 2.0 ** 20)))
    sinks = {}
    for check in ("batch", "module"):
        sink = Collect()
        with watch(model, sinks=[sink], target_dtypes=["float16", "float8_e4m3fn"], check=check):
            model(torch.ones(()))
        sinks[check] = [(t.name, t.underflow, t.overflow) for f in sink.batches[0].frames for t in f.tensors]
    assert sinks["batch"] == sinks["module"]
    last = sinks["module"][-1]
    assert last[0] == "output" and last[2]["float16"] == pytest.approx(8 / 12)  # 0.75 * 2**20 > 65504


def test_detection_frames_carry_the_shares():
    from tensorwatch_otel import NonFiniteDetected

    bad = known_tensor()
    bad[0] = float("inf")
    model = nn.Sequential(Scale(known_tensor()), Scale(bad))
    with pytest.raises(NonFiniteDetected) as info:
        with watch(model, sinks=[], target_dtypes=["float16", "float8_e4m3fn"]):
            model(torch.ones(()))
    frames = info.value.event.frames
    out = frames[-1].tensors[-1]
    assert out.name == "output" and out.underflow["float16"] == pytest.approx(2 / 11)
    assert math.isnan(out.underflow["float8_e4m3fn"])  # an inf abs max: no scale
    assert frames[0].tensors[-1].underflow["float16"] == pytest.approx(3 / 12)


def test_a_failure_in_the_shares_is_logged_once_and_training_goes_on(monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(M, "shares", broken)
    from tensorwatch_otel.core.process import forget_said
    from tensorwatch_otel.core.precision_rows import SHARES_FAILED

    forget_said(SHARES_FAILED)  # (said by an earlier test of this process, perhaps)
    sink = Collect()
    model = Scale(known_tensor())
    with watch(model, sinks=[sink], target_dtypes=["float16"]):
        model(torch.ones(()))
        model(torch.ones(()))
    assert len(sink.batches) == 2
    assert sum("could not derive the underflow/overflow shares" in r.message for r in caplog.records) == 1
    out = sink.batches[1].frames[0].tensors[-1]
    assert out.abs_max == 2.0 ** 17 and out.underflow is None
