"""Stop together: under a real `python -m torch.distributed.run` (gloo on 127.0.0.1) a
detection on one rank stops every rank at the same safe point, each raising NonFiniteDetected
that names the first rank, while the detecting rank lingers (as a Prometheus sink would)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _diag_launch import clean_env
from _observed import read_observed
from conftest import free_port
from tensorwatch_otel.core.events import StoppedByRankEvent
from tensorwatch_otel.report.codec import from_dict, read_events, to_dict
from tensorwatch_otel.report.text import stopped_line

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "_dist_train.py"
LINGER_S = 30.0  # the detecting rank stays alive this long after its raise
PG_TIMEOUT_S = 60.0  # the script's process group timeout: a rank left in a collective would wait this long


def launch(tmp_path: Path, nproc: int, *args: str, timeout: float = 240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), str(tmp_path), *args]
    env = clean_env({"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(tmp_path))
    ended = time.time()
    return proc, dict(enumerate(read_observed(tmp_path, nproc, proc))), ended


def launch_nodes(tmp_path: Path, nnodes: int, nproc: int, *args: str, timeout: float = 240):
    """`nnodes` torchrun agents on 127.0.0.1 (static rendezvous, node ranks 0..nnodes-1), as
    `nnodes` machines of `nproc` ranks would run: LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK real."""
    port = str(free_port())
    env = clean_env({"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    procs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node",
               str(nproc), "--node-rank", str(node), "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
               "--master-port", port, str(SCRIPT), str(tmp_path), *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=str(tmp_path)))
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    ended = time.time()
    run = subprocess.CompletedProcess(procs[0].args, max(p.returncode for p in procs),
                                      "".join(o for o, _ in outs), "".join(e for _, e in outs))
    return run, dict(enumerate(read_observed(tmp_path, nnodes * nproc, run))), ended


def events_of(tmp_path: Path, rank: int):
    return read_events(str(tmp_path / f"events-{rank}.jsonl"))


def raw_lines(tmp_path: Path, rank: int):
    return [json.loads(line) for line in (tmp_path / f"events-{rank}.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("bad", [2, 0])
def test_ddp_overflow_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, bad):
    at = 4
    proc, results, ended = launch(tmp_path, 3, "--mode", "ddp", "--bad", str(bad), "--at", str(at),
                                  "--linger", str(LINGER_S))
    assert proc.returncode != 0  # the job failed, as it should
    det = results[bad]
    assert det["event"] == "nonfinite_detected" and det["first_rank"] == bad
    assert (det["module"], det["module_class"], det["tensor"], det["kind"], det["batch_number"]) == \
        ("layers.0", "Linear", "input[0]", "inf", at)
    # the detecting rank took part in the step's all-reduce and raised at its optimizer step
    assert det["batches_done"] == at
    detected_at = [e for e in events_of(tmp_path, bad) if e.event == "nonfinite_detected"][0].time
    for r, res in results.items():
        assert res["stopped"], res
        assert res["first_rank"] == bad
        assert (res["module"], res["tensor"], res["batch_number"]) == ("layers.0", "input[0]", at)
        assert f"rank {bad}" in res["message"] or r == bad
        if r != bad:
            assert res["event"] == "stopped_by_rank"
            assert at <= res["stopped_at_batch"] <= at + 1  # within two batches (here: the same step)
            assert res["batches_done"] == at
        # nobody waited for the collective timeout, nor for the detecting rank's linger
        assert res["time"] - detected_at < 10.0
    assert ended < detected_at + LINGER_S, "the launcher waited for the lingering detecting rank"
    assert ended - detected_at < PG_TIMEOUT_S
    # JSON lines: every rank carries first_rank; only the detecting rank counts a detection
    for r in results:
        lines = raw_lines(tmp_path, r)
        kinds = [d["event"] for d in lines]
        if r == bad:
            assert kinds == ["nonfinite_detected"]
        else:
            assert kinds == ["stopped_by_rank"]
            assert lines[0]["stopped_at_batch"] == at and lines[0]["frames"] == []
        assert all(d["first_rank"] == bad and d["rank"] == r for d in lines)
    # the stopped ranks' text report says who stopped them
    assert f"rank {bad} detected inf in layers.0 Linear input[0] during batch_number={at}" in proc.stderr


@pytest.mark.slow
def test_two_ranks_detect_in_the_same_step_the_first_publisher_wins(tmp_path):
    at = 3
    proc, results, _ = launch(tmp_path, 4, "--mode", "ddp", "--bad", "1,2", "--at", str(at), "--linger", "0")
    first = results[1]["first_rank"]
    assert first in (1, 2)
    for r, res in results.items():
        assert res["stopped"] and res["first_rank"] == first
        assert res["event"] == ("nonfinite_detected" if r in (1, 2) else "stopped_by_rank"), res
        assert res["batches_done"] == at
    # each detecting rank counts its own detection, with the winner as first_rank
    for r in (1, 2):
        dets = [e for e in events_of(tmp_path, r) if e.event == "nonfinite_detected"]
        assert [(e.rank, e.first_rank, e.batch_number) for e in dets] == [(r, first, at)]
    for r in (0, 3):
        assert [e.event for e in events_of(tmp_path, r)] == ["stopped_by_rank"]


@pytest.mark.slow
@pytest.mark.parametrize("batches", [6, 3], ids=["next-batch", "last-batch"])
def test_loop_without_optimizer_step_stops_at_the_next_batch_start(tmp_path, batches):
    """Evaluation with an all-reduce per batch: no optimizer step, so every rank stops when the
    next batch starts, after the detection batch's collective; when the detection batch is the
    last one, when the watcher's with-block ends."""
    at = 2
    proc, results, _ = launch(tmp_path, 3, "--mode", "eval", "--bad", "1", "--at", str(at), "--linger", "0",
                              "--batches", str(batches))
    for r, res in results.items():
        assert res["stopped"] and res["first_rank"] == 1, res
        assert res["batches_done"] == at + 1  # batch `at` ran to its end, all-reduce included
        if r != 1:
            assert res["stopped_at_batch"] == at + 1


