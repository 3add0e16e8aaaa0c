"""on_detect="skip" (issue 27, item 4): the optimizer step that would consume a non-finite
gradient does not happen (weights, optimizer state and its step counters as before it), the
skip is recorded and exported, and training goes on; more than max_skipped_steps skips in a row
raise as on_detect="raise" would. Real models, real optimizers, no mocks."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch.nn import functional as F

from _collect import Collect
from _models import TwoLinear as Net
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch
from tensorwatch_otel.core.config import ConfigError, WatchConfig
from tensorwatch_otel.core.events import SkippedNonFiniteStepEvent, SkippedStepEvent
from tensorwatch_otel.sinks import JsonlLog, PrometheusMetrics

INF = float("inf")
BATCHES = 50
POISONED = (7, 23, 41)


def _data(n=BATCHES):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def _optimizer(kind, model):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _same_state(a, b):
    """Two optimizer state_dicts hold equal values (tensors by torch.equal)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


def _reference(kind, skipped, data, make=None):
    """The run that never took those batches' steps: same seed, same data, step() not called.
    `make(model)` builds the optimizer, when given; else `_optimizer(kind, model)`."""
    torch.manual_seed(0)
    model = Net()
    opt = make(model) if make is not None else _optimizer(kind, model)
    for b, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        if b not in skipped:
            opt.step()
    return model, opt


def _poisoned_batch(model, poison, x, y):
    """One batch's forward and backward with an inf put in by `poison`."""
    hook = None
    if poison == "input":
        x = x.clone()
        x[0, 0] = INF
    elif poison == "grad":  # the gradient is made inf in the backward (a parameter hook)
        hook = model.b.weight.register_hook(lambda g: torch.full_like(g, INF))
    loss = F.mse_loss(model(x), y)
    if poison == "loss":
        loss = loss * INF
    try:
        loss.backward()
    finally:
        if hook is not None:
            hook.remove()


def _train(model, opt, data, poisoned, poison, closure=False):
    for b, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        if b in poisoned:
            run = lambda x=x, y=y: _poisoned_batch(model, poison, x, y)  # noqa: E731
        else:
            run = lambda x=x, y=y: F.mse_loss(model(x), y).backward()  # noqa: E731
        if closure:  # the step runs the forward and backward itself (Lightning's automatic optimization)
            def step_closure(run=run):
                opt.zero_grad(set_to_none=True)
                run()
                return torch.zeros(())
            opt.step(step_closure)
        else:
            run()
            opt.step()


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
@pytest.mark.parametrize("poison", ["input", "loss", "grad"])
def test_poisoned_steps_are_skipped_exactly_as_if_never_called(tmp_path, kind, poison):
    data = _data()
    ref_model, ref_opt = _reference(kind, POISONED, data)
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer(kind, model)
    registry = CollectorRegistry()
    log = tmp_path / "events.jsonl"
    sinks = [JsonlLog(str(log)), PrometheusMetrics(registry=registry, linger_s=0)]
    with watch(model, sinks=sinks, on_detect="skip") as w:
        _train(model, opt, data, POISONED, poison)
        assert w.batch_number == BATCHES  # training went on to the end
        counted = registry.get_sample_value("tensorwatch_skipped_nonfinite_steps_total", {"rank": "0"})
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    assert _same_state(opt.state_dict(), ref_opt.state_dict())
    if kind == "adamw":  # the skipped steps did not count either
        assert opt.state[model.a.weight]["step"].item() == BATCHES - len(POISONED)
    docs = [json.loads(line) for line in log.read_text().splitlines()]
    skips = [d for d in docs if d["event"] == "skipped_nonfinite_step"]
    assert [d["batch_number"] for d in skips] == list(POISONED)
    assert counted == 3
    for d in skips:
        assert d["rank"] == 0 and d["kind"] in ("inf", "nan", "inf,nan")
        if poison == "input":  # the forward went non-finite: the skip names the forward's detection
            assert (d["module"], d["module_class"], d["tensor"], d["phase"]) == ("a", "Linear", "input[0]", "forward")
        elif poison == "grad":
            assert (d["module"], d["module_class"], d["tensor"], d["kind"], d["phase"]) == \
                ("b", "Linear", "weight.grad", "inf", "backward")
        else:  # born in the loss: the gradient nearest the loss (backward order)
            assert (d["module"], d["tensor"], d["phase"]) == ("b", "bias.grad", "backward")
    detections = [d for d in docs if d["event"] == "nonfinite_detected"]
    # a forward detection is recorded as "report" records it; a gradient skip is no detection
    assert [d["batch_number"] for d in detections] == (list(POISONED) if poison == "input" else [])


@pytest.mark.parametrize("closure", [False, True])
def test_the_first_step_an_optimizer_takes_is_skipped_too(closure):
    # the watcher first meets an optimizer inside its first step(): that step is skipped as well
    opt = _skip_batches_0_and_3(lambda model: _optimizer("adamw", model), closure)
    assert "step" not in vars(opt)  # detach gave optimizer.step back


