"""How much polling a process group's TCPStore takes: N clients against one real TCPStore server
on this machine, each asking `check(["tensorwatch_otel/fleet_stop"])` back to back (the fleet
stop's per-step question when nothing was published), first as N processes, then as N threads
of one process (one client object each). For each N: the latency of one `check` (median and
spread over every call) and the requests per second the server answered, all clients together.
Then the load the fleet stop puts on the store at 1k, 8k and 16k ranks, with the assumptions
printed beside the figures.

    python benchmarks/bench_store.py [--procs 1,2,4,8,16,32,64] [--threads 1,4,16,64,256] [--seconds 2]
    python benchmarks/bench_store.py --quick            # the test suite's small form

The server runs in a process of its own (as torchrun's agent, or rank 0, hosts it). Server and
clients share this machine's cores: with few cores the figures bound the server's capacity from
below (the clients take CPU from it) and the latency from above. One JSON object on stdout
(and in --json PATH).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from typing import Dict, List

KEY = "tensorwatch_otel/fleet_stop"  # tensorwatch_otel.core.fleet.STORE_KEY, never set here
TIMEOUT = datetime.timedelta(seconds=60)


def _client(port: int) -> "object":
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT, wait_for_workers=False)


def _ask(store, start: float, seconds: float) -> List[float]:
    """check() back to back from `start` for `seconds`: each call's latency in microseconds."""
    while time.time() < start:
        time.sleep(0.0005)
    out = []
    end = start + seconds
    clock = time.perf_counter
    while True:
        t0 = clock()
        store.check([KEY])
        t1 = clock()
        out.append((t1 - t0) * 1e6)
        if time.time() >= end:
            return out


def _proc_client(port: int, start, go, seconds: float, q) -> None:
    try:
        store = _client(port)
        store.check([KEY])  # connected and answered once
        q.put("ready")
        if not go.wait(120):
            raise TimeoutError("never started")
        q.put(_ask(store, start.value, seconds))
    except Exception as exc:  # reported, never hangs the parent
        q.put(repr(exc))


def _serve(port_q, stop) -> None:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    port_q.put(server.port)
    stop.wait()


def _summary(kind: str, n: int, lat: List[List[float]], seconds: float) -> Dict[str, object]:
    calls = [v for per in lat for v in per]
    calls.sort()

    def q(p: float) -> float:
        return round(calls[min(int(p * len(calls)), len(calls) - 1)], 1)

    return {"clients": kind, "n": n, "calls": len(calls), "req_per_s": round(len(calls) / seconds),
            "check_us_median": q(0.5), "check_us_p10": q(0.1), "check_us_p90": q(0.9),
            "check_us_p99": q(0.99), "check_us_max": round(calls[-1], 1),
            "per_client_req_per_s_median": round(statistics.median(len(per) for per in lat) / seconds, 1)}


def run_procs(port: int, n: int, seconds: float, ctx) -> Dict[str, object]:
    q, go, start = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_proc_client, args=(port, start, go, seconds, q), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    ready = [q.get(timeout=120) for _ in procs]  # every client connected before the clock starts
    if any(r != "ready" for r in ready):
        raise RuntimeError(f"a client failed to connect: {[r for r in ready if r != 'ready'][0]}")
    start.value = time.time() + 0.1
    go.set()
    got = [q.get(timeout=120 + seconds) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    errors = [g for g in got if isinstance(g, str)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} clients failed: {errors[0]}")
    return _summary("processes", n, got, seconds)


def run_threads(port: int, n: int, seconds: float) -> Dict[str, object]:
    stores = [_client(port) for _ in range(n)]
    for store in stores:
        store.check([KEY])
    start = time.time() + 0.3
    got: List[List[float]] = [[] for _ in range(n)]

    def body(i: int) -> None:
        got[i] = _ask(stores[i], start, seconds)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120 + seconds)
    return _summary("threads", n, got, seconds)


def extrapolate(best: float, crowded: float, check_us: float) -> List[Dict[str, object]]:
    """Load per step on the store for 1k, 8k and 16k ranks, every rank asking or one per node.
    `best`: the most requests per second measured; `crowded`: at the most processes measured (a
    crowd of connections costs the server); `check_us`: one lone client's median check."""
    rows = []
    for ranks in (1024, 8192, 16384):
        for who, askers in (("every rank", ranks), ("one per node (8 ranks/node)", ranks // 8)):
            load = askers * 1.0  # checks per second at one optimizer step per second
            rho = load / best
            rows.append({"ranks": ranks, "askers": who, "checks_per_step": askers,
                         "req_per_s_at_1_step_per_s": round(load), "server_utilisation": round(rho, 4),
                         # every asker's check arrives together after the step's all-reduce: the
                         # last answer comes after the whole burst (what a rank's step waits)
                         "burst_drain_ms": round(askers / best * 1e3, 1),
                         "burst_drain_ms_crowded": round(askers / crowded * 1e3, 1),
                         "mm1_check_us": round(check_us / (1 - rho), 1) if rho < 1 else None})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="1,2,4,8,16,32,64")
    ap.add_argument("--threads", default="1,4,16,64,256")
    ap.add_argument("--seconds", type=float, default=2.0, help="asking time per N")
    ap.add_argument("--quick", action="store_true", help="N = 1, 2 processes and 1, 4 threads, 0.3 s each")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    if args.quick:
        args.procs, args.threads, args.seconds = "1,2", "1,4", 0.3
    import torch

    torch.set_num_threads(1)
    ctx = mp.get_context("fork")  # torch already imported: the clients start in milliseconds
    port_q, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(port_q, stop), daemon=True)
    server.start()
    try:
        port = port_q.get(timeout=60)
        rows = [run_procs(port, int(n), args.seconds, ctx) for n in args.procs.split(",") if n]
        rows += [run_threads(port, int(n), args.seconds) for n in args.threads.split(",") if n]
    finally:
        stop.set()
        server.join(timeout=10)
    best = max(rows, key=lambda r: r["req_per_s"])
    single = next(r for r in rows if r["n"] == 1)
    crowded = max(rows, key=lambda r: (r["clients"] == "processes", r["n"]))
    load = os.getloadavg()
    out = {
        "machine": {"cpus": os.cpu_count(), "loadavg_1m": round(load[0], 2), "torch": torch.__version__,
                    "python": sys.version.split()[0]},
        "rows": rows,
        "capacity_req_per_s": best["req_per_s"],
        "capacity_at": {"clients": best["clients"], "n": best["n"]},
        "crowded_req_per_s": crowded["req_per_s"],
        "crowded_at": {"clients": crowded["clients"], "n": crowded["n"]},
        "extrapolation": extrapolate(best["req_per_s"], crowded["req_per_s"], single["check_us_median"]),
        "assumptions": [
            "one optimizer step per second per rank; every asker checks once per step",
            "the server's capacity is the most requests per second measured here (server and clients on "
            "the same cores: a dedicated server core answers more)",
            "after a step's all-reduce every asker checks at once: the burst drains in askers / capacity "
            "(burst_drain_ms; _crowded: at the capacity measured with the most processes), and a rank's "
            "step waits for its answer; measured latencies here follow clients / req_per_s",
            "mm1_check_us: one check's latency as an M/M/1 queue at that utilisation (random arrivals), "
            "from the single client's median; None: past the capacity, the queue grows without bound",
            "across hosts add the network round trip to every check",
        ],
    }
    text = json.dumps(out)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
