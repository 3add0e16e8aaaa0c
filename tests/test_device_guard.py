"""The step guard without a sync, on the device path (forced on the CPU under Triton's
interpreter, as in test_device_counts.py): where the step may run before the verdict is known,
the gradients are measured into the slot buffer and the verdict comes back with the next
batch's one read.

- A fused optimizer (torch's `fused=True`) gets the guard's device flag as its `found_inf`, as
  a GradScaler hands it one: a bad gradient makes the step write nothing (weights and the
  optimizer's step count untouched), and on_detect="raise" raises at the next batch's
  read-back, named as the read path names it (compared live below).
- on_detect="report" lets every step run, so it never waits for the verdict: reported with the
  next batch, before that batch's own detections.
- The last step's verdict, with no batch after it, is read at detach: recorded, not raised."""

from __future__ import annotations

import os

from _interpreted import INTERPRETED, REASON  # first: before Triton is imported
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the device path cannot be forced on the CPU")
pytestmark = pytest.mark.skipif(not INTERPRETED, reason=REASON)

from _collect import Collect  # noqa: E402
from _models import TwoLinear as Net  # noqa: E402
from _op_counts import torch_ops_path  # noqa: E402
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch  # noqa: E402
from tensorwatch_otel.core.measure import device_path  # noqa: E402

INF, NAN = float("inf"), float("nan")


@pytest.fixture
def no_cpu_kernel(monkeypatch):
    torch_ops_path(monkeypatch)


@pytest.fixture
def forced(no_cpu_kernel):
    device_path.force_on_cpu(True)
    yield
    device_path.force_on_cpu(False)


def _state(model, opt):
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = [opt.state[p]["step"].clone() for p in model.parameters() if p in opt.state]
    return weights, steps


def _same(model, opt, before):
    weights, steps = before
    now = [opt.state[p]["step"] for p in model.parameters() if p in opt.state]
    return all(torch.equal(p, weights[n]) for n, p in model.named_parameters()) and \
        all(torch.equal(a, b) for a, b in zip(now, steps))


def _backward(model, x, poison=None):
    model(x).square().mean().backward()
    if poison is not None:
        with torch.no_grad():
            model.a.weight.grad[3, 2] = poison  # born after the backward: only the guard sees it


