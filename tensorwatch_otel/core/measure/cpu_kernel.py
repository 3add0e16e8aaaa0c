"""A one-read abs min/max kernel for CPU tensors, compiled on first use with the machine's C
compiler (core/measure/cpu_kernel_build.py); without a compiler the torch ops in stats.py are used.

Stock CPU ops cannot take both extremes of |x| in one read: |x| has to be written somewhere and
read again (three passes over memory), and each op pays torch's parallel dispatch. The kernel
reads each element once: it clears the sign bit of the element's bits and keeps the smallest
and the largest pattern, as unsigned integers. With the sign bit clear, the order of the
patterns is the order of the magnitudes (subnormals, inf, and NaN above inf included), so the
two patterns are the exact abs min and abs max, and a NaN anywhere is the largest pattern; the
kernel then makes the minimum NaN too (the contract of stats.measure).

It is built once per process, on a thread of its own (the torch ops measure until it is
loaded: a slow or hanging compiler holds no batch), into a temporary folder removed right after
loading. Where the library links torch's OpenMP runtime the kernel splits large tensors over
torch's threads (`torch.get_num_threads()`). `TENSORWATCH_CPU_KERNEL=torch` keeps the torch ops.
A compiler killed at its timeout leaves the torch ops in place.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import tempfile
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import env as _env
from .cpu_kernel_build import HOST_MODULE, compile_library, find_compiler, kill_running, loaded_libgomp
from .histogram_layout import row_width

log = logging.getLogger(__name__)

EXIT_WAIT_S = 2.0  # most seconds the interpreter's exit waits for the build's thread to end
_PARALLEL_MIN = 1 << 16  # elements below which waking a second thread costs more than it saves

_SYMBOLS = {torch.float64: "tw_abs_minmax_f64", torch.float32: "tw_abs_minmax_f32",
            torch.float16: "tw_abs_minmax_f16", torch.bfloat16: "tw_abs_minmax_bf16"}
CODES = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}  # tw_abs_minmax_many's
_SLAB = 512  # result pairs per allocation

# tensor -> (abs_min, abs_max); a built kernel also has the attributes parallel, parallel_min, host,
# host_call, host_many, magnitude, counts and same_entries (see _bind, build)
Kernel = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


def build(cc: Optional[str] = None) -> Optional[Kernel]:
    """Compile and load the kernel: a function tensor -> (abs_min, abs_max) for contiguous CPU
    float tensors, or None (with one log line saying why) when it cannot be built here."""
    cc = cc or find_compiler()
    if not cc:
        log.info("tensorwatch_otel: no C compiler found (set CC): CPU statistics use torch ops, "
                 "about 2x the time of the compiled kernel")
        return None
    openmp = loaded_libgomp()
    try:
        with tempfile.TemporaryDirectory(prefix="tensorwatch_otel-") as folder:
            try:
                path, with_host = compile_library(cc, folder, openmp)
            except RuntimeError:  # a failed command; a timeout (TimeoutExpired) is not retried
                if not openmp:
                    raise
                openmp = None  # a compiler without OpenMP: one thread
                path, with_host = compile_library(cc, folder, None)
            lib = ctypes.CDLL(path)  # stays mapped once the file is gone
            host = _host_module(path) if with_host else None
    except (OSError, RuntimeError, subprocess.SubprocessError, ValueError) as exc:
        log.info("tensorwatch_otel: could not build the CPU statistics kernel with %s (%s): CPU statistics "
                 "use torch ops, about 2x the time", cc, exc)
        return None
    kernel = _bind(lib, parallel=openmp is not None, host_call=getattr(host, "host", None))
    # same_entries: ParamIndex.current's compare in C (core/frames/param_index.py), None without
    # the extension module
    vars(kernel).update(magnitude=_bind_magnitude(lib, parallel=openmp is not None),
                        counts=_bind_counts(lib, parallel=openmp is not None),
                        same_entries=getattr(host, "same_entries", None))
    return kernel


def _host_module(path: str) -> Optional[object]:
    """The library at `path` loaded as the extension module HOST_MODULE (cpu_kernel_host.c: its
    functions `host` and `same_entries`), or None (said at debug level) when it does not load
    here."""
    try:
        loader = importlib.machinery.ExtensionFileLoader(HOST_MODULE, path)
        spec = importlib.util.spec_from_file_location(HOST_MODULE, path, loader=loader)
        if spec is None:
            return None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except (ImportError, OSError, AttributeError) as exc:
        log.debug("tensorwatch_otel: the kernel's Python functions did not load (%s): its ctypes call is used", exc)
        return None


class _Pair(ctypes.Structure):
    """tw_abs_minmax_one's result: (abs min, abs max) as doubles."""

    _fields_ = (("lo", ctypes.c_double), ("hi", ctypes.c_double))


