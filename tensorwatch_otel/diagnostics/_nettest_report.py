"""Rank 0's verdict for `nettest`: one line per rank from the results in the store, text or JSON.

Ranks that left no result are judged from what the others saw (never joined, missed the barrier)
and from the last stage they recorded.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:g} GiB"


def _blame(res: Dict[str, Any], absent: List[int], missing: List[int]) -> str:
    reason = res.get("reason", "")
    if absent and res["rank"] not in absent:
        return f"blocked: rank(s) {', '.join(map(str, absent))} never joined, so no collective could run"
    if missing and res["rank"] not in missing:
        return (f"blocked: rank(s) {', '.join(map(str, missing))} did not reach the barrier; "
                f"this rank did")
    return reason


def verdicts(results: Dict[int, Dict[str, Any]], stages: Dict[int, str], world_size: int,
             timeout_s: float, rank0: Dict[str, Any],
             joins: Dict[int, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One entry per rank: rank, host, local_rank, status (OK/broken), reason, stage, details.
    `joins` holds the check-in records (host, local_rank) of ranks that joined."""
    absent: List[int] = rank0.get("absent", [])
    missing: List[int] = rank0.get("barrier_missing", [])
    rows = []
    for r in range(world_size):
        res = results.get(r)
        stage = stages.get(r, "never joined")
        if res is not None:
            row = {k: res.get(k) for k in ("rank", "host", "local_rank", "stage", "device", "allreduce",
                                           "bandwidth", "versions", "nccl_log", "nccl_warnings", "duration_s")}
            row["status"] = "OK" if res.get("ok") else "broken"
            row["reason"] = "" if res.get("ok") else _blame(res, absent, missing)
        else:
            if r in absent:
                why = (f"never joined within {timeout_s:g} s: not started, crashed before init, "
                       f"or cannot reach MASTER_ADDR:MASTER_PORT")
            elif r in missing:
                why = f"did not reach the barrier within {timeout_s:g} s (hung or crashed; last stage: {stage})"
            else:
                why = f"no result within {timeout_s:g} s (hung or crashed; last stage: {stage})"
            joined = joins.get(r, {})
            row = {"rank": r, "host": joined.get("host"), "local_rank": joined.get("local_rank"),
                   "stage": stage, "status": "broken", "reason": why}
        rows.append(row)
    return rows


def rank_line(row: Dict[str, Any], world_size: int) -> str:
    tag = f"[{row.get('host') or '?'}-{row['local_rank'] if row.get('local_rank') is not None else '?'}]"
    head = f"{tag} rank {row['rank']}/{world_size} {row['status']}"
    if row["status"] != "OK":
        return f"{head}  {row['reason']}"
    ar = row.get("allreduce") or {}
    detail = f"all_reduce checked (sum {ar.get('sum', 0):g} = {ar.get('expected', 0):g})"
    bw = row.get("bandwidth") or []
    if bw:
        top = bw[-1]
        detail += f", busbw {top['busbw_gbps']:.2f} GB/s at {fmt_bytes(top['bytes'])}"
    return f"{head}  {detail}, {row.get('device', 'cpu')}"


def merge_bandwidth(results: Dict[int, Dict[str, Any]], world_size: int) -> List[Dict[str, Any]]:
    """Per size: the slowest rank's time (a collective ends when its last rank does), summed
    wrong counts; algbw/busbw recomputed from that time."""
    by_size: Dict[int, Dict[str, Any]] = {}
    for res in results.values():
        for row in res.get("bandwidth") or []:
            cur = by_size.setdefault(row["bytes"], {"bytes": row["bytes"], "time_us": 0.0, "wrong": 0, "ranks": 0})
            cur["time_us"] = max(cur["time_us"], row["time_us"])
            cur["wrong"] += row["wrong"]
            cur["ranks"] += 1
    out = []
    factor = 2.0 * (world_size - 1) / world_size
    for size in sorted(by_size):
        cur = by_size[size]
        algbw = size / (cur["time_us"] / 1e6) / 1e9 if cur["time_us"] > 0 else 0.0
        cur.update(algbw_gbps=algbw, busbw_gbps=algbw * factor)
        out.append(cur)
    return out