@pytest.mark.slow
def test_gradient_detection_stops_every_rank_one_step_later(tmp_path):
    """gradients=True, rank 2's gradients turn inf in batch 3 (its forward stays finite): the
    detection comes at the end of its backward, after the all-reduce the other ranks may already
    have left, so the common stop point is the next batch's optimizer step. Nobody hangs."""
    at = 3
    proc, results, _ = launch(tmp_path, 3, "--mode", "ddp", "--inject", "grad", "--gradients", "--bad", "2",
                              "--at", str(at), "--linger", "0")
    det = results[2]
    assert det["event"] == "nonfinite_detected" and det["batch_number"] == at and det["tensor"].endswith(".grad")
    first = [d for d in raw_lines(tmp_path, 2) if d["event"] == "nonfinite_detected"][0]
    assert first["frames"][-1]["phase"] == "backward"
    # The step of batch `at` consumed the gradients, so every rank also sees the nan weights in
    # the next forward; whoever published first is first_rank, and all ranks agree on it.
    firsts = {res["first_rank"] for res in results.values()}
    assert len(firsts) == 1, results
    for res in results.values():
        assert res["stopped"], res
        assert res["batches_done"] == at + 1  # stopped at the optimizer step of batch at + 1


@pytest.mark.slow
def test_report_mode_stops_nobody_and_names_the_first_rank(tmp_path):
    """on_detect="report": training goes on everywhere, nothing is checked per step, and the
    detections still carry the rank that detected first."""
    at, batches = 2, 5
    proc, results, _ = launch(tmp_path, 3, "--mode", "ddp", "--bad", "2", "--at", str(at), "--batches", str(batches),
                              "--on-detect", "report")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r, res in results.items():
        assert not res.get("stopped") and res["batches_done"] == batches and res["polls"] == 0, res
        events = events_of(tmp_path, r)
        assert all(e.event == "nonfinite_detected" and e.first_rank == 2 for e in events), events
    first = events_of(tmp_path, 2)[0]
    assert (first.batch_number, first.module, first.tensor) == (at, "layers.0", "input[0]")


