"""The per-tensor statistics (core/measure/stats.py): abs min and abs max are exact element values, NaN
anywhere makes both NaN, an infinity shows in abs max, whatever path (size, dtype, sign,
layout) the measurement takes. The accelerator path is exercised here on CPU tensors."""

from __future__ import annotations

import functools
import logging
import math
import shutil

import pytest
import torch

from tensorwatch_otel.core.measure import cpu_kernel, cpu_kernel_build, stats
from tensorwatch_otel.core.frame_stats import NOTE_EMPTY, NOTE_NO_DATA
from tensorwatch_otel.core.measure.stats import measure

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# below the small-tensor cut, one chunk, several chunks with a ragged tail
SIZES = (1, 7, 1000, stats._SMALL + 1, stats._CHUNK - 1, 3 * stats._CHUNK + 5)


def _paths():
    """Every way measure() may reduce a plain tensor, each callable on CPU tensors."""
    return [pytest.param(measure, id="measure"),  # the compiled kernel on CPU where it builds
            pytest.param(lambda x: stats.abs_minmax_torch_cpu(x), id="torch_cpu_path"),
            pytest.param(lambda x: stats._abs_minmax_device(x), id="device_path")]


def _host(pair):
    mn, mx = pair
    assert mn.dim() == 0 and mx.dim() == 0
    return mn.item(), mx.item()


def _expected(x: torch.Tensor):
    a = x.double().abs()
    return a.min().item(), a.max().item()


def _values(dtype, n, sign=0, seed=0):
    """n values spread over many binades (so rounding would show), of the given sign (0: both):
    a tensor of the caller's own (the tests write into it)."""
    return _values_made(dtype, n, sign, seed).clone()


@functools.lru_cache(maxsize=8)
def _values_made(dtype, n, sign, seed):
    """(made once per worker: drawing 3M values took most of this file's time; the measuring
    paths under test were a tenth of it)"""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(-12, 12, generator=g))
    s = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1 if sign == 0 else torch.full((n,), float(sign),
                                                                                               dtype=torch.float64)
    return (mag * s).to(dtype)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sign", (0, 1, -1), ids=("mixed", "positive", "negative"))
