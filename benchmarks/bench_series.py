"""Series budget: a real Prometheus (the Debian binary) scrapes N simulated ranks, each a real
PrometheusMetrics sink serving the label set of a 70B-shaped model (80 blocks of 13 modules).

    python benchmarks/bench_series.py [--endpoints 16,32,64] [--fleet-endpoints 64] [--json out.json]
    python benchmarks/bench_series.py --quick        # the test suite's small form (about 20 s)

For each N in --endpoints (detail "all", today's default): Prometheus head series, samples per
scrape, scrape duration per target (min/median/max), and Prometheus memory per series (resident
and Go heap in use, minus an empty Prometheus). Then one fleet-mode run (--detail top:K plus
--detail-ranks) with the fleet recording rules loaded: head series against the budget, and the
fleet-wide per-module maximum from PromQL checked against the true values of every rank.

Each rank is fed real BatchStats built from the core's Frame/TensorStat types (tiny values, no
model); several ranks share one worker process, each sink with its own registry and port.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLEET_RULES = os.path.join(ROOT, "deploy", "prometheus", "rules", "tensorwatch_fleet.yml")
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
FP16_MAX = 65504.0
JOB = "tensorwatch"
# Series Prometheus adds per target: up, scrape_duration_seconds, scrape_samples_scraped,
# scrape_samples_post_metric_relabeling, scrape_series_added.
SCRAPE_META = 5
# Per-rank series of the sink besides the tensor gauges (batches, batch number, dropped, skips,
# streaks, worst pair, cutoff, hidden pairs, and room for the scaler and detection counters).
PER_RANK = 15

Pair = Tuple[str, str, str]  # (module, class, tensor)


# ------------------------------------------------------------------------------ the model shape
def model_pairs(blocks: int) -> List[Pair]:
    """The (module, class, tensor) pairs the watcher reports for a Llama-style decoder."""
    lin = ("weight", "input[0]", "output")
    out: List[Pair] = [("model.embed_tokens", "Embedding", t) for t in ("weight", "output")]
    for i in range(blocks):
        p = f"model.layers.{i}"
        mods = [(p, "LlamaDecoderLayer", ("input[0]", "output[0]", "output[1]")),
                (f"{p}.input_layernorm", "LlamaRMSNorm", lin),
                (f"{p}.self_attn", "LlamaAttention", ("input.hidden_states", "output[0]", "output[1]"))]
        mods += [(f"{p}.self_attn.{n}", "Linear", lin) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        mods += [(f"{p}.post_attention_layernorm", "LlamaRMSNorm", lin),
                 (f"{p}.mlp", "LlamaMLP", ("input[0]", "output"))]
        mods += [(f"{p}.mlp.{n}", "Linear", lin) for n in ("gate_proj", "up_proj", "down_proj")]
        mods += [(f"{p}.mlp.act_fn", "SiLU", ("input[0]", "output"))]
        out += [(m, c, t) for m, c, ts in mods for t in ts]
    out += [("model.norm", "LlamaRMSNorm", t) for t in lin]
    out += [("lm_head", "Linear", t) for t in lin]
    out += [("", "LlamaForCausalLM", t) for t in ("output.logits", "output.loss")]
    return out


def hot_rank(n: int) -> int:
    return min(37, n - 1)


def values(pairs: Sequence[Pair], rank: int, n_ranks: int, blocks: int, seed: int) -> List[float]:
    """Range used of every pair on one rank: a per-pair level (same seed on every rank) times a
    per-rank spread, and one planted hot pair (mlp.down_proj output of the middle block)."""
    base = random.Random(seed)
    levels = [10 ** base.uniform(-5, -1.3) for _ in pairs]
    rr = random.Random(seed * 100_003 + rank)
    out = [lv * math.exp(rr.gauss(0, 0.5)) for lv in levels]
    if rank == hot_rank(n_ranks):
        hot = (f"model.layers.{blocks // 2}.mlp.down_proj", "Linear", "output")
        out[pairs.index(hot)] = 0.6
    return [min(v, 0.99) for v in out]


def frames_for(pairs: Sequence[Pair], used: Sequence[float], batch: int):
    from tensorwatch_otel.core.frame_stats import Frame, TensorStat

    frames, cur, mod, cls = [], [], None, None
    for (m, c, t), ru in zip(list(pairs) + [(None, None, None)], list(used) + [0.0]):
        if m != mod and mod is not None:
            frames.append(Frame(mod, cls, tuple(cur), batch, not frames))
            cur = []
        mod, cls = m, c
        if m is not None:
            cur.append(TensorStat(t, ru * 1e-3, ru * FP16_MAX, "float16", "", ru))
    return tuple(frames)


# ------------------------------------------------------------------------------ worker process
def worker(args) -> None:
    """Serve the given ranks, one PrometheusMetrics each, until stdin closes."""
    import torch
    from prometheus_client import CollectorRegistry

    from tensorwatch_otel.core.frame_stats import BatchStats
    from tensorwatch_otel.sinks.prometheus import PrometheusMetrics

    torch.set_num_threads(1)
    pairs = model_pairs(args.blocks)
    ranks = [int(r) for r in args.ranks.split(",")]
    sinks, ports = [], []
    for rank in ranks:
        sink = PrometheusMetrics(port=0, registry=CollectorRegistry(), detail=args.detail,
                                 detail_ranks=args.detail_ranks or (), max_series=100_000, linger_s=0)
        used = values(pairs, rank, args.n_ranks, args.blocks, args.seed)
        for b in range(2):
            sink.on_batch(BatchStats(b, rank, time.time(), frames_for(pairs, used, b)))
        sinks.append(sink)
        ports.append(sink.port)
    print(json.dumps({"ports": ports}), flush=True)
    sys.stdin.read()
    os._exit(0)  # no detection, nothing to linger for; closing 64 servers one by one takes seconds


# ------------------------------------------------------------------------------ Prometheus
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, timeout: float = 30.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def rules_every(path: str, every: str, workdir: str) -> str:
    """A copy of the rule file `path` in `workdir` whose groups are evaluated `every` (a
    Prometheus duration), as the scrapes: the shipped groups set their own interval."""
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"(?m)^(\s+)interval: \S+$", lambda m: f"{m.group(1)}interval: {every}", f.read())
    out = os.path.join(workdir, os.path.basename(path))
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return out


class Prometheus:
    def __init__(self, workdir: str, targets: Sequence[str], interval_s: float, rules: Sequence[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        every = f"{round(interval_s * 1000)}ms"  # Prometheus durations take no fractions
        os.makedirs(workdir, exist_ok=True)
        cfg = {"global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
               "rule_files": [rules_every(os.path.abspath(r), every, workdir) for r in rules],
               "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": list(targets)}]}]}
        path = os.path.join(workdir, "prometheus.yml")
        with open(path, "w") as fh:
            json.dump(cfg, fh)
        self.log = open(os.path.join(workdir, "prometheus.log"), "wb")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={path}",
                                      f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                http(self.url + "/-/ready", 1.0)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("prometheus did not start; see " + workdir) from None
                time.sleep(0.1)

    def own(self) -> Dict[str, float]:
        """Prometheus' own metrics (fetched directly: no self-scrape job adds series)."""
        out = {}
        for line in http(self.url + "/metrics").decode().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.partition(" ")
                try:
                    out[name] = float(value.split()[0])
                except (ValueError, IndexError):
                    pass
        return out

    def query(self, promql: str) -> list:
        doc = json.loads(http(self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
        return doc["data"]["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def start_workers(n: int, workers: int, args, detail: str, detail_ranks: str) -> list:
    """Worker processes serving ranks 0..n-1 (they start in the background; see targets())."""
    procs = []
    for w in range(min(workers, n)):
        ranks = ",".join(str(r) for r in range(w, n, workers))
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--ranks", ranks, "--n-ranks", str(n),
             "--blocks", str(args.blocks), "--seed", str(args.seed), "--detail", detail,
             "--detail-ranks", detail_ranks], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    return procs


def targets_of(procs) -> List[str]:
    """Waits until every worker serves; its endpoints as host:port."""
    targets: List[str] = []
    for p in procs:
        line = p.stdout.readline()
        if not line:
            stop_workers(procs)
            raise RuntimeError("a worker died before serving")
        targets += [f"127.0.0.1:{port}" for port in json.loads(line)["ports"]]
    return targets


def stop_workers(procs) -> None:
    for p in procs:
        try:
            p.stdin.close()
            p.wait(30)
        except Exception:
            p.kill()


def spread(xs: Sequence[float], digits: int = 4) -> Dict[str, float]:
    return {"min": round(min(xs), digits), "median": round(statistics.median(xs), digits),
            "max": round(max(xs), digits)}


def scraped(prom: Prometheus, n: int, scrapes: int, interval_s: float, timeout_s: float) -> None:
    """Waits until every target was scraped successfully `scrapes` times."""
    deadline = time.monotonic() + timeout_s
    q = f'count(count_over_time(up{{job="{JOB}"}}[1h]) >= {scrapes} and up{{job="{JOB}"}} == 1)'
    while True:
        r = prom.query(q)
        if r and int(float(r[0]["value"][1])) >= n:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every target scraped {scrapes} times within {timeout_s:.0f} s: {r}")
        time.sleep(interval_s / 2)


def measure(prom: Prometheus, n: int, baseline: Dict[str, float]) -> dict:
    own = prom.own()
    head = own["prometheus_tsdb_head_series"]
    durations = [float(r["value"][1]) for r in prom.query(f'scrape_duration_seconds{{job="{JOB}"}}')]
    samples = [float(r["value"][1]) for r in prom.query(f'scrape_samples_scraped{{job="{JOB}"}}')]
    rss = own["process_resident_memory_bytes"] - baseline["process_resident_memory_bytes"]
    heap = own["go_memstats_heap_inuse_bytes"] - baseline["go_memstats_heap_inuse_bytes"]
    return {"endpoints": n, "head_series": int(head), "series_per_endpoint": round(head / n, 1),
            "samples_per_scrape": spread(samples, 0), "scrape_duration_s": spread(durations),
            "rss_bytes": int(own["process_resident_memory_bytes"]),
            "heap_inuse_bytes": int(own["go_memstats_heap_inuse_bytes"]),
            "rss_bytes_per_series": round(rss / head, 1), "heap_bytes_per_series": round(heap / head, 1)}


def baseline_memory(tmp: str, interval_s: float) -> Dict[str, float]:
    prom = Prometheus(os.path.join(tmp, "empty"), [], interval_s)
    try:
        time.sleep(3 * interval_s)
        return prom.own()
    finally:
        prom.stop()


def fleet_budget(n: int, k: int, detail_ranks: int, pairs: int) -> int:
    """Series the fleet mode may put into Prometheus: at most 2K pairs x 3 gauges (K, plus pairs kept
    while they stay among the 2K worst) and the per-rank series on every rank, everything on the
    detail ranks, and the fleet recording rules' outputs."""
    per_rank = 3 * 2 * k + PER_RANK + SCRAPE_META
    return (n - detail_ranks) * per_rank + detail_ranks * (3 * pairs + PER_RANK + SCRAPE_META) + 3 * pairs + 10


def _unix(rfc3339: str) -> float:
    """Seconds since the epoch of Prometheus' RFC 3339 time ("...T04:50:01.123456789Z")."""
    head, _, frac = rfc3339.rstrip("Z").partition(".")
    stamp = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.timezone.utc).timestamp()
    return stamp + (float("0." + frac) if frac else 0.0)


def rules_evaluated_since(prom: Prometheus, t: float, interval_s: float, timeout_s: float) -> None:
    """Waits until every rule group was evaluated after `t` (seconds since the epoch), then once
    more after that (a rule reading another group's output sees it)."""
    deadline = time.monotonic() + timeout_s
    for _ in range(2):
        while True:
            groups = json.loads(http(prom.url + "/api/v1/rules"))["data"]["groups"]
            if groups and all(_unix(g.get("lastEvaluation") or "0001-01-01T00:00:00Z") > t for g in groups):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the rule groups were not evaluated within {timeout_s:.0f} s")
            time.sleep(interval_s / 2)
        t = time.time()


def check_fleet_view(prom: Prometheus, pairs: Sequence[Pair], n: int, args, ready: float) -> dict:
    """PromQL's fleet-wide per-module maximum against the truth over every rank, from rules
    evaluated after `ready` (when every target had been scraped: an evaluation before a rank's
    first scrape lacks that rank's values)."""
    truth = [max(col) for col in zip(*(values(pairs, r, n, args.blocks, args.seed) for r in range(n)))]
    rec = "module_tensor:tensorwatch_tensor_range_used_ratio:max"
    rules_evaluated_since(prom, ready, args.interval, 60)
    deadline = time.monotonic() + 60
    while True:
        got = prom.query(rec)
        cut = prom.query("job:tensorwatch_detail_cutoff_ratio:max")
        if len(got) >= len(pairs) and cut:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"recording rules gave {len(got)} of {len(pairs)} pairs, cutoff {cut}")
        time.sleep(args.interval / 2)
    cutoff = float(cut[0]["value"][1])
    seen = {(r["metric"]["module"], r["metric"]["tensor"]): float(r["value"][1]) for r in got}
    exact = wrong = above_bound = 0
    for (m, _c, t), true in zip(pairs, truth):
        v = seen[("(root)" if m == "" else m, t)]
        if v > true * (1 + 1e-9):
            above_bound += 1  # a value no rank had
        if true > cutoff:
            if abs(v - true) <= 1e-9 * true:
                exact += 1
            else:
                wrong += 1
    hot = (f"model.layers.{args.blocks // 2}.mlp.down_proj", "output")
    hot_q = (f'max without (rank, instance) (tensorwatch_tensor_abs_max{{module="{hot[0]}",tensor="output"}})')
    hot_v = float(prom.query(hot_q)[0]["value"][1])
    return {"pairs": len(pairs), "fleet_cutoff_ratio": cutoff, "pairs_above_cutoff": exact + wrong,
            "pairs_exact_above_cutoff": exact, "pairs_wrong": wrong, "values_above_truth": above_bound,
            "hot_pair_abs_max": hot_v, "hot_pair_expected": 0.6 * FP16_MAX, "hot_rank": hot_rank(n)}