def _fused_run(poison, bad_step=2, steps=4, **options):
    """Fused Adam, on_detect="raise": `steps` steps, the gradient of a.weight poisoned before
    step `bad_step`. Returns (the event raised, where it was raised, the state check, the sink)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    x = torch.randn(4, 8)
    sink = Collect()
    raised_at = event = unchanged = None
    with watch(model, sinks=[sink], **options):
        for i in range(steps):
            try:
                _backward(model, x, poison if i == bad_step else None)
            except NonFiniteDetected as exc:
                event, raised_at = exc.event, ("forward", i)
                break
            before = _state(model, opt)
            try:
                opt.step()
            except NonFiniteDetected as exc:
                event, raised_at = exc.event, ("step", i)
                unchanged = _same(model, opt, before)
                break
            assert not hasattr(opt, "found_inf")  # the flag is lent for the step only
            if i == bad_step:
                unchanged = _same(model, opt, before)
            opt.zero_grad()
    return event, raised_at, unchanged, sink


@pytest.mark.parametrize("poison,kind", [(INF, "inf"), (NAN, "nan")])
def test_fused_optimizer_skips_itself_and_the_raise_comes_with_the_next_read(forced, poison, kind):
    event, raised_at, unchanged, sink = _fused_run(poison)
    assert raised_at == ("forward", 3)  # the next batch's forward end: its read-back
    assert unchanged  # the fused step wrote nothing: weights and its step count as before
    assert (event.module, event.tensor, event.kind, event.phase, event.batch_number) == \
        ("a", "weight.grad", kind, "backward", 2)
    assert sink.of(NonFiniteEvent) == [event]
    grads = [t for f in event.frames if f.module in ("a", "b") for t in f.tensors if t.name.endswith(".grad")]
    assert {t.name for t in grads} == {"weight.grad", "bias.grad"}
    assert all(t.abs_min is not None and t.abs_max is not None for t in grads)


def test_the_deferred_verdict_names_what_the_read_path_names(forced, no_cpu_kernel):
    deferred, raised_at, _, _ = _fused_run(INF)
    assert raised_at == ("forward", 3)
    device_path.force_on_cpu(False)  # the guard's read before the step, with torch ops
    read, raised_at, unchanged, _ = _fused_run(INF)
    assert raised_at == ("step", 2) and unchanged
    assert (deferred.module, deferred.tensor, deferred.kind, deferred.batch_number) == \
        (read.module, read.tensor, read.kind, read.batch_number)
    # the gradients' frames hold the same values, both ways (the same gradients, measured twice)
    def grad_frames(ev):
        return [(f.module, t.name, t.abs_min, t.abs_max) for f in ev.frames for t in f.tensors
                if t.name.endswith(".grad")]
    # the same ring: the step's batch's forward frames, then the gradients
    assert [(f.batch_number, f.module, [t.name for t in f.tensors]) for f in deferred.frames] == \
        [(f.batch_number, f.module, [t.name for t in f.tensors]) for f in read.frames]
    a, b = grad_frames(deferred), grad_frames(read)
    assert [x[:2] for x in a] == [x[:2] for x in b]
    for (_, _, lo1, hi1), (_, _, lo2, hi2) in zip(a, b):
        assert hi1 == hi2 or abs(hi1 - hi2) <= 1e-6 * abs(hi2)
        assert lo1 == lo2 or abs(lo1 - lo2) <= 1e-6 * max(abs(lo2), 1e-30)


@pytest.mark.parametrize("options,bad_step", [({"every_n_batches": 2}, 1), ({"capture_dir": "tmp"}, 2)],
                         ids=["unrecorded-batch", "capture_dir"])
def test_where_a_detection_needs_the_batchs_inputs_the_guard_reads_before_the_step(forced, tmp_path, options,
                                                                                    bad_step):
    """An unrecorded batch's detection is localized by a replay of its inputs, and capture_dir
    writes them to a file: the next batch lets them go, so the verdict cannot wait for it."""
    if "capture_dir" in options:
        options = {"capture_dir": str(tmp_path)}
    event, raised_at, unchanged, _ = _fused_run(INF, bad_step=bad_step, **options)
    assert raised_at == ("step", bad_step) and unchanged
    assert (event.tensor, event.batch_number) == ("weight.grad", bad_step)
    if "capture_dir" in options:
        assert event.capture and os.path.isfile(event.capture) and str(tmp_path) in event.capture


def test_a_bad_last_step_is_recorded_at_detach_not_raised(forced, caplog):
    event, raised_at, unchanged, sink = _fused_run(INF, bad_step=3, steps=4)
    assert raised_at is None and unchanged  # the with block ended normally
    (ev,) = sink.of(NonFiniteEvent)
    assert (ev.module, ev.tensor, ev.batch_number) == ("a", "weight.grad", 3)
    assert "recorded at detach" in caplog.text


def test_report_mode_lets_the_step_run_and_reports_with_the_next_batch(forced):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # any optimizer: nothing waits for the verdict
    x = torch.randn(4, 8)
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report") as w:
        for i in range(3):
            _backward(model, x, INF if i == 1 else None)
            opt.step()  # runs: the inf reaches the weight
            opt.zero_grad()
            if i == 1:
                assert w.detections == 0 and not torch.isfinite(model.a.weight).all()
    events = sink.of(NonFiniteEvent)
    # the step's gradient, read with batch 2, comes before batch 2's own forward detection
    assert [(e.batch_number, e.module, e.tensor, e.phase) for e in events][:2] == \
        [(1, "a", "weight.grad", "backward"), (2, "a", "weight", "forward")]


def test_a_scalers_found_inf_is_left_to_the_scaler(forced, monkeypatch):
    """With a GradScaler the fused step already has the scaler's found_inf: the guard reads that
    verdict (as on the read path), launches nothing and lends no flag of its own."""
    from tensorwatch_otel.core.steps.guard import StepGuard

    launches = []
    real_launch = StepGuard.launch
    monkeypatch.setattr(StepGuard, "launch", lambda *a: launches.append(1) or real_launch(*a))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x = torch.randn(4, 8)
    seen = []
    real = torch.optim.Adam.step

    def step(self, *a, **k):
        seen.append(getattr(self, "found_inf", None))
        return real(self, *a, **k)

    torch.optim.Adam.step = step
    try:
        with watch(model, sinks=[Collect()], grad_scaler=scaler):
            for _ in range(2):
                scaler.scale(model(x).square().mean()).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    finally:
        torch.optim.Adam.step = real
    assert len(seen) == 2 and all(f is not None for f in seen) and launches == []
    assert not hasattr(opt, "found_inf")


def test_a_step_that_fails_after_the_flag_was_lent_does_not_keep_it(forced):
    """The flag is lent for one step: when that step raises before torch's post-hooks (a hook of
    the user's, an error inside), detach takes it back, or every later step of the optimizer
    would read it and skip itself."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    x = torch.randn(4, 8)

    def boom(*_):
        raise RuntimeError("boom")

    sink = Collect()
    with watch(model, sinks=[sink]):
        _backward(model, x, INF)
        handle = opt.register_step_pre_hook(boom)  # runs after the global hooks: the flag is lent
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        handle.remove()
        assert hasattr(opt, "found_inf")
    assert not hasattr(opt, "found_inf")
    assert [e.tensor for e in sink.of(NonFiniteEvent)] == ["weight.grad"]  # recorded at detach
    opt.zero_grad()
    before = model.a.weight.detach().clone()
    _backward(model, x)
    opt.step()  # unwatched now: a healthy step writes
    assert not torch.equal(model.a.weight, before)
