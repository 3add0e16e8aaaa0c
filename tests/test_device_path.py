"""The device path wired into the recorder, forced on the CPU under Triton's interpreter (the CUDA
code on CPU tensors): a watched real model records the frames the default path records (module
paths, tensor names, exact values in fp32, fp16 and bf16), a detection names the same place,
target_dtypes gives the same underflow/overflow shares from counts taken in the fused launch, and
the fused kernel is what measured the frames.

TRITON_INTERPRET=1 as tests/_interpreted.py sets it (before Triton is imported); skipped without Triton."""

from __future__ import annotations

import math
import os
import sys

from _interpreted import INTERPRETED, REASON  # first: before Triton is imported
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the device path cannot be forced on the CPU")
pytestmark = pytest.mark.skipif(not INTERPRETED, reason=REASON)

from _collect import Collect  # noqa: E402
from tensorwatch_otel import NonFiniteEvent, watch  # noqa: E402
from tensorwatch_otel.core.measure import slot_buffer  # noqa: E402
from tensorwatch_otel.core.measure.device_path import force_on_cpu  # noqa: E402
from tensorwatch_otel.core.steps.guard import StepGuard  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _prenorm import Stack  # noqa: E402



def _rows(frames):
    """Everything a frame says, NaN made comparable."""
    def v(x):
        return "nan" if isinstance(x, float) and math.isnan(x) else x
    return [(f.module, f.module_class, f.phase, t.name, v(t.abs_min), v(t.abs_max), t.dtype, t.note,
             t.underflow, t.overflow) for f in frames for t in f.tensors]


def _train(model, xs, device_path, launches=None, **options):
    """Frames and events of a few watched training steps (forward, backward, SGD step)."""
    sink = Collect()
    force_on_cpu(device_path)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with watch(model, sinks=[sink], on_detect="report", trace_batches=range(len(xs)), **options):
            for x in xs:
                out = model(x)
                out.float().square().mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        force_on_cpu(False)
    return [f for b in sink.batches for f in b.frames], sink.events


def _counting_launches(monkeypatch, counted=None):
    """The sizes of the fused launches of module calls from now on, deferred frames' table
    launches included (and, into `counted`, those of the launches with a counts layout:
    target_dtypes). The step guard's launches over the
    gradients (on_detect="report" measures them into the buffer, without counts) are left out."""
    launches = []
    real = slot_buffer.launch
    real_guard = StepGuard.launch
    in_guard = [False]

    def guard_launch(*args):
        in_guard[0] = True
        try:
            return real_guard(*args)
        finally:
            in_guard[0] = False

    def launch(buf, first, ts, *layout):
        if in_guard[0]:
            return real(buf, first, ts, *layout)
        launches.append(len(ts))
        if layout and counted is not None:
            counted.append(len(ts))
        return real(buf, first, ts, *layout)

    real_table = slot_buffer.launch_table

    def launch_table(buf, entries, count, *rest):  # deferred frames: many calls' tensors in one launch
        launches.append(count)
        return real_table(buf, entries, count, *rest)

    monkeypatch.setattr(slot_buffer, "launch", launch)
    monkeypatch.setattr(slot_buffer, "launch_table", launch_table)
    monkeypatch.setattr(StepGuard, "launch", guard_launch)
    return launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_watched_stack_records_the_default_paths_frames(dtype, monkeypatch):
    torch.manual_seed(0)
    model = Stack(n_blocks=2, d=16, heads=2).to(dtype)
    twin = Stack(n_blocks=2, d=16, heads=2).to(dtype)
    twin.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 8, 16, generator=g).to(dtype) for _ in range(3)]
    default, _ = _train(model, xs, device_path=False)
    launches = _counting_launches(monkeypatch)
    forced, _ = _train(twin, xs, device_path=True)
    assert len(default) == 3 * 23 and _rows(forced) == _rows(default)
    assert launches and len(launches) <= len(forced)  # the fused kernel measured, once per call at most
    assert sum(launches) >= 3 * 2 * 23  # every frame's output at least, and the weights


