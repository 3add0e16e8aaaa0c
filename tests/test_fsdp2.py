"""FSDP2 (`torch.distributed.fsdp.fully_shard`) under a real torchrun (gloo, CPU, 2 ranks):
per-rank statistics of each rank's local shard under the user's parameter and class names, and
an inf in one rank's shard detected as that rank's `weight`."""

from __future__ import annotations

import pytest

from test_fleet_stop import events_of, launch

pytest.importorskip("torch.distributed.fsdp")


def _trace_frames(tmp_path, rank, batch):
    traces = [e for e in events_of(tmp_path, rank) if e.event == "batch_trace" and e.batch_number == batch]
    assert len(traces) == 1
    return {f.module: f for f in traces[0].frames}


def _stat(frame, name):
    return next(t for t in frame.tensors if t.name == name)


@pytest.mark.slow
@pytest.mark.parametrize("watch_first", [False, True], ids=["watch-after-fully_shard", "watch-before"])
def test_fsdp2_statistics_under_the_users_names(tmp_path, watch_first):
    args = ["--mode", "fsdp2", "--batches", "3", "--trace", "1"] + (["--watch-first"] if watch_first else [])
    proc, results, _ = launch(tmp_path, 2, *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    frames = {r: _trace_frames(tmp_path, r, 1) for r in results}
    for r, res in results.items():
        assert res["param_names"] == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
        assert "FSDPLinear" in res["module_classes"]  # fully_shard did swap the classes...
        fr = frames[r]
        assert list(fr) == ["layers.0", "layers.1", ""]  # ...but paths stay the user's
        assert [f.module_class for f in fr.values()] == ["Linear", "Linear", "Net"]  # and so do the classes
        # fully_shard after watch() gave the layers new (DTensor) parameters: found again once, then stable
        assert res["param_scans"] == (2 if watch_first else 1)
    local = {r: res["local_abs_max"]["1"] for r, res in results.items()}
    for r in results:
        for name, expected in local[r].items():
            path, tensor = name.rsplit(".", 1)
            got = _stat(frames[r][path], tensor).abs_max
            if watch_first:
                # our hooks run before FSDP's reshard: the full, all-gathered weight on every rank
                assert got == pytest.approx(max(local[q][name] for q in results), rel=1e-6)
            else:
                # after fully_shard: what this rank holds, its local shard
                assert got == pytest.approx(expected, rel=1e-6)
    if not watch_first:  # the shards differ, so the ranks report different weight statistics
        assert any(local[0][n] != local[1][n] for n in local[0])


@pytest.mark.slow
def test_fsdp2_inf_in_one_ranks_shard_is_that_ranks_weight(tmp_path):
    at = 3
    proc, results, _ = launch(tmp_path, 2, "--mode", "fsdp2", "--inject", "shard", "--bad", "1", "--at", str(at))
    bad, other = results[1], results[0]
    # the rank holding the inf sees it in its shard of layers.0.weight
    assert (bad["event"], bad["module"], bad["module_class"], bad["tensor"], bad["kind"], bad["batch_number"]) == \
        ("nonfinite_detected", "layers.0", "Linear", "weight", "inf", at)
    # the all-gathered weight carries the inf to rank 0, whose shard is finite: its output is not
    assert (other["event"], other["module"], other["tensor"], other["batch_number"]) == \
        ("nonfinite_detected", "layers.0", "output", at)
    # both stopped together, after the step's collectives, agreeing on the first rank
    assert bad["first_rank"] == other["first_rank"] in (0, 1)
    assert bad["batches_done"] == other["batches_done"] == at
    assert abs(bad["time"] - other["time"]) < 10.0


@pytest.mark.slow
def test_fsdp2_linears_inside_a_sharded_module_are_measured_whole_on_every_rank(tmp_path):
    """fully_shard on the model alone: its Linears run while it is unsharded, so every rank
    measures their full, all-gathered weights (the same on each rank), and an inf in rank 1's
    shard is named `weight` by both ranks, rank 0's shard being finite (docs/telemetry.md)."""
    proc, results, _ = launch(tmp_path, 2, "--mode", "fsdp2", "--shard", "root", "--batches", "3", "--trace", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    local = {r: res["local_abs_max"]["1"] for r, res in results.items()}
    assert any(local[0][n] != local[1][n] for n in local[0])  # the shards differ...
    for r in results:
        frames = _trace_frames(tmp_path, r, 1)
        for name in local[r]:
            path, tensor = name.rsplit(".", 1)
            whole = max(local[q][name] for q in results)
            assert _stat(frames[path], tensor).abs_max == pytest.approx(whole, rel=1e-6)  # ...the figures do not
    at = 2
    (tmp_path / "inf").mkdir()
    proc, results, _ = launch(tmp_path / "inf", 2, "--mode", "fsdp2", "--shard", "root", "--inject", "shard",
                              "--bad", "1", "--at", str(at))
    for res in results.values():
        assert (res["event"], res["module"], res["tensor"], res["kind"], res["batch_number"]) == \
            ("nonfinite_detected", "layers.0", "weight", "inf", at)
    assert results[0]["first_rank"] == results[1]["first_rank"] in (0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("watch_first", [False, True], ids=["watch-after-fully_shard", "watch-before"])
def test_fsdp2_inf_gradient_is_named_by_the_step_guard_whenever_watch_ran(tmp_path, watch_first):
    # watch() before fully_shard: the DTensor parameters fully_shard made are found again, so the
    # step guard covers the optimizer built on them, as it does when watch() comes after
    args = ["--mode", "fsdp2", "--inject", "grad", "--bad", "1", "--at", "3"]
    args += ["--watch-first"] if watch_first else []
    proc, results, _ = launch(tmp_path, 2, *args)
    for res in results.values():
        assert (res["event"], res["module"], res["tensor"], res["kind"], res["batch_number"]) == \
            ("nonfinite_detected", "layers.1", "bias.grad", "inf", 3), proc.stderr[-4000:]
        assert res["param_scans"] == (2 if watch_first else 1)
