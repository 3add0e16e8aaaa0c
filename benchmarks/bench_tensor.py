"""The per-tensor limit: what abs min + abs max of one tensor cost against one plain read of it.

For each dtype and size, every candidate way of getting both extremes is timed side by side in
one process (samples interleaved, order rotated each repeat) and reported as the ratio of its
median time to the median of `x.amax()` (one read of the tensor). On one CPU thread the clock is
the process' CPU time, so other work on a shared machine does not stretch the samples.
`measure` is the package's own `tensorwatch_otel.core.measure.stats.measure` (on CPU: the compiled
one-read kernel of core/measure/cpu_kernel.py where a C compiler exists); the others are the
alternatives it chooses between:

    abs_chunked   |x| chunk by chunk into a reused buffer, aminmax of each chunk
    torch_cpu     the package's CPU path without its compiled kernel (TENSORWATCH_CPU_KERNEL=torch)
    abs_full      aminmax(x.abs()): |x| materialised in one fresh tensor
    norm_pair     vector_norm(x, inf) and vector_norm(x, -inf): two reads, no |x| (CUDA path)
    sign          aminmax(x), abs max = max(-min, max); abs min from x alone when every value
                  has one sign (read on the host, CPU only), else from |x| chunk by chunk
    compiled      one fused torch.compile kernel (CUDA only; first call compiles, not timed)

    python benchmarks/bench_tensor.py                    # 1e3 .. 3e7 elements, fp32/fp16/bf16
    python benchmarks/bench_tensor.py --quick            # seconds (smoke test)
    python benchmarks/bench_tensor.py --layout transposed  # x.t() of 2-D tensors
    python benchmarks/bench_tensor.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tensorwatch_otel.core.measure import stats  # noqa: E402

INF = float("inf")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
_CHUNK = 1 << 18  # the CPU chunk the package used before (1 MiB of fp32)


def _abs_chunked(x: torch.Tensor, chunk: int = _CHUNK):
    flat = x.reshape(-1)
    bufs = _abs_chunked.bufs  # type: ignore[attr-defined]
    buf = bufs.get(x.dtype)
    if buf is None:
        buf = bufs[x.dtype] = torch.empty(chunk, dtype=x.dtype, device=x.device)
    n = flat.numel()
    if n <= chunk:
        b = buf[:n]
        torch.abs(flat, out=b)
        return torch.aminmax(b)
    mins, maxs = [], []
    for i in range(0, n, chunk):
        c = flat[i:i + chunk]
        b = buf[:c.numel()]
        torch.abs(c, out=b)
        mn, mx = torch.aminmax(b)
        mins.append(mn)
        maxs.append(mx)
    return torch.stack(mins).min(), torch.stack(maxs).max()


_abs_chunked.bufs = {}  # type: ignore[attr-defined]


def _abs_full(x):
    return torch.aminmax(x.abs())


def _norm_pair(x):
    return torch.linalg.vector_norm(x, INF), torch.linalg.vector_norm(x, -INF)


def _sign(x):
    mn, mx = torch.aminmax(x)
    abs_max = torch.maximum(-mn, mx)
    if x.device.type == "cpu":
        lo, hi = float(mn), float(mx)
        if lo >= 0:
            return mn, abs_max
        if hi <= 0:
            return -mx, abs_max
    return _abs_chunked(x)[0], abs_max


def _compiled():
    @torch.compile(dynamic=True, fullgraph=True)
    def fused(x):
        a = x.reshape(-1).abs()
        return a.min(), a.max()
    return fused


def candidates(device: str, names: List[str]) -> Dict[str, Callable]:
    table = {"amax": lambda x: x.amax(), "measure": stats.measure, "abs_chunked": _abs_chunked,
             "abs_full": _abs_full, "norm_pair": _norm_pair, "sign": _sign}
    if device.startswith("cuda"):
        table["compiled"] = _compiled()
    else:
        table["torch_cpu"] = stats.abs_minmax_torch_cpu
    return {n: table[n] for n in ["amax"] + [n for n in names if n in table and n != "amax"]}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


_CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def _sample(fn, x, k: int, device: str) -> float:
    _sync(device)
    t = clock()
    for _ in range(k):
        fn(x)
    _sync(device)
    return (clock() - t) / k


def _tensor(n: int, dtype: torch.dtype, device: str, layout: str = "contiguous") -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(dtype).to(device)
    if layout == "transposed":  # (m, n/m) read as its transpose: dense memory, not contiguous
        m = math.gcd(n, 1000)
        x = x.view(m, n // m).t()
    return x


def bench(device: str, dtypes: List[str], sizes: List[int], names: List[str], repeats: int,
          target_s: float, layout: str = "contiguous") -> List[dict]:
    rows = []
    for dname in dtypes:
        for n in sizes:
            x = _tensor(n, DTYPES[dname], device, layout)
            fns = candidates(device, names)
            with torch.no_grad():
                ks = {}
                for name, fn in fns.items():
                    fn(x)  # warm: buffers, allocator, compilation
                    once = _sample(fn, x, 1, device)
                    ks[name] = max(1, min(10_000, int(target_s / max(once, 1e-7))))
                times: Dict[str, List[float]] = {name: [] for name in fns}
                order = list(fns)
                for r in range(repeats):
                    for name in order[r % len(order):] + order[:r % len(order)]:
                        times[name].append(_sample(fns[name], x, ks[name], device))
            base = statistics.median(times["amax"])
            row = {"dtype": dname, "numel": n, "amax_us": base * 1e6,
                   "ratio": {name: statistics.median(t) / base for name, t in times.items()},
                   "ratio_q1_q3": {name: _quartiles([v / base for v in t]) for name, t in times.items()}}
            rows.append(row)
            print(f"{dname} {n:.0e}: " + "  ".join(f"{k} {v:.2f}" for k, v in row["ratio"].items()),
                  file=sys.stderr, flush=True)
            del x
    return rows


def _quartiles(v: List[float]) -> List[float]:
    if len(v) < 2:
        return [v[0], v[0]]
    q = statistics.quantiles(v, n=4, method="inclusive")
    return [q[0], q[2]]


def print_table(rows: List[dict]) -> None:
    names = [n for n in rows[0]["ratio"] if n != "amax"]
    print("\nratio of median time to x.amax() (one read); amax in microseconds")
    print(f"{'dtype':<6}{'numel':>9}{'amax us':>10}" + "".join(f"{n:>13}" for n in names))
    for row in rows:
        print(f"{row['dtype']:<6}{row['numel']:>9.0e}{row['amax_us']:>10.1f}"
              + "".join(f"{row['ratio'][n]:>13.2f}" for n in names))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two sizes, fp32 and bf16, few repeats (smoke test)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto (cuda when available)")
    p.add_argument("--dtypes", default="fp32,fp16,bf16", help="comma list of fp32,fp16,bf16,fp64")
    p.add_argument("--sizes", default="1e3,3e4,3e5,3e6,3e7", help="comma list of element counts")
    p.add_argument("--candidates", default="measure,torch_cpu,abs_chunked,abs_full,norm_pair,sign,compiled",
                   help="comma list (amax is always timed: it is the reference)")
    p.add_argument("--repeats", type=int, default=9, help="timed samples per candidate (default 9)")
    p.add_argument("--sample-ms", type=float, default=5.0, help="length of one sample (default 5 ms)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: steadier on a shared machine; the step uses 2)")
    p.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="cpu: the process' CPU time, which preemption on a shared machine does not "
                        "stretch (auto: cpu on one CPU thread, else wall)")
    p.add_argument("--layout", choices=("contiguous", "transposed"), default="contiguous",
                   help="transposed: each tensor a transposed 2-D view (a module's input or output "
                        "after .t() or .permute())")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    global clock
    clock_name = args.clock if args.clock != "auto" else (
        "cpu" if device == "cpu" and args.threads == 1 else "wall")
    if clock_name == "cpu" and device != "cpu":
        p.error("--clock cpu: CPU only")
    clock = _CLOCK[clock_name]
    if args.threads:
        torch.set_num_threads(args.threads)
    from tensorwatch_otel.core.measure.cpu_kernel import KERNEL
    KERNEL.wait()  # the CPU kernel is built on a thread of its own: time the kernel, not its build
    sizes = [int(float(s)) for s in args.sizes.split(",") if s.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    repeats, sample_s = args.repeats, args.sample_ms / 1000
    if args.quick:
        sizes, dtypes, repeats, sample_s = [1000, 100_000], ["fp32", "bf16"], 3, 0.002
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not sizes or repeats < 1 or min(sizes) < 1:
        p.error(f"--dtypes must be among {','.join(DTYPES)}; --sizes and --repeats must be >= 1")
    names = [n.strip() for n in args.candidates.split(",") if n.strip()]
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {clock_name} clock",
          file=sys.stderr)
    rows = bench(device, dtypes, sizes, names, repeats, sample_s, args.layout)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "clock": clock_name, "layout": args.layout,
                       "repeats": repeats, "rows": rows}, f, indent=2)
    return 0 if all(math.isfinite(r["ratio"]["measure"]) for r in rows if "measure" in r["ratio"]) else 1


if __name__ == "__main__":
    sys.exit(main())
