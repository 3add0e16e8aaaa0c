"""The optimizer-step guard (default on): the gradients a step will consume are checked in one
read before it runs; a non-finite one stops the run before the weights change, named as the
parameter's gradient. GradScaler's skipped steps stay skips, numbered like gradients=True
numbers them, every one counted."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from _collect import Collect
from _models import TwoLinear as Net
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch
from tensorwatch_otel.core.config import ConfigError
from tensorwatch_otel.core.events import SkippedStepEvent

INF = float("inf")


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before):
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("poison", ["times_inf", "log_zero"])
def test_inf_born_in_the_loss_stops_at_the_step_naming_a_gradient(poison):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    with watch(model, sinks=[sink]):  # default options: gradients are not watched
        out = model(torch.randn(4, 8))
        bad = torch.tensor(INF) if poison == "times_inf" else -torch.log(torch.zeros(()))
        (out.sum() * bad).backward()  # born in the loss, outside every module
        assert sink.of(NonFiniteEvent) == []  # the forward was healthy
        before = _weights(model)
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
        assert _unchanged(model, before)  # stopped before the step wrote anything
    ev = ei.value.event
    # the parameter nearest the loss whose gradient is bad: b's bias (backward order)
    assert (ev.module, ev.tensor, ev.phase, ev.batch_number) == ("b", "bias.grad", "backward", 0)
    assert ev.kind in ("inf", "nan", "inf,nan")
    assert sink.of(NonFiniteEvent) == [ev]
    grads = [t.name for f in ev.frames for t in f.tensors]
    assert grads and all(n.endswith(".grad") for n in grads)


def test_a_healthy_step_goes_through_and_a_later_bad_one_is_named():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    x = torch.randn(4, 8)
    with watch(model, sinks=[sink]) as w:
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        opt.zero_grad()
        model(x).sum().backward()
        with torch.no_grad():
            model.a.weight.grad[2, 3] = float("nan")  # only a's weight gradient is bad
        before = _weights(model)
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
        assert _unchanged(model, before)
        assert w.batch_number == 4
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind, ev.batch_number) == ("a", "weight.grad", "nan", 3)


def test_transformers_gpt2_inf_in_the_loss_names_a_gradient_not_the_embedding_weight():
    pytest.importorskip("transformers")
    from _hf import tiny_gpt2

    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    sink = Collect()
    with watch(model, sinks=[sink]):
        loss = model(input_ids=ids, labels=ids).loss
        (loss * torch.tensor(INF)).backward()
        before = _weights(model)
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
        assert _unchanged(model, before)
    ev = ei.value.event
    assert ev.tensor.endswith(".grad") and ev.phase == "backward"
    assert (ev.module, ev.tensor) != ("transformer.wte", "weight")
    assert ev.module == "transformer.ln_f"  # the last parameters before the loss (lm_head is tied to wte)


def test_guard_off_lets_the_step_write_nan_into_the_weights():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    with watch(model, sinks=[sink], guard_steps=False, on_detect="report"):
        (model(torch.randn(4, 8)).sum() * INF).backward()
        opt.step()  # not checked: the symptom shows in the next batch's weights
        model(torch.randn(4, 8))
    (ev,) = sink.of(NonFiniteEvent)
    assert ev.phase == "forward" and ev.tensor == "weight" and ev.batch_number == 1


def test_guard_variable_and_its_validation(monkeypatch):
    monkeypatch.setenv("TENSORWATCH_GUARD_STEPS", "off")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, sinks=[Collect()]) as w:
        assert w.config.guard_steps is False
        (model(torch.randn(4, 8)).sum() * INF).backward()
        opt.step()  # no guard
    with watch(model, sinks=[Collect()], guard_steps=True) as w:  # the argument wins
        assert w.config.guard_steps is True
    monkeypatch.setenv("TENSORWATCH_GUARD_STEPS", "maybe")
    with pytest.raises(ConfigError, match="TENSORWATCH_GUARD_STEPS"):
        watch(model, sinks=[Collect()])
    monkeypatch.delenv("TENSORWATCH_GUARD_STEPS")
    with pytest.raises(ConfigError, match="guard_steps"):
        watch(model, sinks=[Collect()], guard_steps="yes")


def test_guard_reads_once_per_step_and_not_with_gradients_true(monkeypatch):
    """One host read per guarded step; gradients=True localizes in backward, no guard on top.
    (The device path: on a CPU with the compiled kernel the guard reads no tensor at all,
    tests/test_sync_count.py::test_the_cpu_kernel_path_transfers_nothing.)"""
    from _op_counts import torch_ops_path
    from test_sync_count import SyncCounter

    torch_ops_path(monkeypatch)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    for gradients, expected in ((False, 1), (True, 0)):
        with watch(model, sinks=[Collect()], gradients=gradients) as w:
            model(x).square().mean().backward()
            with SyncCounter() as c:
                opt.step()
            opt.zero_grad()
        assert (c.scalar + c.cpu_copies) == expected, (gradients, c.scalar, c.cpu_copies)
        assert w.detections == 0


@pytest.mark.parametrize("every", [2, 10])
def test_sampled_batches_still_guard_every_step(every):
    """every_n_batches samples the statistics, not the detection: the step of an unsampled batch
    is checked too, and an inf gradient there is named at that batch, before the step spoils
    any weight."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    bad = every + 1  # an unsampled batch
    with watch(model, sinks=[sink], every_n_batches=every) as w:
        for i in range(every + 3):
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).sum()
            before = [p.detach().clone() for p in model.parameters()]
            if i == bad:
                with pytest.raises(NonFiniteDetected) as err:
                    (loss * INF).backward()
                    opt.step()
                break
            loss.backward()
            opt.step()
        assert w.detections == 1
    ev = err.value.event
    assert (ev.batch_number, ev.tensor, ev.kind) == (bad, "bias.grad", "inf")
    assert [e.batch_number for e in sink.of(NonFiniteEvent)] == [bad]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step did not run