def _bind(lib: ctypes.CDLL, parallel: bool,
          host_call: Optional[Callable[[int, int, int], Tuple[float, float]]] = None) -> Kernel:
    fns: Dict[torch.dtype, Callable[[int, int, int, int], None]] = {}
    for dt, symbol in _SYMBOLS.items():
        fn = getattr(lib, symbol)
        fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int)
        fn.restype = None
        fns[dt] = fn
    threads = torch.get_num_threads
    local = threading.local()  # per thread: pairs of 0-d result tensors not handed out yet

    def abs_min_max(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """`v`: a contiguous CPU tensor of a float dtype, numel > 0."""
        dt = v.dtype
        pools = getattr(local, "pools", None)
        if pools is None:
            pools = local.pools = {}
        pool = pools.get(dt)
        if not pool:
            pool = pools[dt] = _result_pairs(dt)
        lo, hi, ptr = pool.pop()
        n = v.numel()
        fns[dt](v.data_ptr(), n, ptr, threads() if parallel and n >= _PARALLEL_MIN else 1)
        return lo, hi
    many = lib.tw_abs_minmax_many
    many.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_int, ctypes.c_int64)
    many.restype = None
    one = (ctypes.c_void_p * 1)()
    one_n = (ctypes.c_int64 * 1)()
    one_code = (ctypes.c_int8 * 1)()
    out2 = (ctypes.c_double * 2)()
    addrs = tuple(ctypes.addressof(a) for a in (one, one_n, one_code, out2))
    one_lock = threading.Lock()
    par_min = _PARALLEL_MIN if parallel else 1 << 62

    one_fn = lib.tw_abs_minmax_one
    one_fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)
    one_fn.restype = _Pair

    def one_call(ptr: int, n: int, code: int) -> Tuple[float, float]:
        r = one_fn(ptr, n, code)
        return r.lo, r.hi
    call = host_call or one_call  # (address, elements, dtype code) -> the pair, on this thread

    def host(v: torch.Tensor) -> Tuple[float, float]:
        """(abs_min, abs_max) of `v` (as abs_min_max takes it) as Python floats: the values are
        on the host as soon as the call returns, and no tensor is made for them. A tensor below
        the parallel size in one call on this thread: the extension function where it was built,
        else a ctypes call (the recorder's per-frame call; what each costs: docs/performance.md,
        "Figures behind the code")."""
        n = v.numel()
        if n < par_min:
            return call(v.data_ptr(), n, CODES[v.dtype])
        with one_lock:
            one[0] = v.data_ptr()
            one_n[0] = n
            one_code[0] = CODES[v.dtype]
            many(addrs[0], addrs[1], addrs[2], 1, addrs[3], threads(), par_min)
            return out2[0], out2[1]

    def host_many(ptrs: int, ns: int, codes: int, k: int, out: int) -> None:
        """k tensors in one call: addresses of k pointers (int64), k element counts (int64), k
        dtype codes (int8, CODES) and room for 2k doubles (abs min, abs max per tensor)."""
        many(ptrs, ns, codes, k, out, threads(), par_min)

    # what else the loaded kernel offers, as attributes of the function (read with getattr: a
    # kernel that tests stand in may offer only the call)
    vars(abs_min_max).update(parallel=parallel, parallel_min=par_min, host=host, host_call=call,
                            host_many=host_many)
    return abs_min_max