@pytest.mark.slow
def test_no_detection_no_stop(tmp_path):
    proc, results, _ = launch(tmp_path, 2, "--mode", "ddp", "--batches", "6")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert all(not res.get("stopped") and res["batches_done"] == 6 for res in results.values())
    # The node's leader (local rank 0) makes one store check per optimizer step, plus the first
    # batch's start (no step seen yet) and the end; the other rank reads the leader's answers for
    # the same safe points and asks the store only at the end.
    leader, other = results[0], results[1]
    assert (leader["local_rank"], other["local_rank"]) == (0, 1)
    assert leader["polls"] == 6 + 2 and leader["node_reads"] == 0
    assert other["polls"] == 1 and other["node_reads"] == 6 + 1


def test_stopped_by_rank_event_round_trips_and_renders():
    ev = StoppedByRankEvent(batch_number=4, rank=0, first_rank=2, module="layers.0", module_class="Linear",
                            tensor="input[0]", kind="inf", time=1_800_000_000.25, stopped_at_batch=5)
    d = to_dict(ev)
    assert d["event"] == "stopped_by_rank" and d["first_rank"] == 2 and d["stopped_at_batch"] == 5
    assert d["frames"] == [] and d["rank"] == 0
    back = from_dict(json.loads(json.dumps(d)))
    assert back == ev
    assert stopped_line(ev) == ("tensorwatch_otel: rank 0 stopped at batch_number=5: rank 2 detected inf in "
                                "layers.0 Linear input[0] during batch_number=4\n")


def test_single_process_raises_at_once(tmp_path):
    """Outside torch.distributed nothing changes: the detecting forward raises."""
    import torch

    from tensorwatch_otel import NonFiniteDetected, watch

    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    x = torch.ones(1, 3)
    x[0, 0] = float("inf")
    with watch(model, sinks=[]) as w:
        with pytest.raises(NonFiniteDetected) as info:
            model(x)
        assert info.value.event.first_rank == 0 and info.value.event.rank == 0
        assert w._session.fleet.polls == 0


def test_report_command_renders_a_stopped_rank(tmp_path, capsys):
    from tensorwatch_otel.cli import main
    from tensorwatch_otel.sinks import JsonlLog

    ev = StoppedByRankEvent(batch_number=7, rank=3, first_rank=1, module="", module_class="Net",
                            tensor="output", kind="nan", time=1_800_000_000.0, stopped_at_batch=8)
    log = JsonlLog(str(tmp_path / "ev.jsonl"))
    log.on_event(ev)
    log.close()
    assert main(["report", str(tmp_path / "ev.jsonl"), "--event", "stopped_by_rank"]) == 0
    assert capsys.readouterr().out == ("tensorwatch_otel: rank 3 stopped at batch_number=8: rank 1 detected nan "
                                       "in (root) Net output during batch_number=7\n")


