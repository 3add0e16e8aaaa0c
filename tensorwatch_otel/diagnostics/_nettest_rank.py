"""One rank's side of `nettest`: check in, init, barrier, checked all_reduce, device memory, sweep.

Each step writes its name to the store before it starts, so rank 0 can tell where a silent rank
stopped. A step that never completes is cut off at the --timeout deadline, not the backend's.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional

from . import _nettest_store as kv
from ._nettest_faults import Faults

log = logging.getLogger("tensorwatch_otel.nettest")

#: Lines from NCCL's own log that point at the usual causes (the ones people grep for).
NCCL_PATTERNS = (
    "NCCL WARN", "NET/IB : No device found", "NET/Socket : Using", "Connection timed out",
    "Connection closed by remote peer", "unhandled system error", "collective operation timeout",
)
MAX_NCCL_LINES = 20


@dataclass(frozen=True)
class Options:
    backend: str          # auto | nccl | gloo
    timeout_s: float
    size_bytes: int
    nccl_debug_dir: Optional[str] = None


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    addr: str
    port: int
    host: str


@dataclass
class RankState:
    """What one rank found; serialised to the store for rank 0."""

    rank: int
    world_size: int
    local_rank: int
    host: str
    ok: bool = True
    reason: str = ""
    stage: str = "start"
    backend: str = ""
    device: str = "cpu"
    allreduce: Dict[str, Any] = field(default_factory=dict)
    bandwidth: List[Dict[str, Any]] = field(default_factory=list)
    absent: List[int] = field(default_factory=list)
    barrier_missing: List[int] = field(default_factory=list)
    versions: Dict[str, Any] = field(default_factory=dict)
    nccl_log: Optional[str] = None
    nccl_warnings: List[str] = field(default_factory=list)
    start_unix_ns: int = 0
    duration_s: float = 0.0
    hung: bool = False  # a collective never returned: the process must exit hard

    def fail(self, reason: str) -> None:
        if self.ok:  # the first failure is the cause; later ones follow from it
            self.ok, self.reason = False, reason

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


class StageTimeout(Exception):
    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


class BarrierFailed(Exception):
    def __init__(self, ranks: List[int], message: str) -> None:
        super().__init__(message)
        self.ranks = ranks


def versions() -> Dict[str, Any]:
    """torch, CUDA and NCCL versions of this process (None where not applicable)."""
    import torch

    out: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None,
                           "python": platform.python_version()}
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:  # a CPU build or a broken driver: the version is simply unknown
        log.debug("NCCL version unavailable: %s", exc)
    return out


def choose_backend(requested: str) -> str:
    """Resolves `auto`; raises RuntimeError when nccl is asked for without a usable GPU."""
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available() and dist.is_nccl_available()
    if requested == "auto":
        return "nccl" if gpu else "gloo"
    if requested == "nccl" and not gpu:
        raise RuntimeError("backend nccl needs a CUDA GPU and an NCCL-enabled torch; "
                           "this rank has neither (use --backend gloo to test the network alone)")
    return requested


def sweep_sizes(max_bytes: int) -> List[int]:
    """Message sizes from 1 KiB up to max_bytes, x4 per step, always ending at max_bytes."""
    top = max(4, max_bytes - max_bytes % 4)
    sizes, s = [], 1024
    while s < top:
        sizes.append(s)
        s *= 4
    sizes.append(top)
    return sizes


def iterations(nbytes: int) -> int:
    return 20 if nbytes <= 1 << 20 else 10 if nbytes <= 16 << 20 else 5


def bus_factor(world_size: int) -> float:
    """nccl-tests' all_reduce correction: busbw = algbw * 2(n-1)/n."""
    return 2.0 * (world_size - 1) / world_size


def scan_nccl_log(path: Optional[str]) -> List[str]:
    """The lines of an NCCL debug file that match NCCL_PATTERNS (at most MAX_NCCL_LINES)."""
    if not path or not os.path.exists(path):
        return []
    hits: List[str] = []
    with open(path, errors="replace") as fh:
        for line in fh:
            if any(p in line for p in NCCL_PATTERNS):
                hits.append(line.rstrip())
                if len(hits) >= MAX_NCCL_LINES:
                    break
    return hits