_MAG_SYMBOLS = {torch.float64: "tw_abs_minmax_mag_f64", torch.float32: "tw_abs_minmax_mag_f32",
                torch.float16: "tw_abs_minmax_mag_f16", torch.bfloat16: "tw_abs_minmax_mag_bf16"}

MagnitudeKernel = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _bind_magnitude(lib: ctypes.CDLL, parallel: bool) -> MagnitudeKernel:
    """tensor -> (abs_min, abs_max, histogram) in one read (core/measure/magnitude.py: the histogram's
    layout, the same as its torch-ops twin)."""
    fns: Dict[torch.dtype, Callable[[int, int, int, int, int], None]] = {}
    for dt, symbol in _MAG_SYMBOLS.items():
        fn = getattr(lib, symbol)
        fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
        fn.restype = None
        fns[dt] = fn
    threads = torch.get_num_threads
    local = threading.local()

    def abs_min_max_magnitude(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`v`: a contiguous CPU tensor of a float dtype, numel > 0."""
        dt = v.dtype
        pools = getattr(local, "pools", None)
        if pools is None:
            pools = local.pools = {}
        pool = pools.get(dt)
        if not pool:
            pool = pools[dt] = _result_triples(dt, row_width(dt))
        lo, hi, ptr, hist, hptr = pool.pop()
        n = v.numel()
        fns[dt](v.data_ptr(), n, ptr, hptr, threads() if parallel and n >= _PARALLEL_MIN else 1)
        return lo, hi, hist
    return abs_min_max_magnitude


_CNT_SYMBOLS = {torch.float64: "tw_abs_minmax_cnt_f64", torch.float32: "tw_abs_minmax_cnt_f32",
                torch.float16: "tw_abs_minmax_cnt_f16", torch.bfloat16: "tw_abs_minmax_cnt_bf16"}
MAX_RANGES = 64  # TW_MAXR: ranges, and scaled targets, one call counts at most

CountsKernel = Callable[[torch.Tensor, int, int, int, int, int], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _bind_counts(lib: ctypes.CDLL, parallel: bool) -> CountsKernel:
    """(tensor, ranges address, ranges, scaled address, scaled, width) -> (abs_min, abs_max,
    counts): the exact threshold counts of core/measure/magnitude.py (`width` = ranges + scaled int64
    counters) in the same call as the extremes."""
    fns: Dict[torch.dtype, Callable[[int, int, int, int, int, int, int, int, int], None]] = {}
    for dt, symbol in _CNT_SYMBOLS.items():
        fn = getattr(lib, symbol)
        fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
        fn.restype = None
        fns[dt] = fn
    threads = torch.get_num_threads
    local = threading.local()

    def abs_min_max_counts(v: torch.Tensor, rg: int, nr: int, sc: int, ns: int,
                           width: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`v`: a contiguous CPU tensor of a float dtype, numel > 0; nr, ns <= MAX_RANGES."""
        dt = v.dtype
        pools = getattr(local, "pools", None)
        if pools is None:
            pools = local.pools = {}
        key = (dt, width)
        pool = pools.get(key)
        if not pool:
            pool = pools[key] = _result_triples(dt, width)
        lo, hi, ptr, row, rptr = pool.pop()
        n = v.numel()
        fns[dt](v.data_ptr(), n, ptr, rg, nr, sc, ns, rptr, threads() if parallel and n >= _PARALLEL_MIN else 1)
        return lo, hi, row
    return abs_min_max_counts


def _result_triples(dtype: torch.dtype, width: int) -> List[Tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, int]]:
    """Like _result_pairs, with a histogram row (int64, `width` counters) each."""
    pairs = _result_pairs(dtype)
    rows = torch.empty((_SLAB, width), dtype=torch.int64)
    views = rows.unbind()
    base, step = rows.data_ptr(), width * rows.element_size()
    return [(lo, hi, ptr, views[i], base + i * step) for i, (lo, hi, ptr) in enumerate(pairs)]