def version_notes(results: Dict[int, Dict[str, Any]], rank0_versions: Dict[str, Any]) -> List[str]:
    notes = []
    for r, res in sorted(results.items()):
        v = res.get("versions") or {}
        for key in ("torch", "cuda", "nccl"):
            if r != 0 and v.get(key) != rank0_versions.get(key):
                notes.append(f"note: rank {r} has {key} {v.get(key)} but rank 0 has {rank0_versions.get(key)}; "
                             f"mismatched installs across ranks cause hangs and wrong results")
    return notes


def render_text(summary: Dict[str, Any]) -> List[str]:
    ws = summary["world_size"]
    v = summary["versions"]
    lines = [f"nettest: {ws} rank(s) on {summary['hosts']} host(s), backend {summary['backend']}, "
             f"timeout {summary['timeout_s']:g} s",
             f"versions (rank 0): torch {v.get('torch')}, CUDA {v.get('cuda') or 'none (CPU build)'}, "
             f"NCCL {v.get('nccl') or 'n/a'}"]
    lines += summary["notes"]
    if summary["bandwidth"]:
        lines.append("all_reduce bandwidth (float32, slowest rank, busbw = algbw * 2(n-1)/n):")
        lines.append(f"  {'size':>9}  {'time_us':>10}  {'algbw GB/s':>10}  {'busbw GB/s':>10}  {'wrong':>5}")
        for b in summary["bandwidth"]:
            lines.append(f"  {fmt_bytes(b['bytes']):>9}  {b['time_us']:>10.1f}  {b['algbw_gbps']:>10.3f}  "
                         f"{b['busbw_gbps']:>10.3f}  {b['wrong']:>5}")
    for row in summary["ranks"]:
        lines.append(rank_line(row, ws))
        for w in row.get("nccl_warnings") or []:
            lines.append(f"    nccl: {w}")
        if row.get("nccl_log"):
            lines.append(f"    NCCL log: {row['nccl_log']}")
    broken = summary["broken_ranks"]
    if broken:
        causes = summary["cause_ranks"]
        lines.append(f"nettest: FAILED: {len(broken)} of {ws} rank(s) broken ({', '.join(map(str, broken))}); "
                     f"look at rank(s) {', '.join(map(str, causes or broken))} first")
    else:
        lines.append(f"nettest: all {ws} rank(s) OK")
    return lines


def build_summary(results: Dict[int, Dict[str, Any]], stages: Dict[int, str], rank0: Dict[str, Any],
                  joins: Dict[int, Dict[str, Any]], timeout_s: float, backend: str) -> Dict[str, Any]:
    ws = rank0["world_size"]
    rows = verdicts(results, stages, ws, timeout_s, rank0, joins)
    broken = [row["rank"] for row in rows if row["status"] != "OK"]
    causes = [row["rank"] for row in rows if row["status"] != "OK" and not row["reason"].startswith("blocked:")]
    hosts = {j.get("host") for j in joins.values() if j.get("host")}
    return {"ok": not broken, "world_size": ws, "backend": rank0.get("backend") or backend, "timeout_s": timeout_s,
            "hosts": len(hosts) or 1, "versions": rank0.get("versions", {}),
            "notes": version_notes(results, rank0.get("versions", {})),
            "bandwidth": merge_bandwidth(results, ws), "ranks": rows, "broken_ranks": broken,
            "cause_ranks": causes}


def render_json(summary: Dict[str, Any]) -> str:
    return json.dumps(summary, indent=2, sort_keys=True)


def fallback_line(state: Dict[str, Any], note: str, as_json: bool) -> str:
    """What a rank prints for itself when rank 0 cannot print for everyone."""
    row = {k: state.get(k) for k in ("rank", "host", "local_rank", "stage", "device", "allreduce", "bandwidth")}
    row["status"] = "OK" if state.get("ok") else "broken"
    row["reason"] = state.get("reason", "")
    if as_json:
        return json.dumps({"fallback": True, "note": note, **row}, sort_keys=True)
    return f"{rank_line(row, state['world_size'])}  ({note})"