def test_a_gpt2_in_bf16_records_the_default_paths_frames(monkeypatch):
    from _models import batches, build

    a, b = build("gpt2", torch.bfloat16), build("gpt2", torch.bfloat16)
    kw = batches("gpt2", 2)

    def frames(model, forced):
        sink = Collect()
        force_on_cpu(forced)
        try:
            with watch(model, sinks=[sink], on_detect="report", trace_batches=(0, 1)), torch.no_grad():
                for k in kw:
                    model(**k)
        finally:
            force_on_cpu(False)
        return [f for bt in sink.batches for f in bt.frames]

    default = frames(a, False)
    launches = _counting_launches(monkeypatch)
    forced = frames(b, True)
    assert _rows(forced) == _rows(default) and len(default) > 20
    assert launches and len(launches) <= len(forced)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_detection_names_the_same_module_and_tensor(bad):
    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 4))
        with torch.no_grad():
            m[2].weight[3, 5] = bad
        return m

    x = torch.randn(4, 8)
    found = []
    for forced in (False, True):
        _, events = _train(model(), [x], device_path=forced)
        ev = [e for e in events if isinstance(e, NonFiniteEvent)][0]
        found.append((ev.module, ev.tensor, ev.kind, _rows(ev.frames)))
    assert found[0] == found[1]
    assert found[0][:2] == ("2", "weight")


def _magnitudes(frames):
    return [t.magnitude for f in frames for t in f.tensors]


FRAMES_ONE_BLOCK = 13  # a one-block Stack's module calls per batch (its root, ln_f and head included)