def _result_pairs(dtype: torch.dtype) -> List[Tuple[torch.Tensor, torch.Tensor, int]]:
    """_SLAB (abs_min, abs_max, address) results: 0-d views of one fresh allocation, each pair
    handed out once (a record keeps its pairs), the kernel writing both through the address.
    One allocation and one unbind for _SLAB tensors cost a fifth of a fresh pair each time."""
    slab = torch.empty(2 * _SLAB, dtype=dtype)
    views = slab.unbind()
    base, size = slab.data_ptr(), slab.element_size()
    return [(views[2 * i], views[2 * i + 1], base + 2 * i * size) for i in range(_SLAB - 1, -1, -1)]


class _Loader:
    """The kernel, built on a thread of its own at the first request; None (the torch ops)
    until it is loaded, and for good when it cannot be built."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._kernel: Optional[Kernel] = None
        self._thread: Optional[threading.Thread] = None
        self._finished = threading.Event()

    def get(self) -> Optional[Kernel]:
        """The kernel, or None while it is being built (the build starts at the first call)."""
        if self._done:
            return self._kernel
        if self._thread is None:
            self._start()
        return self.loaded()

    def loaded(self) -> Optional[Kernel]:
        """The kernel if it is loaded; None otherwise (starts no build)."""
        return self._kernel if self._done else None

    def wait(self, timeout: Optional[float] = None) -> Optional[Kernel]:
        """Start the build if needed and wait up to `timeout` s for it (tests, benchmarks)."""
        if not self._done:
            if self._thread is None:
                self._start()
            with self._lock:
                finished = self._finished
            finished.wait(timeout)
        return self._kernel if self._done else None

    def _start(self) -> None:
        with self._lock:
            if self._done or self._thread is not None:
                return
            try:
                native = _env.cpu_kernel_mode(os.environ) == "native"
            except _env.ConfigError as exc:  # watch() raised it already; statistics go on
                log.error("tensorwatch_otel: %s; CPU statistics use torch ops", exc)
                native = False
            if not native:
                self._done = True
                self._finished.set()
                return
            t = threading.Thread(target=self._build, args=(self._finished,), daemon=True,
                                 name="tensorwatch_otel-cpu-kernel")
            self._thread = t
            t.start()

    def _build(self, finished: threading.Event) -> None:
        kernel = None
        try:
            kernel = build()
        except Exception as exc:  # build() logs what it expects; anything else once here
            log.info("tensorwatch_otel: could not build the CPU statistics kernel (%s): CPU statistics use "
                     "torch ops", exc)
        with self._lock:
            if self._finished is finished:  # not reset meanwhile
                self._kernel, self._done = kernel, True
        finished.set()

    def wait_for_thread(self, timeout: float) -> None:
        """Wait up to `timeout` s for the build's thread to end (at interpreter exit)."""
        with self._lock:
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def reset(self, kernel: Optional[Kernel] = None, done: bool = False) -> None:
        """Forget the kernel (tests): the next get() builds again, or returns `kernel` if done.
        A build still running is left to finish unheard."""
        with self._lock:
            self._kernel, self._done = kernel, done
            self._thread = None
            self._finished = threading.Event()
            if done:
                self._finished.set()


KERNEL = _Loader()


@atexit.register
def _at_exit() -> None:
    """Kill a compiler still running, then let the build's thread finish (it has little left once
    its compiler is gone) before the interpreter's finalization: a daemon thread still running
    then is stopped wherever it stands, which native code beneath it may not survive."""
    kill_running()
    KERNEL.wait_for_thread(EXIT_WAIT_S)