def enable_nccl_debug(directory: str, launch: Launch) -> str:
    """Sets NCCL_DEBUG=INFO and a per-rank NCCL_DEBUG_FILE (read by NCCL at init); returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(os.path.abspath(directory), f"nccl-{launch.host}-rank{launch.rank}.log")
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_FILE"] = path
    return path


def _stage(store: Any, st: RankState, name: str) -> None:
    st.stage = name
    try:
        store.set(f"stage/{st.rank}", name)
    except Exception as exc:  # progress marks are best effort
        log.debug("could not record stage %s: %s", name, exc)


def _wait(work: Any, deadline: float, stage: str) -> None:
    delay = 0.0002
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise StageTimeout(stage)
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    work.wait()


def park(seconds: float) -> None:
    """Fault injection: behave like a stuck process (torchrun ends it when rank 0 exits)."""
    log.warning("nettest fault injection: this rank stops responding for %.0f s", seconds)
    time.sleep(seconds)


def _barrier(st: RankState, group: Any, timeout_s: float) -> None:
    import torch.distributed as dist

    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as exc:
        msg = str(exc)
        m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", msg)
        ranks = [int(x) for x in re.findall(r"\d+", m.group(1))] if m else []
        raise BarrierFailed(ranks, msg.splitlines()[0] if msg else type(exc).__name__) from exc


def _check_allreduce(st: RankState, dev: Any, deadline: float, corrupt: bool) -> None:
    """Each rank puts rank+1 in its own slot: the sum is n(n+1)/2 and a wrong slot names the
    rank whose contribution arrived wrong."""
    import torch
    import torch.distributed as dist

    n = st.world_size
    t = torch.zeros(n, dtype=torch.float32, device=dev)
    t[st.rank] = st.rank + 1
    _wait(dist.all_reduce(t, async_op=True), deadline, "all_reduce")
    if corrupt:
        t[0] += 1
    vals = t.cpu().tolist()
    got, expected = sum(vals), n * (n + 1) / 2
    wrong = [i for i, v in enumerate(vals) if v != i + 1]
    st.allreduce = {"sum": got, "expected": expected, "wrong_slots": wrong}
    if wrong:
        i = wrong[0]
        st.fail(f"all_reduce returned sum {got:g}, expected {expected:g} "
                f"(slot of rank {i} holds {vals[i]:g}, expected {i + 1})")


def _device_memory(st: RankState, dev: Any, nbytes: int) -> None:
    import torch

    x = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=dev)
    x.fill_(1.0)
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    name = torch.cuda.get_device_name(dev)
    st.device = f"{dev} {name}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
    del x


def _sweep(st: RankState, store: Any, dev: Any, opts: Options, corrupt: bool) -> None:
    import torch
    import torch.distributed as dist

    on_cuda = dev.type == "cuda"
    expected = st.world_size * (st.world_size + 1) / 2
    for nbytes in sweep_sizes(opts.size_bytes):
        _stage(store, st, f"bandwidth {nbytes}")
        buf = torch.full((max(1, nbytes // 4),), float(st.rank + 1), device=dev)
        _wait(dist.all_reduce(buf, async_op=True), time.monotonic() + opts.timeout_s, "bandwidth")
        if corrupt:
            buf[0] += 1
        wrong = int((buf != expected).sum().item())
        buf.zero_()  # timed rounds on zeros: values stay finite however many rounds run
        iters = iterations(nbytes)
        if on_cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        if on_cuda:
            works = [dist.all_reduce(buf, async_op=True) for _ in range(iters)]
            _wait(works[-1], time.monotonic() + opts.timeout_s, "bandwidth")
            torch.cuda.synchronize(dev)
        else:
            for _ in range(iters):
                dist.all_reduce(buf)
        dt = (time.perf_counter() - t0) / iters
        algbw = buf.numel() * 4 / dt / 1e9
        st.bandwidth.append({"bytes": buf.numel() * 4, "time_us": dt * 1e6, "algbw_gbps": algbw,
                             "busbw_gbps": algbw * bus_factor(st.world_size), "wrong": wrong})
        if wrong:
            st.fail(f"bandwidth sweep: {wrong} wrong element(s) in the {buf.numel() * 4}-byte all_reduce")


def _join(store: Any, st: RankState, opts: Options, deadline: float) -> bool:
    _stage(store, st, "join")
    kv.put(store, f"join/{st.rank}", {"host": st.host, "local_rank": st.local_rank, "pid": os.getpid()})
    missing = kv.wait_for(store, [f"join/{r}" for r in range(st.world_size)], deadline)
    st.absent = sorted(int(k.split("/")[1]) for k in missing)
    if st.absent:
        st.fail(f"not tested: rank(s) {_ranks(st.absent)} never joined within {opts.timeout_s:g} s")
    return not st.absent


def _ranks(ranks: List[int]) -> str:
    return ", ".join(map(str, ranks))


def _explain(exc: Exception, stage: str, timeout_s: float) -> str:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    if "timed out" in first.lower() or "timeout" in first.lower():
        return f"{stage} did not complete within {timeout_s:g} s (a peer is hung or gone): {first}"
    return f"{stage} failed: {type(exc).__name__}: {first}"


def run_rank(launch: Launch, opts: Options, faults: Faults, store: Any) -> RankState:
    """Runs every step for this rank; never raises for a communication problem."""
    import torch
    import torch.distributed as dist

    st = RankState(launch.rank, launch.world_size, launch.local_rank, launch.host,
                   start_unix_ns=time.time_ns(), versions=versions())
    t0 = time.monotonic()
    corrupt = faults.has("wrong_value", launch.rank)
    if opts.nccl_debug_dir:
        st.nccl_log = enable_nccl_debug(opts.nccl_debug_dir, launch)
    try:
        if not _join(store, st, opts, t0 + opts.timeout_s):
            return st
        _stage(store, st, "init")
        st.backend = choose_backend(opts.backend)
        dev = torch.device("cpu")
        if st.backend == "nccl":
            if launch.local_rank >= torch.cuda.device_count():
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
                raise RuntimeError(f"LOCAL_RANK {launch.local_rank} but only {torch.cuda.device_count()} "
                                   f"GPU(s) visible (CUDA_VISIBLE_DEVICES={visible})")
            dev = torch.device("cuda", launch.local_rank)
            torch.cuda.set_device(dev)
        # NCCL's watchdog would abort the process at the group timeout; give our own deadline room.
        pg_timeout = opts.timeout_s + (30 if st.backend == "nccl" else 0)
        dist.init_process_group(st.backend, store=kv_prefix(store, "pg"), rank=launch.rank,
                                world_size=launch.world_size, timeout=timedelta(seconds=pg_timeout))
        side = None if st.backend == "gloo" else dist.new_group(backend="gloo",
                                                                timeout=timedelta(seconds=opts.timeout_s))
        _stage(store, st, "barrier")
        if faults.has("hang", launch.rank):
            park(6 * opts.timeout_s + 60)
        _barrier(st, side, opts.timeout_s)
        _stage(store, st, "all_reduce")
        _check_allreduce(st, dev, time.monotonic() + opts.timeout_s, corrupt)
        if dev.type == "cuda":
            _stage(store, st, "device_memory")
            _device_memory(st, dev, opts.size_bytes)
        _sweep(st, store, dev, opts, corrupt)
        _stage(store, st, "done")
    except StageTimeout as exc:
        st.hung = True
        st.fail(f"{exc.stage} did not complete within {opts.timeout_s:g} s (a peer is hung or gone)")
    except BarrierFailed as exc:
        st.barrier_missing = exc.ranks
        if exc.ranks:
            st.fail(f"rank(s) {_ranks(exc.ranks)} did not reach the barrier within {opts.timeout_s:g} s")
        elif launch.rank != 0 and "successfully reached monitoredBarrier" in str(exc):
            st.fail(f"reached the barrier, but rank 0 did not release it within {opts.timeout_s:g} s "
                    f"(rank 0, or a rank rank 0 waits for, is hung or gone)")
        else:
            st.fail(_explain(exc, "barrier", opts.timeout_s))
    except Exception as exc:  # every other failure becomes this rank's verdict
        log.debug("nettest rank %d failed at %s", launch.rank, st.stage, exc_info=True)
        st.fail(_explain(exc, st.stage, opts.timeout_s))
    finally:
        st.duration_s = time.monotonic() - t0
        st.nccl_warnings = scan_nccl_log(st.nccl_log)
        if st.nccl_log and not os.path.exists(st.nccl_log):
            st.nccl_log = None  # NCCL never ran (gloo), so there is no log to point at
    return st


def kv_prefix(store: Any, prefix: str) -> Any:
    from torch.distributed import PrefixStore

    return PrefixStore(prefix, store)