@pytest.mark.parametrize("targets", [("float16", "float8_e4m3fn"), ("bfloat16", "float16", "float8_e5m2")],
                         ids=["fp16+e4m3", "bf16+fp16+e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_target_dtypes_are_counted_in_the_fused_launch_with_the_default_values(dtype, targets, monkeypatch):
    """Batch 0 is a histogram batch (its tensors take measure_counts, histogram rows and all);
    batches 1 and 2 are counted by the fused kernel: every row (abs min/max, underflow and
    overflow shares per target) equals the default path's (the CPU kernel, or the torch ops
    without it), and so do the histograms."""
    torch.manual_seed(0)
    # one block (13 frames a batch): the fused launch runs on Triton's interpreter here, about
    # 0.14 s a launch; two blocks doubled the test's time for no other path
    model = Stack(n_blocks=1, d=16, heads=2).to(dtype)
    twin = Stack(n_blocks=1, d=16, heads=2).to(dtype)
    twin.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(2)
    scale = 1e3 if dtype is not torch.float16 else 30.0  # past fp16's range in fp32/bf16
    xs = [(torch.randn(2, 8, 16, generator=g) * scale * torch.exp2(torch.randint(-20, 8, (2, 8, 16), generator=g)))
          .to(dtype) for _ in range(3)]
    default, _ = _train(model, xs, device_path=False, target_dtypes=targets)
    counted = []
    launches = _counting_launches(monkeypatch, counted)
    forced, _ = _train(twin, xs, device_path=True, target_dtypes=targets)
    assert len(default) == 3 * FRAMES_ONE_BLOCK and _rows(forced) == _rows(default)
    assert _magnitudes(forced) == _magnitudes(default)
    assert counted and counted == launches  # the counted batches' launches all carried the counts
    assert sum(counted) >= 2 * 2 * FRAMES_ONE_BLOCK  # every frame's output at least, in batches 1 and 2
    assert any(t.underflow[targets[-1]] for f in forced[FRAMES_ONE_BLOCK:] for t in f.tensors)
    if dtype is not torch.float16:
        assert any(t.overflow["float16"] for f in forced[FRAMES_ONE_BLOCK:] for t in f.tensors)


def test_float64_and_odd_tensors_take_the_measure_route():
    class Odd(nn.Module):
        def forward(self, x):
            return x.double() * 2, x.t(), x[:0], (x > 0)

    x = torch.randn(3, 5)
    default, _ = _train_forward(Odd(), x, False)
    forced, _ = _train_forward(Odd(), x, True)
    assert _rows(forced) == _rows(default)
    assert [t.dtype for t in forced[-1].tensors] == ["float32", "float64", "float32", "", "bool"]


def _train_forward(model, x, forced):
    sink = Collect()
    force_on_cpu(forced)
    try:
        with watch(model, sinks=[sink], on_detect="report", trace_batches=(0,)):
            model(x)
    finally:
        force_on_cpu(False)
    return [f for b in sink.batches for f in b.frames], sink.events


def test_cpu_tensors_keep_the_cpu_kernel_on_a_device_path_recorder(monkeypatch):
    """A CPU model watched on a machine with a GPU (the device path on for CUDA tensors only):
    its frames still go to the CPU kernel in one call per frame, with the weight table."""
    from tensorwatch_otel.core.measure import cpu_kernel, host_batch
    from tensorwatch_otel.core.frames import recorder

    if cpu_kernel.KERNEL.wait() is None:
        pytest.skip("the CPU statistics kernel could not be built here (no C compiler)")
    torch.manual_seed(0)
    model, twin = Stack(n_blocks=1, d=16, heads=2), Stack(n_blocks=1, d=16, heads=2)
    twin.load_state_dict(model.state_dict())
    xs = [torch.randn(2, 8, 16) for _ in range(2)]
    default, _ = _train(model, xs, device_path=False)
    monkeypatch.setattr(recorder, "device_path_wanted", lambda: True)
    calls = []
    real = host_batch.HostBatch.measure
    monkeypatch.setattr(host_batch.HostBatch, "measure", lambda self: (calls.append(len(self.ns)), real(self))[1])
    launches = _counting_launches(monkeypatch)
    sink = Collect()
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    with watch(twin, sinks=[sink], on_detect="report", trace_batches=(0, 1)) as w:
        assert w._session.recorder._device is not None and type(w._session.recorder.weights) is recorder.WeightTable
        for x in xs:
            twin(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert _rows([f for b in sink.batches for f in b.frames]) == _rows(default)
    assert launches == [] and calls and max(calls) >= 2


class _InPlaceAfter(nn.Module):
    """A child's output changed in place by its parent after the child returned, and a module
    called twice: each frame shows the values as they were when its module returned."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        y = self.lin(x)
        y.mul_(1e3)  # lin's frame keeps the values before this
        z = self.norm(y)
        return self.norm(z + 1) * 2


@pytest.mark.parametrize("options", [{}, {"check": "module"}, {"gradients": True}], ids=["batch", "module", "grads"])
def test_in_place_changes_shared_modules_check_module_and_gradients(options):
    def frames(forced):
        torch.manual_seed(0)
        model = _InPlaceAfter()
        x = torch.randn(3, 8)
        return _train(model, [x, x * 2], device_path=forced, **options)[0]

    default = frames(False)
    forced = frames(True)
    assert _rows(forced) == _rows(default)
    lin = [f for f in forced if f.module == "lin" and f.phase == "forward"][0]
    out = [t for t in lin.tensors if t.name == "output"][0]
    assert out.abs_max < 100  # before the parent's mul_
    assert sum(f.module == "norm" and f.phase == "forward" for f in forced) == 4  # called twice a batch
    if options.get("gradients"):
        assert any(f.phase == "backward" for f in forced)


class _Residual(nn.Module):
    """A ResNet-shaped block: an inplace ReLU after a Linear, and the block's input added in
    place to a LayerNorm's output (`out += x`), both after the module that made the tensor
    returned."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        out = self.norm(self.act(self.lin(x)))
        out += x
        return out


def test_deferred_frames_keep_values_written_in_place_later_and_launch_per_many_calls(monkeypatch):
    """The module calls' tensors wait for one table launch; the first batch launches each frame
    at once and learns which modules' tensors are written in place after they returned (lin's
    output by the ReLU, norm's by `+=`): theirs are measured at once from then on, so every
    batch shows every frame as the default path does, exactly."""
    def run(forced):
        torch.manual_seed(0)
        model = nn.Sequential(*[_Residual() for _ in range(6)])
        g = torch.Generator().manual_seed(3)
        xs = [torch.randn(4, 8, generator=g) for _ in range(4)]
        return _train(model, xs, device_path=forced)

    default, _ = run(False)
    tables = []
    real = slot_buffer.launch_table
    monkeypatch.setattr(slot_buffer, "launch_table", lambda buf, e, count, *rest: (tables.append(count),
                                                                                    real(buf, e, count, *rest))[1])
    forced, events = run(True)
    assert _rows(forced) == _rows(default) and len(default) == 4 * (1 + 6 * 4)
    assert not any(t.note for f in forced for t in f.tensors)  # nothing was lost
    assert not [e for e in events if isinstance(e, NonFiniteEvent)]
    # after the first batch the frames of act and of the blocks wait for table launches: one a
    # batch here; lin's and norm's (written in place later) each launch alone, as before
    assert len(tables) == 3


class _SometimesInPlace(nn.Module):
    """From batch `at` on, the parent writes inf into `lin`'s output after lin returned: a write
    the first batch never saw."""

    def __init__(self, at):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 2)
        self.at, self.calls = at, 0

    def forward(self, x):
        y = self.lin(x)
        if self.calls >= self.at:
            y[0, 0] = float("inf")
        self.calls += 1
        return self.out(y)


def test_a_tensor_written_in_place_before_its_deferred_launch_is_said_and_never_misnamed():
    torch.manual_seed(0)
    model = _SometimesInPlace(at=2)
    x = torch.randn(3, 8)
    force_on_cpu(True)
    sink = Collect()
    try:
        with watch(model, sinks=[sink], on_detect="report") as w:
            for _ in range(4):
                model(x)
        buf = w._session.recorder.device_stats.buffers[-1]
    finally:
        force_on_cpu(False)
    lin = [[t for t in b.frames[0].tensors if t.name == "output"][0] for b in sink.batches]
    assert lin[0].abs_max < 1e30 and lin[1].abs_max < 1e30 and not lin[0].note
    # batch 2: lin's output was written after lin returned, before its launch: said, not shown
    assert (lin[2].note, lin[2].abs_min, lin[2].abs_max) == ("changed in place", None, None)
    assert buf.changed_seen == 1
    # batch 3: lin is measured at once now: its value as it returned, finite
    assert lin[3].abs_max < 1e30 and not lin[3].note
    # the inf is named where it shows, at `out`'s input, never at lin's output
    named = [(e.batch_number, e.module, e.tensor) for e in sink.of(NonFiniteEvent)]
    assert named == [(2, "out", "input[0]"), (3, "out", "input[0]")]


class _FreesAfterUse(nn.Module):
    """Frees `lin`'s output storage in place after using it and keeps the tensor, as FSDP frees
    an unsharded parameter's storage after its module's forward (`resize_(0)`: no version moves)
    and keeps the parameter for the next forward."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        y = self.lin(x)
        z = self.out(y * 1.0)
        y.untyped_storage().resize_(0)
        self.kept = y
        return z


def test_a_tensor_whose_storage_is_freed_after_its_module_returned_is_measured_at_once():
    def run(forced):
        torch.manual_seed(0)
        model = _FreesAfterUse()
        g = torch.Generator().manual_seed(4)
        return _train_forward_n(model, [torch.randn(3, 8, generator=g) for _ in range(3)], forced)

    default, forced = run(False), run(True)
    assert _rows(forced) == _rows(default)
    assert not any(t.note for f in forced for t in f.tensors)


def _train_forward_n(model, xs, forced):
    sink = Collect()
    force_on_cpu(forced)
    try:
        with watch(model, sinks=[sink], on_detect="report", trace_batches=range(len(xs))):
            for x in xs:
                model(x)
    finally:
        force_on_cpu(False)
    return [f for b in sink.batches for f in b.frames]


class _Scaled(nn.Module):
    """A weight of its own, called with a keyword (its frame takes the general path) or without
    (the one-in-one-out frame's slot codes)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x, scale=1.0):
        return (x @ self.weight) * scale


def test_slot_codes_cached_by_one_frame_are_read_by_a_frame_of_the_general_path():
    """A weight measured by a one-in-one-out frame (a slot code, cached) and reused in a later
    no-grad batch by a frame of the general path (a keyword input): the record reads the code
    (before: its read-back took the code for a 0-d tensor and failed)."""
    def run(forced):
        torch.manual_seed(0)
        model = _Scaled()
        x = torch.randn(3, 8)
        sink = Collect()
        force_on_cpu(forced)
        try:
            with watch(model, sinks=[sink], on_detect="report"):
                model(x)
                model(x)  # (learning ended: a training batch measures the weight again, as a slot code)
                with torch.no_grad():
                    model(x, scale=2.0)  # the general path, the weight from the cache
        finally:
            force_on_cpu(False)
        return [f for b in sink.batches for f in b.frames]

    assert _rows(run(True)) == _rows(run(False))


def test_cached_weights_outlive_many_reads_of_check_module():
    """check="module" reads the buffer after every frame: a weight measured in one no-grad batch
    and reused in the next, 70 reads later, still has its values (not said lost)."""
    def run(forced):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(70)])
        x = torch.randn(2, 4)
        sink = Collect()
        force_on_cpu(forced)
        try:
            with watch(model, sinks=[sink], on_detect="report", check="module"), torch.no_grad():
                for _ in range(3):
                    model(x)
        finally:
            force_on_cpu(False)
        return [f for b in sink.batches for f in b.frames]

    forced = run(True)
    assert not any(t.note for f in forced for t in f.tensors)
    assert _rows(forced) == _rows(run(False))


@pytest.mark.slow
def test_frames_inside_an_inductor_graph_are_measured_at_once(monkeypatch):
    """The compiled ops run the hooks inside an inductor graph, whose buffers are reused by the
    graph's later kernels without a version bump: a deferred measurement would read another
    tensor's values there (the failure seen on an H200). Inside the ops frames launch at once:
    compiled values equal eager's."""
    from tensorwatch_otel.core.measure import graph_stats

    monkeypatch.setattr(graph_stats, "ON", False)  # the ops (put back after the test)
    monkeypatch.setenv("TENSORWATCH_GRAPH_STATS", "0")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(n_blocks=2, d=16, heads=2)
    x = torch.randn(2, 8, 16)
    eager, _ = _train_forward(model, x, False)
    sink = Collect()
    force_on_cpu(True)
    try:
        with watch(model, sinks=[sink], on_detect="report", trace_batches=(0, 1, 2)):
            compiled = torch.compile(model)
            for _ in range(3):
                compiled(x)
    finally:
        force_on_cpu(False)
        torch._dynamo.reset()
    got = {(f.module, t.name): (t.abs_min, t.abs_max) for f in sink.batches[-1].frames for t in f.tensors}
    want = {(f.module, t.name): (t.abs_min, t.abs_max) for f in eager for t in f.tensors}
    assert set(got) == set(want)
    for key, (mn, mx) in want.items():
        assert math.isclose(got[key][1], mx, rel_tol=1e-3, abs_tol=1e-3 * mx), (key, got[key], (mn, mx))
        assert math.isclose(got[key][0], mn, rel_tol=1e-3, abs_tol=1e-3 * mx), (key, got[key], (mn, mx))


@pytest.mark.slow
def test_a_compiled_model_on_the_device_path_records_the_eager_frames(monkeypatch):
    """watch() then torch.compile: the hooks' bodies run the recorder at run time (core/frames/compiled.py),
    so the fused kernel measures there too, with the eager default path's values."""
    torch.manual_seed(0)
    model = Stack(n_blocks=2, d=16, heads=2)
    x = torch.randn(2, 8, 16)
    eager, _ = _train_forward(model, x, False)
    launches = _counting_launches(monkeypatch)
    sink = Collect()
    force_on_cpu(True)
    try:
        with watch(model, sinks=[sink], on_detect="report", trace_batches=(0, 1)):
            compiled = torch.compile(model, backend="aot_eager")
            compiled(x)
            compiled(x)
    finally:
        force_on_cpu(False)
    assert _rows(sink.batches[-1].frames) == _rows(eager) and len(eager) == 23
    assert launches
