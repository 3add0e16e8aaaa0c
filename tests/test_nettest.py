"""`nettest` under a real torchrun with gloo over 127.0.0.1: passing runs, injected faults, OTLP export."""

from __future__ import annotations

import json
import re

import pytest

from _diag_launch import OtlpReceiver, attrs, torchrun
from tensorwatch_otel.cli import main
from tensorwatch_otel.diagnostics import _nettest_faults, _nettest_rank, _nettest_report

LINE = re.compile(r"^\[(?P<host>[^\]]+)-(?P<local>\d+|\?)\] rank (?P<rank>\d+)/(?P<ws>\d+) "
                  r"(?P<status>OK|broken)  (?P<rest>.*)$")


def rank_lines(stdout: str) -> dict:
    out = {}
    for line in stdout.splitlines():
        m = LINE.match(line)
        if m:
            assert m["rank"] not in out, f"rank {m['rank']} printed twice:\n{stdout}"
            out[int(m["rank"])] = m
    return out


@pytest.mark.waits
@pytest.mark.slow
def test_two_ranks_pass_and_export_one_span_per_rank():
    with OtlpReceiver() as otlp:
        run = torchrun(2, ["--backend", "gloo", "--size-mb", "0.25", "--timeout", "20"],
                       env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
                            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
        assert run.rc == 0, run.stdout + run.stderr
        lines = rank_lines(run.stdout)
        assert sorted(lines) == [0, 1]
        for r, m in lines.items():
            assert m["status"] == "OK" and m["ws"] == "2" and m["local"] == str(r)
            assert "all_reduce checked (sum 3 = 3)" in m["rest"]
        assert "nettest: all 2 rank(s) OK" in run.stdout
        assert re.search(r"versions \(rank 0\): torch \S+, CUDA none \(CPU build\), NCCL n/a", run.stdout)
        # 1 KiB, 4 KiB, 16 KiB, 64 KiB, 256 KiB in the table, none wrong
        table = re.findall(r"^\s+([\d.]+ [KM]iB)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)$", run.stdout, re.M)
        assert [s for s, _ in table] == ["1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB"]
        assert all(w == "0" for _, w in table)

        spans = [s for s in otlp.spans() if s.name == "tensorwatch.nettest"]
        by_rank = {attrs(s.attributes)["tensorwatch.rank"]: attrs(s.attributes) for s in spans}
        assert sorted(by_rank) == [0, 1]
        assert all(a["tensorwatch.nettest.status"] == "ok" and a["tensorwatch.world_size"] == 2
                   for a in by_rank.values())
        points = otlp.gauge_points("tensorwatch.nettest.busbw")
        seen = {(attrs(p.attributes)["tensorwatch.rank"], attrs(p.attributes)["tensorwatch.nettest.message_size"])
                for p in points}
        assert {(r, 262144) for r in (0, 1)} <= seen
        assert all(p.as_double > 0 for p in points)


@pytest.mark.slow
def test_four_ranks_pass_json():
    run = torchrun(4, ["--backend", "gloo", "--size-mb", "0.0625", "--timeout", "30", "--json"])
    assert run.rc == 0, run.stdout + run.stderr
    doc = json.loads(run.stdout)
    assert doc["ok"] is True and doc["world_size"] == 4 and doc["backend"] == "gloo"
    assert doc["broken_ranks"] == [] and doc["cause_ranks"] == []
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    for r in doc["ranks"]:
        assert r["status"] == "OK" and r["reason"] == ""
        assert r["allreduce"] == {"sum": 10.0, "expected": 10.0, "wrong_slots": []}
        assert [b["bytes"] for b in r["bandwidth"]] == [1024, 4096, 16384, 65536]
    for b in doc["bandwidth"]:
        assert b["ranks"] == 4 and b["wrong"] == 0
        assert b["busbw_gbps"] == pytest.approx(b["algbw_gbps"] * 2 * 3 / 4)
        assert b["algbw_gbps"] == pytest.approx(b["bytes"] / (b["time_us"] / 1e6) / 1e9)


@pytest.mark.slow
def test_wrong_reduced_value_names_the_rank():
    run = torchrun(2, ["--backend", "gloo", "--size-mb", "0.01", "--timeout", "20"],
                   env={"TENSORWATCH_NETTEST_FAULT": "wrong_value:1"})
    assert run.rc == 1, run.stdout + run.stderr
    lines = rank_lines(run.stdout)
    assert lines[0]["status"] == "OK"
    assert lines[1]["status"] == "broken"
    assert lines[1]["rest"] == "all_reduce returned sum 4, expected 3 (slot of rank 0 holds 2, expected 1)"
    assert "FAILED: 1 of 2 rank(s) broken (1); look at rank(s) 1 first" in run.stdout


@pytest.mark.waits
@pytest.mark.slow
def test_rank_that_never_joins_is_reported_within_the_timeout():
    run = torchrun(2, ["--backend", "gloo", "--size-mb", "0.01", "--timeout", "6", "--json"],
                   env={"TENSORWATCH_NETTEST_FAULT": "absent:1"})
    assert run.rc == 1, run.stdout + run.stderr
    assert run.wall_s < 35, f"took {run.wall_s:.1f} s"
    doc = json.loads(run.stdout)
    assert doc["ok"] is False and doc["broken_ranks"] == [0, 1] and doc["cause_ranks"] == [1]
    r0, r1 = doc["ranks"]
    assert r0["reason"] == "blocked: rank(s) 1 never joined, so no collective could run"
    assert r1["stage"] == "never joined" and r1["host"] is None
    assert r1["reason"].startswith("never joined within 6 s")


@pytest.mark.waits
@pytest.mark.slow
def test_rank_that_hangs_is_named_by_the_barrier():
    run = torchrun(2, ["--backend", "gloo", "--size-mb", "0.01", "--timeout", "5"],
                   env={"TENSORWATCH_NETTEST_FAULT": "hang:1"})
    assert run.rc == 1, run.stdout + run.stderr
    assert run.wall_s < 30, f"took {run.wall_s:.1f} s"
    lines = rank_lines(run.stdout)
    assert lines[0]["status"] == "broken"
    assert lines[0]["rest"] == "blocked: rank(s) 1 did not reach the barrier; this rank did"
    assert lines[1]["status"] == "broken" and lines[1]["local"] == "1"  # host known from its check-in
    assert lines[1]["rest"] == "did not reach the barrier within 5 s (hung or crashed; last stage: barrier)"


def test_sweep_sizes_and_bus_factor():
    assert _nettest_rank.sweep_sizes(1 << 20) == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert _nettest_rank.sweep_sizes(5000) == [1024, 4096, 5000]
    assert _nettest_rank.sweep_sizes(100) == [100]
    assert _nettest_rank.bus_factor(2) == 1.0
    assert _nettest_rank.bus_factor(8) == pytest.approx(1.75)


def test_scan_nccl_log_keeps_the_lines_people_grep_for(tmp_path):
    log = tmp_path / "nccl-host-rank0.log"
    log.write_text(
        "host:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>\n"
        "host:1:1 [0] NCCL INFO NET/IB : No device found.\n"
        "host:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>\n"
        "host:1:1 [0] NCCL INFO comm 0x1 rank 0 nranks 2\n"
        "host:1:9 [0] misc/socket.cc:47 NCCL WARN socketProgress: Connection closed by remote peer\n")
    hits = _nettest_rank.scan_nccl_log(str(log))
    lines = log.read_text().splitlines()
    assert hits == [lines[1], lines[2], lines[4]]
    assert _nettest_rank.scan_nccl_log(str(tmp_path / "missing.log")) == []


def test_nccl_debug_sets_a_file_per_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    launch = _nettest_rank.Launch(3, 4, 1, "127.0.0.1", 1, "node7")
    path = _nettest_rank.enable_nccl_debug(str(tmp_path / "logs"), launch)
    import os

    assert os.environ["NCCL_DEBUG"] == "INFO"
    assert os.environ["NCCL_DEBUG_FILE"] == path == str(tmp_path / "logs" / "nccl-node7-rank3.log")


def test_fault_spec_parsing():
    f = _nettest_faults.parse_faults({"TENSORWATCH_NETTEST_FAULT": "hang:2,wrong_value:0"})
    assert f.has("hang", 2) and f.has("wrong_value", 0) and not f.has("hang", 0)
    with pytest.raises(ValueError, match="TENSORWATCH_NETTEST_FAULT"):
        _nettest_faults.parse_faults({"TENSORWATCH_NETTEST_FAULT": "explode:1"})


def test_rank0_missing_result_is_judged_from_its_stage():
    rank0 = {"world_size": 3, "absent": [], "barrier_missing": [], "ok": True, "rank": 0, "host": "a",
             "local_rank": 0, "allreduce": {"sum": 6.0, "expected": 6.0}, "bandwidth": [], "device": "cpu"}
    rows = _nettest_report.verdicts({0: rank0}, {0: "done", 1: "bandwidth 4096"}, 3, 5.0, rank0,
                                    {1: {"host": "b", "local_rank": 1}})
    assert [r["status"] for r in rows] == ["OK", "broken", "broken"]
    assert rows[1]["reason"] == "no result within 5 s (hung or crashed; last stage: bandwidth 4096)"
    assert rows[1]["host"] == "b"
    assert rows[2]["stage"] == "never joined"


@pytest.mark.parametrize("argv, message", [
    (["--size-mb", "0"], "--size-mb must be > 0"),
    (["--size-mb", "-3"], "--size-mb must be > 0"),
    (["--timeout", "soon"], "--timeout must be a number"),
    (["--backend", "mpi"], "invalid choice: 'mpi'"),
])
def test_bad_options_name_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["nettest", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_launch_variables_give_one_error_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["nettest", "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorwatch-otel nettest: error: RANK/WORLD_SIZE/LOCAL_RANK/MASTER_PORT must be integers")
    assert err.count("\n") == 1