def _skip_batches_0_and_3(make, closure):
    """Six batches under on_detect="skip", 0 and 3 poisoned in the loss: weights and optimizer
    state equal a run that never took those two steps, and both skips are events. The optimizer
    (`make(model)`) is returned."""
    data = _data(6)
    ref_model, ref_opt = _reference(None, (0, 3), data, make)
    torch.manual_seed(0)
    model = Net()
    opt = make(model)
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="skip"):
        _train(model, opt, data, (0, 3), "loss", closure=closure)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert _same_state(opt.state_dict(), ref_opt.state_dict())
    assert [e.batch_number for e in sink.of(SkippedNonFiniteStepEvent)] == [0, 3]
    return opt


class _SubclassedAdam(torch.optim.Adam):
    """A user's optimizer that steps through super(): the stand-in is an instance of its class,
    and super().step() runs torch's step hooks a second time (on the stand-in too)."""

    def step(self, closure=None):
        return super().step(closure)


torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # torch hooks Adam.step once an Adam is made


OPTIMIZERS = {
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam_subclass": lambda p: _SubclassedAdam(p, lr=1e-2),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "adadelta": lambda p: torch.optim.Adadelta(p),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("closure", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_torch_optimizer_skips_its_first_step_and_a_gated_one_untouched(name, closure):
    # batch 0: the step the watcher first meets the optimizer in (the stand-in); batch 3: the gate
    _skip_batches_0_and_3(lambda model: OPTIMIZERS[name](model.parameters()), closure)


def test_lbfgs_steps_are_skipped_once_the_gate_is_on_and_its_first_step_raises():
    # LBFGS reads its parameter groups before it runs the closure: its very first step (before
    # the gate) cannot run on a stand-in, so on_detect="skip" raises there instead of letting it write
    data = _data(4)

    def run(poisoned):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
        sink = Collect()
        with watch(model, sinks=[sink], on_detect="skip"):
            _train(model, opt, data, poisoned, "loss", closure=True)
        return model, sink

    model, sink = run((2,))
    # (each closure run is a batch of the watcher's: LBFGS's line search evaluates it again)
    (skip,) = sink.of(SkippedNonFiniteStepEvent)
    assert (skip.module, skip.tensor) == ("b", "bias.grad")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(NonFiniteDetected) as ei:
        run((0,))
    assert "could not be skipped" in str(ei.value) and "parameter groups" in str(ei.value)


def test_an_lr_scheduler_keeps_working_and_step_is_given_back():
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer("sgd_momentum", model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched_step = vars(opt)["step"]  # the scheduler's own wrapper of optimizer.step
    data = _data(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() has been overridden" warning
        with watch(model, sinks=[Collect()], on_detect="skip"):
            _train(model, opt, data, (2,), "loss")
            for _ in data:
                sched.step()
    assert vars(opt)["step"] is sched_step
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 16)


def test_more_than_max_skipped_steps_in_a_row_raise_with_the_event():
    data = _data(12)
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer("adamw", model)
    sink = Collect()
    # 1, 2, 3 skipped then a healthy step (the streak ends); 6, 7, 8 skipped; 9 would be a 4th in a row
    poisoned = (1, 2, 3, 6, 7, 8, 9, 10)
    with pytest.raises(NonFiniteDetected) as ei:
        with watch(model, sinks=[sink], on_detect="skip", max_skipped_steps=3):
            for b, (x, y) in enumerate(data):
                opt.zero_grad(set_to_none=True)
                if b in poisoned:
                    _poisoned_batch(model, "loss", x, y)
                else:
                    F.mse_loss(model(x), y).backward()
                if b == 9:
                    before = {n: p.detach().clone() for n, p in model.named_parameters()}
                opt.step()
    ev = ei.value.event
    assert isinstance(ev, NonFiniteEvent)
    assert (ev.batch_number, ev.module, ev.tensor, ev.phase) == (9, "b", "bias.grad", "backward")
    assert sink.of(NonFiniteEvent) == [ev]  # recorded before it was raised
    skips = sink.of(SkippedNonFiniteStepEvent)
    assert [(e.batch_number, e.streak) for e in skips] == [(1, 1), (2, 2), (3, 3), (6, 1), (7, 2), (8, 3)]
    # raised before the step: nothing changed, nothing non-finite
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert opt.state[model.a.weight]["step"].item() == 3  # batches 0, 4 and 5 stepped
    assert "max_skipped_steps=3" in str(ei.value)


def test_a_forward_inf_without_gradients_still_skips_that_batchs_step():
    # a masked inf: the forward went non-finite, the loss and the gradients did not
    class Spike(torch.nn.Module):
        def forward(self, h, poison):
            return torch.where(torch.arange(4) == 0, torch.full_like(h, INF), h) if poison else h

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 4)
            self.spike = Spike()

        def forward(self, x, poison=False):
            return self.spike(self.a(x), poison)[:, 1:]  # the inf column is dropped

    torch.manual_seed(0)
    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = Collect()
    x = torch.randn(2, 8)
    with watch(model, sinks=[sink], on_detect="skip"):
        for b in range(3):
            opt.zero_grad()
            model(x, poison=b == 1).sum().backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
            before = model.a.weight.detach().clone()
            opt.step()
            assert torch.equal(model.a.weight, before) == (b == 1)
        with torch.no_grad():  # an eval forward's inf builds no gradient: the next step is taken
            model(x, poison=True)
        opt.zero_grad()
        model(x).sum().backward()
        before = model.a.weight.detach().clone()
        opt.step()
        assert not torch.equal(model.a.weight, before)
    (skip,) = sink.of(SkippedNonFiniteStepEvent)
    assert (skip.batch_number, skip.module, skip.tensor, skip.phase) == (1, "spike", "output", "forward")
    assert [e.batch_number for e in sink.of(NonFiniteEvent)] == [1, 3]


def test_a_grad_scaler_skip_is_counted_once_as_the_scalers():
    # the GradScaler skips the overflowing step itself: one optimizer_step_skipped, no skip of ours,
    # and the next (healthy) step is taken although that batch's forward went non-finite
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    sink = Collect()
    data = _data(4)
    with watch(model, sinks=[sink], on_detect="skip", grad_scaler=scaler) as w:
        for b, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            if b == 1:
                x = x.clone()
                x[0, 0] = INF
            scaler.scale(F.mse_loss(model(x), y)).backward()
            before = model.a.weight.detach().clone()
            scaler.step(opt)
            scaler.update()
            assert torch.equal(model.a.weight, before) == (b == 1), b
    assert sink.of(SkippedNonFiniteStepEvent) == []
    assert [e.batch_number for e in sink.of(SkippedStepEvent)] == [1] and w.steps_skipped == 1
    assert [e.batch_number for e in sink.of(NonFiniteEvent)] == [1]


def test_skip_is_read_from_the_environment_and_a_typo_names_the_option():
    assert WatchConfig.build(environ={"TENSORWATCH_ON_DETECT": "skip"}).on_detect == "skip"
    assert WatchConfig.build(on_detect="skip", environ={}).on_detect == "skip"
    with pytest.raises(ConfigError) as ei:
        WatchConfig.build(on_detect="skp", environ={})
    assert "on_detect" in str(ei.value) and "skip" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        WatchConfig.build(environ={"TENSORWATCH_ON_DETECT": "skp"})
    assert "TENSORWATCH_ON_DETECT" in str(ei.value) and "skip" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        watch(Net(), sinks=[], on_detect="skp")
    assert "on_detect" in str(ei.value) and "skip" in str(ei.value)


# -- several ranks: every rank skips the same step --------------------------------------------

def _skips(tmp_path, rank):
    from test_fleet_stop import events_of

    return [e for e in events_of(tmp_path, rank) if e.event == "skipped_nonfinite_step"]


@pytest.mark.slow
def test_ddp_one_poisoned_batch_on_one_rank_every_rank_skips_that_step(tmp_path):
    from test_fleet_stop import events_of, launch

    at, batches = 4, 8
    proc, results, _ = launch(tmp_path, 2, "--mode", "ddp", "--on-detect", "skip", "--bad", "1", "--at", str(at),
                              "--batches", str(batches))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r, res in results.items():
        assert res["batches_done"] == batches and not res.get("stopped"), res
        assert res["weights_finite"]
        (skip,) = _skips(tmp_path, r)
        assert (skip.batch_number, skip.rank) == (at, r)
    assert results[0]["weights"] == results[1]["weights"]  # the same steps were taken on both ranks
    # rank 1's forward went non-finite: recorded as a detection, its skip names it; rank 0 found
    # the all-reduced gradients non-finite
    (det,) = [e for e in events_of(tmp_path, 1) if e.event == "nonfinite_detected"]
    assert (det.batch_number, det.module, det.tensor) == (at, "layers.0", "input[0]")
    assert (_skips(tmp_path, 1)[0].tensor, _skips(tmp_path, 1)[0].phase) == ("input[0]", "forward")
    assert _skips(tmp_path, 0)[0].tensor.endswith(".grad") and _skips(tmp_path, 0)[0].phase == "backward"
    assert [e for e in events_of(tmp_path, 0) if e.event == "nonfinite_detected"] == []


@pytest.mark.slow
def test_fsdp2_a_bad_gradient_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    from test_fleet_stop import launch

    at, batches = 3, 6
    proc, results, _ = launch(tmp_path, 2, "--mode", "fsdp2", "--on-detect", "skip", "--inject", "gradshard",
                              "--bad", "1", "--at", str(at), "--batches", str(batches))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r, res in results.items():
        assert res["batches_done"] == batches and res["weights_finite"], res
        assert [e.batch_number for e in _skips(tmp_path, r)] == [at]
    # rank 1 found it in its own shard; rank 0's shard was finite: it skipped on rank 1's word
    assert (_skips(tmp_path, 1)[0].module, _skips(tmp_path, 1)[0].tensor) == ("layers.0", "weight.grad")
    assert (_skips(tmp_path, 0)[0].module, _skips(tmp_path, 0)[0].tensor) == ("", "")