@pytest.mark.slow
@pytest.mark.parametrize("straggler", [0, 1], ids=["detecting-rank-straggles", "healthy-rank-straggles"])
def test_no_sync_accumulation_stops_every_rank_at_the_optimizer_step(tmp_path, straggler):
    """DDP gradient accumulation: micro-batches 0-2 under no_sync(), micro-batch 3 all-reduces,
    then the optimizer step. Rank 0's input overflows in micro-batch 1; one rank sleeps 3 s
    before that micro-batch, so the ranks are far apart where nothing synchronises them. No
    micro-batch start is a common point: every rank stops at the optimizer step after the
    sync micro-batch's all-reduce, naming rank 0; nobody fails in a collective."""
    accum, at, nap = 4, 1, 3.0
    t0 = time.time()
    proc, results, ended = launch(tmp_path, 2, "--mode", "ddp", "--accum", str(accum), "--bad", "0",
                                  "--at", str(at), "--batches", "8", "--linger", "0",
                                  "--straggle", f"{straggler}:{at}:{nap}")
    for r, res in results.items():
        assert "error" not in res, res["error"]
        assert res["stopped"] and res["first_rank"] == 0, res
        assert (res["module"], res["tensor"], res["batch_number"]) == ("layers.0", "input[0]", at)
        assert res["batches_done"] == accum - 1, res  # raised in the step after micro-batch 3
        assert res["event"] == ("nonfinite_detected" if r == 0 else "stopped_by_rank")
        if r == 1:
            assert res["stopped_at_batch"] == accum - 1
    assert "Connection closed" not in proc.stderr
    assert ended - t0 < PG_TIMEOUT_S


@pytest.mark.slow
def test_two_nodes_stop_together_naming_the_first_rank(tmp_path):
    """Two torchrun agents on 127.0.0.1 as two nodes of two ranks: rank 3 (node 1's second rank,
    which never asks the store itself) detects at batch 4; every rank stops at that step."""
    at = 4
    proc, results, ended = launch_nodes(tmp_path, 2, 2, "--mode", "ddp", "--bad", "3", "--at", str(at),
                                        "--linger", "0")
    assert [(r["node"], r["local_rank"]) for r in results.values()] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    detected_at = [e for e in events_of(tmp_path, 3) if e.event == "nonfinite_detected"][0].time
    for r, res in results.items():
        assert "error" not in res, res["error"]
        assert res["stopped"] and res["first_rank"] == 3, res
        assert (res["module"], res["tensor"], res["batch_number"]) == ("layers.0", "input[0]", at)
        assert res["event"] == ("nonfinite_detected" if r == 3 else "stopped_by_rank")
        assert res["batches_done"] == at  # within two batches: here the detection's own step
        if r != 3:
            assert res["stopped_at_batch"] == at
        assert res["time"] - detected_at < 10.0
        # only the nodes' leaders ask the store at the safe points
        assert (res["polls"] > 0) == (res["local_rank"] == 0), res
    # one shared file per node, and none left behind although torchrun killed the ranks
    files = {res["node"]: res["node_file"] for res in results.values()}
    assert len(set(files.values())) == 2 and all(files.values())
    assert not any(os.path.exists(f) for f in files.values())


@pytest.mark.slow
@pytest.mark.parametrize("nnodes,nproc", [(1, 4), (2, 2), (4, 1)], ids=["1x4", "2x2", "4x1"])
def test_store_checks_per_step_follow_the_nodes_not_the_ranks(tmp_path, nnodes, nproc):
    """Four ranks each time: the store checks per optimizer step (all ranks together, batches 1
    to 5, one optimizer step each) equal the number of nodes."""
    batches = 6
    proc, results, _ = launch_nodes(tmp_path, nnodes, nproc, "--mode", "ddp", "--batches", str(batches))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(results) == 4
    per_step = sum(r["polls_by_batch"][-1] - r["polls_by_batch"][0] for r in results.values()) / (batches - 1)
    assert per_step == nnodes, [r["polls_by_batch"] for r in results.values()]
    # the other ranks' answers came from their leader
    assert all(r["node_reads"] >= batches for r in results.values() if r["local_rank"] > 0)


# ---------------------------------------------------------------- one node's ranks, in one process
# Two FleetStop objects stand for a node's leader (LOCAL_RANK 0) and its second rank, against a
# real TCPStore served in this process (dropped to make the store fail).

@pytest.fixture
def store_server():
    import torch.distributed as dist

    server = {"store": dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)}
    yield server, server["store"].port
    server.clear()