def run_one(n: int, detail: str, detail_ranks: str, rules: Sequence[str], procs: list, pairs: Sequence[Pair],
            base: Dict[str, float], tmp: str, args) -> dict:
    """One configuration: its own Prometheus scraping its workers' endpoints."""
    prom = None
    try:
        targets = targets_of(procs)
        t0 = time.monotonic()
        prom = Prometheus(os.path.join(tmp, f"{detail}-{n}"), targets, args.interval, rules)
        scraped(prom, n, args.scrapes, args.interval, args.timeout)
        ready = time.time()
        m = measure(prom, n, base)
        m["wall_s"] = round(time.monotonic() - t0, 1)
        if rules:
            k = int(detail.split(":")[1])
            nd = len([r for r in detail_ranks.split(",") if r.strip() and int(r) < n])
            m.update(detail=detail, detail_ranks=detail_ranks, budget_series=fleet_budget(n, k, nd, len(pairs)))
            m["view"] = check_fleet_view(prom, pairs, n, args, ready)
            m["head_series"] = int(prom.own()["prometheus_tsdb_head_series"])  # with the rules' outputs
            m["within_budget"] = m["head_series"] <= m["budget_series"]
        print(json.dumps(m), flush=True)
        return m
    finally:
        if prom is not None:
            prom.stop()
        stop_workers(procs)