def test_guard_under_report_counts_the_detection_and_the_step_goes_on():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report") as w:
        (model(torch.randn(4, 8)).sum() * INF).backward()
        opt.step()
        assert w.detections == 1
    assert not torch.isfinite(model.b.bias).all()  # report mode does not stop the step
    (ev,) = sink.of(NonFiniteEvent)
    assert ev.tensor == "bias.grad"


# -- GradScaler: skips stay skips, one numbering, every skip counted ---------------------------

def _scaler_run(gradients, steps=6, init_scale=2.0 ** 100, trailing_forward=False, growth_interval=3):
    """fp16 autocast + a real torch.amp.GradScaler; the steps the optimizer really took."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    sink = Collect()
    taken = []
    orig = opt.step
    opt.step = lambda *a, **k: (taken.append(len(taken)), orig(*a, **k))[1]
    w = watch(model, sinks=[sink], gradients=gradients, grad_scaler=scaler)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    if trailing_forward:
        model(x)
    w.detach()
    return sink, w, steps - len(taken)


@pytest.mark.parametrize("gradients", [False, True])
@pytest.mark.parametrize("trailing_forward", [False, True])
def test_an_all_skip_run_counts_every_skip_numbered_by_its_batch(gradients, trailing_forward):
    sink, w, skipped = _scaler_run(gradients, trailing_forward=trailing_forward)
    assert skipped == 6  # every step overflowed and the scaler skipped it
    assert sink.of(NonFiniteEvent) == []  # the guard does not see steps the scaler skipped
    events = sink.of(SkippedStepEvent)
    assert [e.batch_number for e in events] == [0, 1, 2, 3, 4, 5]
    assert [e.streak for e in events] == [1, 2, 3, 4, 5, 6]
    assert w.steps_skipped == 6


def test_one_numbering_of_a_skip_with_and_without_gradients():
    # a scale that overflows fp16 at first, then backs off: a few skips among taken steps
    numbers = {}
    for gradients in (False, True):
        sink, w, skipped = _scaler_run(gradients, steps=8, init_scale=2.0 ** 16, trailing_forward=True)
        numbers[gradients] = [e.batch_number for e in sink.of(SkippedStepEvent)]
        assert len(numbers[gradients]) == skipped == w.steps_skipped >= 2
        assert sink.of(NonFiniteEvent) == []
    assert numbers[False] == numbers[True]
    assert math.isfinite(sum(numbers[False]))


def test_the_fused_check_used_on_cuda_finds_inf_and_nan_in_mixed_dtypes(monkeypatch):
    """The CUDA path (one _foreach_norm per device, float32 results), run here on the CPU."""
    from tensorwatch_otel.core.steps import guard as steps
    from test_sync_count import SyncCounter

    monkeypatch.setattr(steps, "FUSED_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    model = Net()
    model.b.half()  # fp16 gradients beside fp32 ones
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)

    def loss():
        return model.b(torch.relu(model.a(x)).half()).float().square().mean()

    with watch(model, sinks=[Collect()]) as w:
        loss().backward()
        with SyncCounter() as c:
            opt.step()  # healthy: one read
        assert (c.scalar, c.cpu_copies) == (1, 0) and w.detections == 0
        opt.zero_grad()
        loss().backward()
        model.b.weight.grad[1, 1] = float("nan")
        before = _weights(model)
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
        assert _unchanged(model, before)
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.kind) == ("b", "weight.grad", "nan")


@pytest.mark.slow
def test_multi_rank_guard_detection_goes_through_the_fleet_stop(tmp_path):
    """DDP on 3 ranks, default options: rank 2's loss turns inf in batch 3, the all-reduce
    spreads its gradients to every rank, and each rank's guard finds them at its step. The
    gradients are the same everywhere, so every rank raises at that step, before the weights
    change: one first rank that all agree on, nobody hangs, no weight spoilt."""
    from test_fleet_stop import launch, raw_lines

    at = 3
    proc, results, _ = launch(tmp_path, 3, "--mode", "ddp", "--inject", "grad", "--bad", "2",
                              "--at", str(at), "--linger", "0")
    assert proc.returncode != 0
    firsts = {res["first_rank"] for res in results.values()}
    assert len(firsts) == 1, results
    for r, res in results.items():
        assert res["stopped"], res
        assert res["batches_done"] == at  # raised in batch `at`'s own optimizer step
        assert res["weights_finite"], res  # before the step consumed the inf gradients
        assert (res["event"], res["batch_number"]) == ("nonfinite_detected", at)
        assert res["tensor"].endswith(".grad"), res
        first = [d for d in raw_lines(tmp_path, r) if d["event"] == "nonfinite_detected"][0]
        assert first["frames"][-1]["phase"] == "backward" and first["first_rank"] in firsts


def test_the_drop_in_checks_forwards_only_like_the_peer():
    from tensorwatch_otel import DebugUnderflowOverflow

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    debug = DebugUnderflowOverflow(model)
    try:
        (model(torch.randn(4, 8)).sum() * INF).backward()
        opt.step()  # the peer does not look at gradients: neither does its drop-in
        with pytest.raises(ValueError, match="inf/nan detected"):
            model(torch.randn(4, 8))  # the nan weights, at the next forward, as the peer reports them
    finally:
        debug.detach()


def test_parameter_groups_do_not_change_which_gradient_is_named():
    """Weight decay splits parameters into groups (biases first here): the guard still names
    the bad gradient nearest the loss in the model's order."""
    torch.manual_seed(0)
    model = Net()
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": biases, "weight_decay": 0.0}, {"params": weights}], lr=0.1)
    with watch(model, sinks=[Collect()]):
        (model(torch.randn(4, 8)).sum() * INF).backward()
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
    assert (ei.value.event.module, ei.value.event.tensor) == ("b", "bias.grad")


def test_a_guard_that_fails_logs_once_and_training_goes_on(monkeypatch, caplog):
    from tensorwatch_otel.core.frames import finite

    def broken(t):
        raise RuntimeError("no reading this tensor")

    monkeypatch.setattr(finite, "measure", broken)  # the guard's read (core/frames/finite.py)
    monkeypatch.setattr(finite.HostBatch, "measure", lambda self: broken(None))  # the CPU kernel's batch
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("ERROR", logger="tensorwatch_otel.core.watcher"):
        with watch(model, sinks=[Collect()]) as w:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()  # not stopped by our failure
            assert w.batch_number == 3 and w.detections == 0
    said = [r for r in caplog.records if "optimizer-step gradient check failed" in r.getMessage()]
    assert len(said) == 1 and "no reading this tensor" in said[0].getMessage()
