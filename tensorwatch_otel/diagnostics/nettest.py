"""`tensorwatch-otel nettest`: is every rank able to talk to every other one, and how fast?

Run it under torchrun; each rank joins, passes a monitored barrier, checks an all_reduce result,
allocates device memory and sweeps all_reduce bandwidth. Rank 0 prints one line per rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from typing import Any, Dict

log = logging.getLogger("tensorwatch_otel.nettest")

HELP = "check multi-rank communication (run under torchrun): one OK/broken line per rank"

DESCRIPTION = """\
Check that every rank of a torchrun job can reach every other one, and measure all_reduce bandwidth.

Each rank: joins through the torchrun store, initialises the process group, passes a monitored
barrier (names the ranks that did not arrive), runs an all_reduce whose result is checked
(rank r contributes r+1; every rank must see n(n+1)/2), allocates GPU memory (nccl), and
sweeps message sizes up to --size-mb reporting algbw and busbw (busbw = algbw * 2(n-1)/n,
as nccl-tests computes it). Rank 0 prints the versions, the bandwidth table and one line per
rank, `OK` or `broken` with the reason; a rank that never joins or hangs is reported within
--timeout. Exit status 0 only when every rank passed, 1 otherwise, 2 for bad options.

examples:
  torchrun --nproc-per-node 2 -m tensorwatch_otel nettest
  python -m torch.distributed.run --nproc_per_node 2 -m tensorwatch_otel nettest --backend gloo
  torchrun --nproc-per-node 8 --no-python tensorwatch-otel nettest --timeout 60 --size-mb 1024
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
      -m tensorwatch_otel nettest --nccl-debug --json