def _node(monkeypatch, port):
    import datetime
    import itertools

    import torch.distributed as dist

    from tensorwatch_otel.core import fleet, fleet_node

    monkeypatch.setattr(fleet, "_dist", lambda: dist)
    monkeypatch.setattr(fleet, "NODE_WAIT_S", 1.0)  # a wait for the leader's answer
    monkeypatch.setattr(fleet_node, "NODE_WAIT_S", 1.0)  # a wait for the leader's file
    stores = {}

    def store():  # one client per simulated rank, as each process has its own
        return stores[os.environ["LOCAL_RANK"]]

    monkeypatch.setattr(fleet, "_store", store)
    batch = {"n": 0}
    emitted = []
    ranks = []
    for local in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("GROUP_RANK", "0")
        stores[local] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        monkeypatch.setattr(fleet_node, "NODE_FILES", itertools.count())  # each process counts its own
        fs = fleet.FleetStop(emitted.append, lambda: batch["n"])
        fs.at_batch_start()  # opens the node's file (the leader first: the other waits for its name)
        ranks.append(fs)
    return fleet, ranks, batch, emitted, stores


def _as_rank(monkeypatch, local, call):
    monkeypatch.setenv("LOCAL_RANK", local)
    return call()


def test_a_nodes_second_rank_reads_the_leaders_answers_and_its_stop(monkeypatch, store_server):
    from tensorwatch_otel import NonFiniteDetected

    _, port = store_server
    fleet, (leader, other), batch, emitted, stores = _node(monkeypatch, port)
    assert leader._node.leader and not other._node.leader
    for b in range(1, 4):  # batches 0..2 run, an optimizer step after each
        batch["n"] = b
        _as_rank(monkeypatch, "0", leader.at_optimizer_step)
        _as_rank(monkeypatch, "1", other.at_optimizer_step)
    assert (leader.polls, other.polls, other.node_reads) == (4, 0, 4)
    # another node's rank publishes a forward detection in batch 3
    record = {"rank": 5, "batch_number": 3, "phase": "forward", "module": "layers.0", "module_class": "Linear",
              "tensor": "input[0]", "kind": "inf", "time": 0.0}
    stores["0"].compare_set(fleet.STORE_KEY, "", json.dumps(record))
    batch["n"] = 4  # the step of batch 3: both stop there, the second rank from the leader's answer
    with pytest.raises(NonFiniteDetected) as a:
        _as_rank(monkeypatch, "0", leader.at_optimizer_step)
    with pytest.raises(NonFiniteDetected) as b:
        _as_rank(monkeypatch, "1", other.at_optimizer_step)
    for info in (a, b):
        ev = info.value.event
        assert (ev.event, ev.first_rank, ev.batch_number, ev.stopped_at_batch) == ("stopped_by_rank", 5, 3, 3)
    assert (other.polls, other.node_reads) == (0, 5)


def test_a_node_whose_store_fails_stops_alone(monkeypatch, store_server):
    """The store's server dies: the leader logs it and leaves; the second rank asks the store
    itself, fails too, and both go back to raising a detection at once."""
    server, port = store_server
    fleet, (leader, other), batch, _, _ = _node(monkeypatch, port)
    server.clear()  # the server goes with its store object
    gc.collect()
    batch["n"] = 1
    _as_rank(monkeypatch, "0", leader.at_optimizer_step)
    assert leader._failed and not leader.active()
    _as_rank(monkeypatch, "1", other.at_optimizer_step)  # the leader is gone: asks the store, fails
    assert other._failed and other._node is False and other.polls == 1
    assert not other.defer(object())  # a detection raises on its own rank at once


def test_a_silent_leader_sends_its_node_back_to_the_store(monkeypatch, store_server):
    """A leader that stops answering (here: never reaches the safe point) costs its node's
    ranks one bounded wait, then they ask the store themselves."""
    _, port = store_server
    fleet, (leader, other), batch, _, _ = _node(monkeypatch, port)
    batch["n"] = 1
    t0 = time.monotonic()
    _as_rank(monkeypatch, "1", other.at_optimizer_step)
    assert 0.9 < time.monotonic() - t0 < 10
    assert other._node is False and other.polls == 1 and not other._failed
