"""Where the test suite's time goes: a pytest plugin that records, per test, its wall time, the
worker's own CPU time, the CPU time of the child processes it waited for (torchrun ranks, the
benchmarks' subprocesses, gcc) and inductor's FX graph cache misses and hits; and a summary of
the records by file and by test, with the time a test spent waiting (wall time that neither
the worker nor a waited-for child spent on a CPU: servers' scrape intervals, sleeps, inductor's
compile worker processes); and per worker, how long it stood idle at the end while another still
ran.

    PYTHONPATH=scripts python -m pytest -p suite_profile -n 2 -m "not timing" -q
    python scripts/suite_profile.py                    # the summary (--most N rows each)

The records go to .suite_profile.jsonl in the current folder (TENSORWATCH_SUITE_PROFILE names
another file); each run appends, so remove the file between runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time
from typing import Any, Dict, Iterator, List

PATH_ENV = "TENSORWATCH_SUITE_PROFILE"
DEFAULT_PATH = ".suite_profile.jsonl"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _graph_cache() -> Dict[str, int]:
    """Inductor's FX graph cache counters so far in this process (empty before torch compiled)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    c = utils.counters["inductor"]
    return {"miss": int(c.get("fxgraph_cache_miss", 0)), "hit": int(c.get("fxgraph_cache_hit", 0))}


def _worker(config: Any) -> str:
    """The pytest-xdist worker running the test ("gw0", ...), "main" without xdist (read from the
    session's config: a pytest run by a test inherits the worker's environment, not its role)."""
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput.get("workerid", "main")) if isinstance(workerinput, dict) else "main"


try:
    import pytest
except ImportError:  # the summary needs no pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
        start = time.time()
        wall0, cpu0, child0, cache0 = time.perf_counter(), time.process_time(), _children_cpu(), _graph_cache()
        yield
        cache1 = _graph_cache()
        record = {"id": item.nodeid, "wall": time.perf_counter() - wall0, "cpu": time.process_time() - cpu0,
                  "child": _children_cpu() - child0, "start": start,
                  "worker": _worker(item.config)}
        # (a test that clears dynamo's counters makes these negative: left out)
        record.update({k: max(0, v - cache0.get(k, 0)) for k, v in cache1.items()})
        with open(os.environ.get(PATH_ENV, DEFAULT_PATH), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def summary(records: List[Dict[str, Any]], most: int) -> str:
    for r in records:
        r["waiting"] = max(0.0, r["wall"] - r["cpu"] - r["child"])
    lines = [f"{len(records)} tests: wall {sum(r['wall'] for r in records):.0f} s, own CPU "
             f"{sum(r['cpu'] for r in records):.0f} s, children's CPU {sum(r['child'] for r in records):.0f} s, "
             f"waiting {sum(r['waiting'] for r in records):.0f} s (summed over the workers)"]
    files: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0.0])
    for r in records:
        row = files[r["id"].split("::")[0]]
        for i, key in enumerate(("wall", "cpu", "child", "waiting")):
            row[i] += r[key]
        row[4] += 1
    head = f"{'wall':>7} {'cpu':>7} {'child':>7} {'waiting':>7}"
    lines += ["", f"by file ({min(most, len(files))} of {len(files)}):", f"{head} {'tests':>5}  file"]
    for name, row in sorted(files.items(), key=lambda kv: -kv[1][0])[:most]:
        lines.append(f"{row[0]:7.1f} {row[1]:7.1f} {row[2]:7.1f} {row[3]:7.1f} {int(row[4]):5d}  {name}")
    for key in ("wall", "waiting"):
        lines += ["", f"by test, most {key} ({min(most, len(records))} of {len(records)}):",
                  f"{head} {'miss':>4}  test"]
        for r in sorted(records, key=lambda r: -r[key])[:most]:
            lines.append(f"{r['wall']:7.1f} {r['cpu']:7.1f} {r['child']:7.1f} {r['waiting']:7.1f} "
                         f"{r.get('miss', 0):4d}  {r['id']}")
    lines += _workers(records)
    return "\n".join(lines)


def _workers(records: List[Dict[str, Any]]) -> List[str]:
    """Per worker: its tests, the time it was busy with them and how long it stood idle at the
    end while another worker still ran (records with a start time only)."""
    timed = [r for r in records if "start" in r]
    if not timed:
        return []
    first = min(r["start"] for r in timed)
    last = max(r["start"] + r["wall"] for r in timed)
    per: Dict[str, List[Dict[str, Any]]] = collections.defaultdict(list)
    for r in timed:
        per[r.get("worker", "main")].append(r)
    lines = ["", f"workers (the run: {last - first:.1f} s from the first test's start to the last one's end):"]
    for name in sorted(per):
        mine = per[name]
        end = max(r["start"] + r["wall"] for r in mine)
        lines.append(f"{name:>6} {len(mine):5d} tests, busy {sum(r['wall'] for r in mine):7.1f} s, "
                     f"idle at the end {last - end:6.1f} s")
    return lines


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default=os.environ.get(PATH_ENV, DEFAULT_PATH),
                   help=f"the records ({PATH_ENV} or {DEFAULT_PATH})")
    p.add_argument("--most", type=int, default=25, help="rows per table (default 25)")
    args = p.parse_args(argv)
    if args.most < 1:
        p.error("--most must be >= 1")
    try:
        with open(args.path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError as exc:
        p.error(f"cannot read {args.path}: {exc.strerror} (run the tests with -p suite_profile first)")
    if not records:
        p.error(f"{args.path} holds no record")
    print(summary(records, args.most))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