def test_exact_element_values(path, dtype, n, sign):
    x = _values(dtype, n, sign, seed=n)
    mn, mx = path(x)
    assert mn.dtype in (dtype, torch.float32, torch.float64) and mx.dtype == mn.dtype
    assert _host((mn, mx)) == _expected(x)
    # the extremes are element values: they sit in the tensor itself
    assert bool((x.abs() == mn.to(dtype)).any()) and bool((x.abs() == mx.to(dtype)).any())


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_nan_anywhere_makes_both_nan(path, dtype, n):
    where = sorted({0, n // 2, n - 1, min(n - 1, stats._CHUNK), min(n - 1, 2 * stats._CHUNK + 3)})
    for sign in (0, 1, -1):
        for i in where:
            x = _values(dtype, n, sign, seed=n)
            x[i] = float("nan")
            mn, mx = _host(path(x))
            assert math.isnan(mn) and math.isnan(mx), (sign, i)
            x[i] = float("inf")  # NaN elsewhere still wins over inf
            x[(i + 1) % n] = float("nan")
            mn, mx = _host(path(x))
            assert math.isnan(mx) and (math.isnan(mn) or n == 1), (sign, i)


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", SIZES[1:])
def test_inf_shows_in_abs_max(path, dtype, n):
    for sign in (0, 1, -1):
        for inf in (float("inf"), float("-inf")):
            x = _values(dtype, n, sign, seed=3)
            x[n // 3] = inf
            mn, mx = _host(path(x))
            assert mx == math.inf
            assert mn == _expected(x)[0] and math.isfinite(mn)
    x = torch.full((n,), float("-inf"), dtype=dtype)
    assert _host(path(x)) == (math.inf, math.inf)


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_signed_zero_and_subnormals(path, dtype):
    tiny = torch.finfo(dtype).smallest_normal / 4  # a subnormal: no flush to zero on the way
    x = torch.tensor([3.0, -tiny, 2.0, -5.0], dtype=dtype)
    assert _host(path(x)) == _expected(x) and _expected(x)[0] > 0
    x = torch.tensor([-0.0, 1.0, -2.0], dtype=dtype)
    mn, mx = _host(path(x))
    assert (mn, mx) == (0.0, 2.0) and math.copysign(1.0, mn) == 1.0
    x = torch.tensor([-0.0, -0.0], dtype=dtype)
    assert math.copysign(1.0, _host(path(x))[0]) == 1.0


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_finite_extremes_of_the_dtype(path, dtype):
    fi = torch.finfo(dtype)
    x = torch.tensor([fi.max, -fi.max, fi.smallest_normal, -1.0], dtype=dtype)
    assert _host(path(x)) == (float(fi.smallest_normal), float(fi.max))


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("make", [
    lambda x: x.view(64, -1).t(),             # transposed
    lambda x: x[::3],                         # strided
    lambda x: x.view(64, -1)[:, 5:],          # rows with a gap
    lambda x: x.view(64, -1).expand(2, 64, -1),  # zero stride
], ids=("transposed", "strided", "gapped", "expanded"))
def test_non_contiguous(path, make):
    for dtype in (torch.float32, torch.bfloat16):
        base = _values(dtype, 64 * 4099, seed=5)
        x = make(base)
        assert not x.is_contiguous()
        assert _host(path(x)) == _expected(x)
        base[-1] = float("nan")  # the last element is in every view
        assert all(math.isnan(v) for v in _host(path(make(base))))


@pytest.mark.parametrize("shape, perm", [
    ((100, 64), (1, 0)),                 # small: one fresh |x|
    ((1024, 512), (1, 0)),               # one chunk
    ((8, 512, 640), (0, 2, 1)),          # several chunks, permuted like attention heads
    ((4, 1, 3, 40000), (3, 1, 0, 2)),    # a size-1 dim among them
], ids=("small", "chunk", "chunks", "size1"))
def test_transposed_and_permuted_tensors_are_read_in_place(shape, perm):
    """A transposed or permuted tensor is dense memory in another order; CPU aminmax would first
    copy it to a contiguous tensor (a tensor-sized allocation, 15-45x the time of the contiguous
    read on 8M elements). Abs min and max do not depend on the order: no copy is made."""
    from torch.profiler import ProfilerActivity, profile

    base = _values(torch.float32, math.prod(shape), seed=7).view(shape)
    x = base.permute(perm)
    assert not x.is_contiguous()
    measure(x)  # the scratch buffer exists before the profiled call
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = _host(measure(x))
    assert got == _expected(x)
    copies = [e.name for e in prof.events() if e.name in ("aten::contiguous", "aten::clone")]
    assert not copies
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    # the small path makes one fresh |x|; the chunked paths reuse their buffer
    assert largest <= (x.numel() * 4 if x.numel() <= stats._SMALL else 4096)
    base.view(-1)[x.numel() // 2] = float("nan")
    assert all(math.isnan(v) for v in _host(measure(x)))


@pytest.mark.parametrize("path", _paths())
def test_zero_dim_and_one_element(path):
    for dtype in FLOATS:
        assert _host(path(torch.tensor(-2.5, dtype=dtype))) == (2.5, 2.5)
        assert all(math.isnan(v) for v in _host(path(torch.tensor(float("nan"), dtype=dtype))))


def test_integers_exact():
    cases = {
        torch.int8: [-128, 3, 0, 127],
        torch.int16: [-32768, 5, -7],
        torch.int32: [-(2 ** 31), 9, 1],
        torch.int64: [2 ** 53, -(2 ** 53) + 1, 3],
        torch.uint8: [255, 4, 200],
    }
    for dtype, vals in cases.items():
        x = torch.tensor(vals, dtype=dtype)
        mn, mx = measure(x)
        assert mn.dtype == torch.float64 and mx.dtype == torch.float64, dtype
        assert (mn.item(), mx.item()) == (min(abs(v) for v in vals), max(abs(v) for v in vals)), dtype
    big = torch.arange(-3 * stats._CHUNK, 5, dtype=torch.int32)
    assert _host(measure(big)) == (0.0, float(3 * stats._CHUNK))


def test_bool_and_complex():
    assert _host(measure(torch.tensor([True, False]))) == (0.0, 1.0)
    z = torch.tensor([3 + 4j, -1j], dtype=torch.complex64)
    assert _host(measure(z)) == (1.0, 5.0)


def test_odd_tensors_keep_their_notes():
    assert measure(torch.empty(0)) == NOTE_EMPTY
    assert measure(torch.empty(3, 0, dtype=torch.bfloat16)) == NOTE_EMPTY
    assert measure(torch.empty(4, device="meta")) == NOTE_NO_DATA
    sp = torch.tensor([[0.0, -3.0], [2.0, 0.0]]).to_sparse()
    assert _host(measure(sp)) == (0.0, 3.0)  # implicit zeros take part
    if hasattr(torch, "float8_e4m3fn"):
        f8 = torch.tensor([1.5, -448.0]).to(torch.float8_e4m3fn)
        assert _host(measure(f8)) == (1.5, 448.0)


@pytest.mark.parametrize("n", (10, 3 * stats._CHUNK + 1))
def test_parameters_with_grad_enabled(n):
    """Callers measure under no_grad; a parameter measured outside it still gives exact values."""
    p = torch.nn.Parameter(_values(torch.float32, n, seed=9))
    with torch.enable_grad():
        mn, mx = measure(p)
    assert (mn.item(), mx.item()) == _expected(p.detach())


def test_results_stack_exactly_for_readback():
    """Record.readback stacks every pair of a batch into one tensor: mixed dtypes must not round."""
    xs = [_values(torch.bfloat16, 100, seed=1), _values(torch.float16, 100, seed=2),
          _values(torch.float32, 100, seed=3), torch.tensor([2 ** 53, 1], dtype=torch.int64)]
    pairs = [measure(x) for x in xs]
    host = torch.stack([s for p in pairs for s in p]).tolist()
    assert host == [v for x in xs for v in _expected(x)]


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("n", (5, 3 * stats._CHUNK + 5))
def test_nan_of_any_sign_and_payload(path, n):
    """NaN bit patterns with the sign bit set, signalling NaNs, the largest payload."""
    patterns = {torch.float32: (torch.int32, (-0x400000, 0x7F800001, 0x7FFFFFFF, -1)),
                torch.float16: (torch.int16, (-0x200, 0x7C01, 0x7FFF, -1)),
                torch.bfloat16: (torch.int16, (-0x40, 0x7F81, 0x7FFF, -1)),
                torch.float64: (torch.int64, (-(2 ** 51), 0x7FF0000000000001, -1))}
    for dtype, (bits, values) in patterns.items():
        for pat in values:
            x = _values(dtype, n, seed=n)
            x.view(bits)[n // 2] = pat
            assert math.isnan(x[n // 2].item())
            mn, mx = _host(path(x))
            assert math.isnan(mn) and math.isnan(mx), (dtype, hex(pat))


# -- the compiled CPU kernel (core/measure/cpu_kernel.py) --------------------------------------------------

def test_the_kernel_is_built_where_a_compiler_exists():
    """On a machine with a C compiler (this one, CI) measure() reads CPU tensors with the
    compiled kernel, on torch's OpenMP threads where torch runs on libgomp; the kernel is what
    the other tests of this file exercise through `measure`."""
    if not cpu_kernel_build.find_compiler():
        pytest.skip("no C compiler on this machine: the torch path is the one in use")
    kernel = cpu_kernel.KERNEL.wait()  # built on a thread of its own (tests/test_kernel_build.py)
    assert kernel is not None
    assert kernel.parallel == (cpu_kernel_build.loaded_libgomp() is not None)
    x = _values(torch.float32, 3 * stats._CHUNK + 5, seed=11)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pair = measure(x)
    assert _host(pair) == _expected(x)
    ops = {e.name for e in prof.events()}
    assert not ops & {"aten::abs", "aten::aminmax", "aten::amax", "aten::amin"}, ops  # one read, ours


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_kernel_without_openmp_and_with_many_threads_agree(dtype, tmp_path):
    """The one-thread build (a compiler without OpenMP) and the parallel one give the torch
    path's exact values, NaN and inf included, at every thread count."""
    cc = cpu_kernel_build.find_compiler()
    if not cc:
        pytest.skip("no C compiler on this machine")
    library, _ = cpu_kernel_build.compile_library(cc, str(tmp_path), None)
    single = cpu_kernel._bind(__import__("ctypes").CDLL(library), parallel=False)
    kernels = [single] + ([cpu_kernel.KERNEL.wait()] if cpu_kernel.KERNEL.wait() is not None else [])
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            for n in (1, 5, (1 << 16) + 3, 3 * stats._CHUNK + 5):
                x = _values(dtype, n, seed=n + nt)
                want = _host(stats.abs_minmax_torch_cpu(x))
                for k in kernels:
                    assert _host(k(x)) == want == _expected(x)
                    y = x.clone()
                    y[n - 1] = float("-inf")
                    assert _host(k(y))[1] == math.inf and _host(k(y))[0] == _expected(y)[0]
                    y[n // 2] = float("nan")  # the x86 default NaN has its sign bit set
                    y[n // 2] = -y[n // 2].abs()
                    assert all(math.isnan(v) for v in _host(k(y)))
    finally:
        torch.set_num_threads(threads)


def test_no_compiler_falls_back_to_torch_ops_said_once(caplog):
    """Without a compiler (or with one that fails) the statistics are the torch path's, and the
    log says so once, at info level: the run is watched exactly, only slower."""
    with caplog.at_level(logging.INFO, logger="tensorwatch_otel.core.measure.cpu_kernel"):
        assert cpu_kernel.build(cc="/nonexistent/cc") is None
        assert cpu_kernel.build(cc=shutil.which("false") or "/bin/false") is None
    said = [r for r in caplog.records if r.name == "tensorwatch_otel.core.measure.cpu_kernel"]
    assert len(said) == 2 and all(r.levelno == logging.INFO for r in said)
    assert "/nonexistent/cc" in said[0].getMessage() and "torch ops" in said[0].getMessage()
    loader = cpu_kernel._Loader()
    loader.reset(None, done=True)  # what a failed build leaves
    assert loader.get() is None
    saved = cpu_kernel.KERNEL.wait()
    cpu_kernel.KERNEL.reset(None, done=True)
    try:
        x = _values(torch.bfloat16, 3 * stats._CHUNK + 5, seed=2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            assert _host(measure(x)) == _expected(x)
        assert "aten::abs" in {e.name for e in prof.events()}  # the torch ops did it
    finally:
        cpu_kernel.KERNEL.reset(saved, done=True)


@pytest.mark.parametrize("raw, mode", [(None, "native"), ("torch", "torch"), (" Native ", "native")])
def test_cpu_kernel_variable(raw, mode, monkeypatch):
    from tensorwatch_otel.core import env as twenv
    environ = {} if raw is None else {twenv.ENV_CPU_KERNEL: raw}
    assert twenv.cpu_kernel_mode(environ) == mode
    monkeypatch.setenv(twenv.ENV_CPU_KERNEL, "torch")
    loader = cpu_kernel._Loader()
    assert loader.get() is None  # read at the first request: no build at all


def test_a_bad_cpu_kernel_value_fails_watch_naming_the_variable(monkeypatch):
    import tensorwatch_otel as tw
    from tensorwatch_otel.core.env import ConfigError
    monkeypatch.setenv("TENSORWATCH_CPU_KERNEL", "fast")
    with pytest.raises(ConfigError, match="TENSORWATCH_CPU_KERNEL='fast': expected one of native, torch"):
        tw.watch(torch.nn.Linear(2, 2), sinks=[])