With OTEL_EXPORTER_OTLP_ENDPOINT set, each rank also exports one span (tensorwatch.nettest)
and its bandwidth as gauges (tensorwatch.nettest.algbw / .busbw, bytes per second) tagged with
tensorwatch.rank. See docs/diagnostics.md for a SLURM recipe and what each failure means.
"""

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_SIZE_MB = 64.0


def _positive(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value > 0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="communication backend: nccl when a GPU is usable, else gloo (default: auto)")
    parser.add_argument("--timeout", type=_positive("--timeout"), default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="seconds to wait for a rank at each step before calling it missing or hung "
                             f"(default: {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--size-mb", type=_positive("--size-mb"), default=DEFAULT_SIZE_MB, metavar="M",
                        help=f"largest all_reduce message in the bandwidth sweep, MiB (default: {DEFAULT_SIZE_MB:g})")
    parser.add_argument("--json", action="store_true", help="print the verdict as one JSON document")
    parser.add_argument("--nccl-debug", action="store_true",
                        help="set NCCL_DEBUG=INFO with one NCCL_DEBUG_FILE per rank, and show the warning "
                             "lines found in them")
    parser.add_argument("--nccl-debug-dir", default="nettest-nccl-logs", metavar="DIR",
                        help="where --nccl-debug writes the per-rank NCCL logs (default: ./nettest-nccl-logs)")


def _emit(text: str) -> None:
    # One write per line: ranks printing for themselves never interleave within a line.
    data = (text + "\n").encode()
    try:
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), data)
    except (OSError, ValueError, AttributeError):  # stdout replaced (pytest capture) or closed
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def _launch_from_env() -> Any:
    from ._nettest_rank import Launch

    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        # Not under torchrun: a one-rank test on this machine, still useful for the GPU steps.
        from socket import socket as sock

        with sock() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log.warning("not launched by torchrun: testing a single rank; use "
                    "`torchrun --nproc-per-node N -m tensorwatch_otel nettest` for more")
        return Launch(0, 1, 0, "127.0.0.1", port, socket.gethostname())
    try:
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                      env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")),
                      socket.gethostname())
    except ValueError as exc:
        raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK/MASTER_PORT must be integers: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """Runs this rank's checks; rank 0 prints the verdict. Returns the exit status."""
    from ._nettest_faults import parse_faults
    from ._nettest_rank import Options, RankState

    try:
        launch = _launch_from_env()
        faults = parse_faults(os.environ)
    except ValueError as exc:
        from ..cli import usage_error

        return usage_error("nettest", str(exc))
    opts = Options(args.backend, float(args.timeout), max(4, int(args.size_mb * (1 << 20))),
                   args.nccl_debug_dir if args.nccl_debug else None)
    if faults.has("absent", launch.rank):
        from ._nettest_rank import park

        park(6 * opts.timeout_s + 60)
        return 1
    from . import _nettest_store as kv

    try:
        store = kv.open_store(launch.addr, launch.port, launch.rank, launch.world_size, opts.timeout_s)
    except Exception as exc:
        st = RankState(launch.rank, launch.world_size, launch.local_rank, launch.host, stage="join")
        st.fail(f"cannot reach the rendezvous store at {launch.addr}:{launch.port} within "
                f"{opts.timeout_s:g} s: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        from ._nettest_report import fallback_line

        _emit(fallback_line(st.to_json(), "this rank reports for itself", args.json))
        return 1
    return _finish(store, launch, opts, faults, args.json)


def _finish(store: Any, launch: Any, opts: Any, faults: Any, as_json: bool) -> int:
    from . import _nettest_store as kv
    from ._nettest_otel import export_rank
    from ._nettest_rank import run_rank

    st = run_rank(launch, opts, faults, store)
    state = st.to_json()
    kv.put(store, f"result/{launch.rank}", state)
    export_rank(state)
    if launch.rank == 0:
        code = _report(store, state, opts, as_json)
    else:
        code = _await_verdict(store, state, opts, as_json)
    _teardown(st.hung, code)
    return code


def _report(store: Any, state: Dict[str, Any], opts: Any, as_json: bool) -> int:
    from . import _nettest_store as kv
    from ._nettest_report import build_summary, render_json, render_text

    ws = state["world_size"]
    gone = set(state["absent"]) | set(state["barrier_missing"])
    others = [f"result/{r}" for r in range(1, ws) if r not in gone]
    kv.wait_for(store, others, time.monotonic() + opts.timeout_s)
    raw = kv.collect(store, [f"result/{r}" for r in range(1, ws)])
    results = {int(k.split("/")[1]): v for k, v in raw.items()}
    results[0] = state
    stages: Dict[int, str] = {}
    for r in range(ws):
        if kv.present(store, f"stage/{r}"):
            stages[r] = store.get(f"stage/{r}").decode()
    joins = {int(k.split("/")[1]): v for k, v in kv.collect(store, [f"join/{r}" for r in range(ws)]).items()}
    summary = build_summary(results, stages, state, joins, opts.timeout_s, opts.backend)
    if as_json:
        _emit(render_json(summary))
    else:
        for line in render_text(summary):
            _emit(line)
    code = 0 if summary["ok"] else 1
    kv.put(store, "done", {"code": code})
    # Rank 0 may host the store: stay until the others have read the verdict.
    kv.wait_for(store, [f"ack/{r}" for r in results if r != 0], time.monotonic() + min(5.0, opts.timeout_s))
    return code


def _await_verdict(store: Any, state: Dict[str, Any], opts: Any, as_json: bool) -> int:
    from . import _nettest_store as kv
    from ._nettest_report import fallback_line

    own = 0 if state["ok"] else 1
    if 0 in state["absent"]:
        _emit(fallback_line(state, "rank 0 never joined; this rank reports for itself", as_json))
        return 1
    deadline = time.monotonic() + opts.timeout_s + 5
    if kv.wait_for(store, ["result/0"], deadline):
        _emit(fallback_line(state, "rank 0 is hung or gone; this rank reports for itself", as_json))
        return 1
    if kv.wait_for(store, ["done"], time.monotonic() + opts.timeout_s + 5):
        _emit(fallback_line(state, "rank 0 did not print a verdict; this rank reports for itself", as_json))
        return max(own, 1)
    done = kv.read_optional(store, "done") or {"code": 1}
    try:
        kv.put(store, f"ack/{state['rank']}", True)
    except Exception as exc:
        log.debug("ack failed: %s", exc)
    return int(done.get("code", 1))


def _teardown(hung: bool, code: int) -> None:
    if hung:
        # A collective never returned: destroying the group would block on it, so leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:
        log.debug("destroy_process_group failed: %s", exc)