def run(args) -> dict:
    pairs = model_pairs(args.blocks)
    result = {"model": {"blocks": args.blocks, "pairs": len(pairs), "tensor_series_per_rank": 3 * len(pairs)},
              "scrape_interval_s": args.interval, "scrapes": args.scrapes, "workers": args.workers,
              "prometheus": subprocess.run([PROMETHEUS, "--version"], capture_output=True, text=True)
              .stdout.splitlines()[0], "all": [], "fleet": None}
    runs = [(n, "all", "", ()) for n in args.endpoints]
    if args.fleet_endpoints:
        runs.append((args.fleet_endpoints, args.detail, args.detail_ranks, (FLEET_RULES,)))
    tmp = tempfile.mkdtemp(prefix="tw-series-")
    pools: List[list] = []
    try:
        # every configuration's workers start now: they import torch while the baseline runs
        for n, detail, detail_ranks, _ in runs:
            pools.append(start_workers(n, args.workers, args, detail, detail_ranks))
        base = baseline_memory(tmp, args.interval)
        result["baseline"] = {"rss_bytes": int(base["process_resident_memory_bytes"]),
                              "heap_inuse_bytes": int(base["go_memstats_heap_inuse_bytes"])}
        jobs = [(*r, procs, pairs, base, tmp, args) for r, procs in zip(runs, pools)]
        if args.parallel:  # the configurations side by side, each with its own Prometheus
            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
                measured = list(ex.map(lambda job: run_one(*job), jobs))
        else:
            measured = [run_one(*job) for job in jobs]
        for (_n, _d, _r, rules), m in zip(runs, measured):
            if rules:
                result["fleet"] = m
            else:
                result["all"].append(m)
    finally:
        for procs in pools:
            stop_workers(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    result["extrapolation"] = extrapolate(result, len(pairs), args)
    return result


def extrapolate(result: dict, pairs: int, args) -> dict:
    """Series, Prometheus head memory and ingest at 1k/8k/16k ranks. Series per rank: measured in
    the largest detail="all" run (the label set does not depend on the number of ranks). Bytes per
    series: the Go heap in use, marginal between the smallest and the largest run (fixed costs
    cancel); after a few scrapes, so a lower bound (docs/at-scale.md). Fleet mode: the budget
    (2K pairs per rank at most, one detail rank)."""
    if not result["all"]:
        return {}
    small = min(result["all"], key=lambda m: m["endpoints"])
    big = max(result["all"], key=lambda m: m["endpoints"])
    per_rank_all = big["head_series"] / big["endpoints"]
    if big["head_series"] > small["head_series"]:
        bps = (big["heap_inuse_bytes"] - small["heap_inuse_bytes"]) / (big["head_series"] - small["head_series"])
    else:
        bps = big["heap_bytes_per_series"]
    k = int(args.detail.split(":")[1]) if args.detail.startswith("top:") else 0
    out = {"assumptions": {"series_per_rank_all": round(per_rank_all, 1), "heap_bytes_per_series": round(bps, 1),
                           "fleet": f"detail={args.detail}, one detail rank, the fleet recording rules",
                           "scrape_interval_s": 15}}
    for ranks in (1024, 8192, 16384):
        fleet = fleet_budget(ranks, k, 1, pairs)
        out[str(ranks)] = {"all_series": round(ranks * per_rank_all),
                           "all_heap_gib": round(ranks * per_rank_all * bps / 2**30, 1),
                           "fleet_series": fleet, "fleet_heap_gib": round(fleet * bps / 2**30, 2),
                           "samples_per_s_all": round(ranks * per_rank_all / 15),
                           "samples_per_s_fleet": round(fleet / 15)}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoints", default="16,32,64", help="endpoint counts for the detail=all runs")
    ap.add_argument("--fleet-endpoints", type=int, default=64, help="endpoints of the fleet-mode run (0: none)")
    ap.add_argument("--detail", default="top:16")
    ap.add_argument("--detail-ranks", default="0")
    ap.add_argument("--blocks", type=int, default=80)
    ap.add_argument("--interval", type=float, default=15.0, help="scrape and rule interval, seconds")
    ap.add_argument("--scrapes", type=int, default=3, help="successful scrapes of every target before measuring")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--workers", type=int, default=2, help="processes serving the endpoints")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--parallel", action="store_true", help="measure the configurations side by side (each its own "
                    "Prometheus; --quick does: small ones only, the big ones compete for CPU)")
    ap.add_argument("--quick", action="store_true", help="4 endpoints, fleet 8, 4 blocks, 0.5 s interval")
    ap.add_argument("--json", help="write the figures here")
    # worker role
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", help=argparse.SUPPRESS)
    ap.add_argument("--n-ranks", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.endpoints, args.fleet_endpoints, args.blocks = "4", 8, 4
        args.interval, args.detail, args.timeout, args.workers, args.parallel = 0.5, "top:4", 60.0, 1, True
    args.endpoints = [int(x) for x in str(args.endpoints).split(",") if x.strip()]
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
