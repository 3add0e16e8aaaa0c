"""Compiled models are watched inside the graph: watch() before torch.compile(model),
model.compile() before watch(), and watch(torch.compile(model)) record the frames eager records
(same module paths, tensor names, values), with no graph break of ours; an inf is named where it is
born inside the graph; detach stops recording, sampling does not recompile, and the step guard
and `gradients=True` work on compiled models. Every test runs twice: with the submodules measured
inside the graph (core/measure/graph_stats.py, the default for CPU graphs) and with the ops of
core/frames/compiled.py (the default on a GPU, and for what a site cannot give)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch import nn

from _collect import Collect

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _prenorm import Stack  # noqa: E402  (the model benchmarks/bench_compiled.py times)
from tensorwatch_otel import NonFiniteDetected, NonFiniteEvent, watch


@pytest.fixture(autouse=True, params=["in_graph", "ops"])
def engine(request, monkeypatch):
    """The compiled front end under test; dynamo guards on the switch, and graphs are traced afresh."""
    from tensorwatch_otel.core.measure import graph_stats

    monkeypatch.setattr(graph_stats, "ON", request.param == "in_graph")  # (put back after the test)
    monkeypatch.setenv("TENSORWATCH_GRAPH_STATS", "1" if request.param == "in_graph" else "0")
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()


def _front():
    from tensorwatch_otel.core.frames import compiled

    return compiled


def _breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _pairs(frames):
    return [(f.module, t.name) for f in frames for t in f.tensors]


def _values(frames):
    return {(f.module, t.name): (t.abs_min, t.abs_max) for f in frames for t in f.tensors}


def _close(a: float, b: float, scale: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3 * scale)


def _eager_reference(model, x):
    """The frames eager watching records for one forward, and the events of two inf cases."""
    sink = Collect()
    with watch(model, sinks=[sink], on_detect="report"):
        model(x)
    return sink.batches[-1].frames


def _compiled(model, how: str, backend: str):
    """(the watcher, the callable a user calls) for each way of compiling."""
    sink = Collect()
    if how == "watch_then_compile":
        w = watch(model, sinks=[sink], on_detect="report")
        call = torch.compile(model, backend=backend)
    elif how == "model_compile_then_watch":
        model.compile(backend=backend)
        w = watch(model, sinks=[sink], on_detect="report")
        call = model
    else:  # watch(torch.compile(model))
        call = torch.compile(model, backend=backend)
        w = watch(call, sinks=[sink], on_detect="report")
    return w, sink, call


@pytest.mark.slow
@pytest.mark.parametrize("how", ["watch_then_compile", "model_compile_then_watch", "watch_compiled"])
def test_every_way_of_compiling_records_the_eager_frames_and_names_the_inf_where_born(how):
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(2, 8, 16)
    eager = _eager_reference(model, x)
    breaks = _breaks()
    w, sink, call = _compiled(model, how, "inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = call(x)
    assert _breaks() == breaks  # no graph break of ours
    frames = sink.batches[-1].frames
    assert _pairs(frames) == _pairs(eager)  # every (module, tensor) eager records, in its order
    assert len(frames) == 33 and frames[-1].module == "" and frames[-1].module_class == "Stack"
    ref, got = _values(eager), _values(frames)
    for key, (mn, mx) in ref.items():
        assert _close(got[key][1], mx, mx), (key, got[key], (mn, mx))
        assert _close(got[key][0], mn, mx), (key, got[key], (mn, mx))
    # training through the compiled model: fwd + bwd + AdamW, one batch per compiled call
    for _ in range(2):
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        out = call(x)
    assert w.batch_number == 3 and [b.batch_number for b in sink.batches] == [0, 1, 2]
    live = model.blocks[1].mlp.fc2.weight.detach().abs().max().item()
    assert _values(sink.batches[-1].frames)[("blocks.1.mlp.fc2", "weight")][1] == live  # after the steps
    assert _values(sink.batches[-1].frames)[("", "output")][1] == pytest.approx(out.detach().abs().max().item())
    # an inf in a middle block's weight: named at that block's Linear, as eager names it
    with torch.no_grad():
        model.blocks[1].attn.qkv.weight[0, 0] = float("inf")
    call(x)
    (ev,) = sink.of(NonFiniteEvent)
    assert (ev.module, ev.module_class, ev.tensor, ev.batch_number) == ("blocks.1.attn.qkv", "Linear", "weight", 3)
    # an inf born inside the graph, in an activation (finite weights, finite input): named at
    # the module whose output it is, not at the model's output
    with torch.no_grad():
        model.blocks[1].attn.qkv.weight[0, 0] = 0.0
        model.blocks[1].mlp.fc1.weight.fill_(1e38)
    call(x)
    ev = sink.of(NonFiniteEvent)[-1]
    assert (ev.module, ev.tensor, ev.batch_number) == ("blocks.1.mlp.fc1", "output", 4)
    assert _breaks() == breaks
    w.detach()


@pytest.mark.slow
def test_a_detection_raises_out_of_the_compiled_call():
    torch.manual_seed(0)
    model = Stack(n_blocks=2)
    sink = Collect()
    w = watch(model, sinks=[sink])  # on_detect="raise"
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 8, 16)
    compiled(x)
    with torch.no_grad():
        model.blocks[0].mlp.fc2.bias[3] = float("nan")
    with pytest.raises(NonFiniteDetected) as ei:
        compiled(x)
    assert (ei.value.event.module, ei.value.event.tensor) == ("blocks.0.mlp.fc2", "bias")
    assert sink.of(NonFiniteEvent) == [ei.value.event]
    w.detach()


@pytest.mark.slow
def test_detach_stops_recording_with_one_recompile_and_a_new_watch_records_again():
    torch.manual_seed(0)
    model = Stack(n_blocks=1)
    x = torch.randn(2, 8, 16)
    w = watch(model, sinks=[Collect()], on_detect="report")
    compiled = torch.compile(model, backend="aot_eager")
    g = _graphs()
    compiled(x)
    per_compile = _graphs() - g  # graphs of one compile (the root's hooks are graphs apart)
    compiled(x)
    sink = w.sinks[0]
    assert len(sink.batches) == 2 and len(sink.batches[-1].frames) == 13
    g = _graphs()
    w.detach()
    compiled(x)
    assert _graphs() - g <= per_compile  # at most one recompile for the detach
    g = _graphs()
    compiled(x)
    compiled(x)
    assert _graphs() == g  # none per call
    assert len(sink.batches) == 2 and w.batch_number == 2  # the graph knows: nothing recorded
    again = Collect()
    g = _graphs()
    w2 = watch(model, sinks=[again], on_detect="report")
    compiled(x)
    assert _graphs() - g <= per_compile  # at most one for the new watch()
    g = _graphs()
    compiled(x)
    compiled(x)
    assert _graphs() == g
    assert [b.batch_number for b in again.batches] == [0, 1, 2]
    assert _pairs(again.batches[-1].frames) == _pairs(sink.batches[-1].frames)
    w2.detach()


@pytest.mark.slow
def test_every_n_batches_samples_without_recompiling():
    torch.manual_seed(0)
    model = Stack(n_blocks=1)
    x = torch.randn(2, 8, 16)
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report", every_n_batches=3)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(x)
    g = _graphs()
    for _ in range(6):
        compiled(x)
    assert _graphs() == g  # sampled and unsampled batches run the same graph
    assert [b.batch_number for b in sink.batches] == [0, 3, 6]
    assert all(len(b.frames) == 13 for b in sink.batches)
    w.detach()


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.slow
def test_step_guard_checks_the_gradients_of_a_compiled_model():
    """The guard (on by default) reads the gradients at the optimizer step, outside the graph:
    an inf born in the loss stops the step, named at a gradient."""
    torch.manual_seed(0)
    model = _Two()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sink = Collect()
    with watch(model, sinks=[sink]):
        compiled = torch.compile(model, backend="aot_eager")
        x = torch.randn(4, 8)
        compiled(x).sum().backward()
        opt.step()  # healthy: goes through
        opt.zero_grad()
        (compiled(x).sum() * torch.tensor(float("inf"))).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(NonFiniteDetected) as ei:
            opt.step()
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # stopped before
    ev = ei.value.event
    assert (ev.module, ev.tensor, ev.phase, ev.batch_number) == ("b", "bias.grad", "backward", 1)


@pytest.mark.slow
def test_gradients_true_under_compile_records_parameter_gradients_only():
    """What `gradients=True` records under compile: each parameter's gradient as it is
    accumulated and the root output's gradient (both outside the compiled backward), not the
    gradients of the activations inside it; each equal to eager's."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)

    def grads(compile_it: bool):
        torch.manual_seed(0)
        model = _Two()
        sink = Collect()
        with watch(model, sinks=[sink], gradients=True, on_detect="report"):
            call = torch.compile(model, backend="aot_eager") if compile_it else model
            call(x).sum().backward()
        back = [b for b in sink.batches if b.frames and b.frames[0].phase == "backward"]
        return [(f.module, t.name, t.abs_max) for b in back for f in b.frames for t in f.tensors]

    eager, comp = grads(False), grads(True)
    params = [g for g in eager if g[1] in ("weight.grad", "bias.grad") or g[0] == ""]
    assert len(params) == 5 and len(eager) > len(params)  # eager also sees inner activation gradients
    assert {(m, n): v for m, n, v in comp} == pytest.approx({(m, n): v for m, n, v in params})
    assert len(comp) == len(params)


_COMPILED_BEFORE_WATCH = r"""
import sys
import torch
sys.path.insert(0, {tests!r})
from test_compiled_frames import Stack
from _collect import Collect
from tensorwatch_otel import watch
x = torch.randn(2, 8, 16)
first = Stack(1)
compiled = torch.compile(first, backend="aot_eager")
compiled(x)  # compiled and run before any watch(): torch's default, no guard on hooks
a = Collect()
wa = watch(compiled, sinks=[a], on_detect="report")
compiled(x)
second = Stack(1)  # a new instance of the same classes, watched, then compiled
b = Collect()
wb = watch(second, sinks=[b], on_detect="report")
torch.compile(second, backend="aot_eager")(x)
print(len(a.batches[-1].frames), len(b.batches[-1].frames))
"""


@pytest.mark.slow
def test_a_graph_compiled_before_the_first_watch_is_compiled_again_with_the_hooks(tmp_path):
    """torch's default skip_nnmodule_hook_guards=True leaves graphs compiled before watch()
    blind to the hooks (and reused for a hooked instance of the same classes): the first watch()
    of the process turns the guards on and drops those graphs, said at INFO. A fresh process,
    so that no earlier watch() in this one has done it already."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "before.py"
    script.write_text(_COMPILED_BEFORE_WATCH.format(tests=here))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["13", "13"]  # every module of each, not the root alone


class _Odd(nn.Module):
    """Outputs of every shape the recorder walks: a dict, a tuple holding None and an int, and
    keyword inputs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, *, scale=None):
        y = self.lin(x) * scale
        return {"y": y, "rest": (y.sum(), None, 3)}


class _OddRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.odd = _Odd()

    def forward(self, x):
        return self.odd(x, scale=torch.tensor(2.0))["y"]


@pytest.mark.slow
def test_odd_structures_get_the_eager_names_with_fullgraph_and_a_failure_of_ours_stops_nothing(
        monkeypatch, caplog, engine):
    torch.manual_seed(0)
    model = _OddRoot()
    x = torch.randn(2, 4)
    eager = _eager_reference(model, x)
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # no graph break at all
    compiled(x)
    assert _pairs(sink.batches[-1].frames) == _pairs(eager)
    assert ("odd", "input.scale") in _pairs(eager) and ("odd", "output.rest[1]") in _pairs(eager)
    ref, got = _values(eager), _values(sink.batches[-1].frames)
    assert {k: v for k, v in got.items() if v != (None, None)} == pytest.approx(
        {k: v for k, v in ref.items() if v != (None, None)})
    if engine == "in_graph":  # (the failure below is made in the ops' body: the "ops" run has it)
        w.detach()
        return
    # an error of ours inside the graph is logged once; the compiled call goes on
    front = _front()

    def broken(spec, tensors):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(front, "rebuild", broken)
    b = w.batch_number
    out = compiled(x)
    out = compiled(x)
    assert w.batch_number == b + 2  # batches still end
    assert torch.equal(out, model(x).detach()) or torch.allclose(out, model(x))
    assert len([r for r in caplog.records if "broken on purpose" in r.getMessage()]) == 1
    w.detach()


@pytest.mark.slow
def test_torch_export_of_a_watched_model_holds_none_of_our_ops():
    """An exported program runs elsewhere, without this watcher: no op of ours goes into it."""
    model = Stack(n_blocks=1)
    x = torch.randn(2, 8, 16)
    with watch(model, sinks=[Collect()], on_detect="report"):
        exported = torch.export.export(model, (x,))
    assert "tensorwatch" not in exported.graph_module.code
    assert torch.allclose(exported.module()(x), model(x))


class _Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["watch_then_compile", "watch_compiled"])
def test_an_exception_inside_the_graph_ends_its_batch_and_the_next_call_is_a_batch_of_its_own(how):
    """No hook runs inside a compiled graph when its forward raises (eager runs always_call
    hooks): the calls left open are ended at the next call, which is a fresh batch."""
    torch.manual_seed(0)
    model = _Lookup()
    good, bad = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 30]])
    eager = _eager_reference(model, good)
    w, sink, call = _compiled(model, how, "aot_eager")
    call(good)
    with pytest.raises(IndexError):
        call(bad)  # raises inside the graph, after the ops of nothing, or of emb
    call(good)
    call(good)
    assert w.batch_number == 4
    last = sink.batches[-1]
    assert last.batch_number == 3 and _pairs(last.frames) == _pairs(eager)
    w.detach()


@pytest.mark.slow
def test_check_module_under_compile_raises_at_the_module_and_the_next_call_starts_fresh():
    torch.manual_seed(0)
    model = Stack(n_blocks=2)
    x = torch.randn(2, 8, 16)
    sink = Collect()
    w = watch(model, sinks=[sink], check="module")
    compiled = torch.compile(model, backend="aot_eager")
    compiled(x)
    with torch.no_grad():
        saved = model.blocks[0].mlp.fc1.weight[0, 0].item()
        model.blocks[0].mlp.fc1.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteDetected) as ei:
        compiled(x)  # raised by the op of blocks.0.mlp.fc1, mid-graph
    assert (ei.value.event.module, ei.value.event.tensor, ei.value.event.batch_number) == (
        "blocks.0.mlp.fc1", "weight", 1)
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight[0, 0] = saved
    compiled(x)
    assert w.batch_number == 3 and sink.batches[-1].batch_number == 2
    assert len(sink.batches[-1].frames) == 23 and sink.of(NonFiniteEvent) == [ei.value.event]
    w.detach()


def _served_in_threads(compiled, inputs_per_thread, w, sink, engine):
    """Each thread calls `compiled` on its inputs; then every call was a batch of its own. With
    the ops every batch has every frame. Inside the graph a site's values are the process's
    (docs/compile.md, said once at WARNING): threads running the graphs at once can take each
    other's, so only the model's own frame is sure in each batch."""
    import threading

    errors = []

    def serve(inputs):
        try:
            for x in inputs:
                compiled(x)
        except Exception as exc:  # pragma: no cover - shown by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(inputs,)) for inputs in inputs_per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    n = 1 + sum(len(inputs) for inputs in inputs_per_thread)  # (one call before the threads)
    assert w.batch_number == n and sorted(b.batch_number for b in sink.batches) == list(range(n))
    whole = _pairs(sink.batches[0].frames)
    if engine == "ops":
        assert all(_pairs(b.frames) == whole for b in sink.batches)
    else:
        assert all(b.frames and b.frames[-1].module == "" for b in sink.batches)
        assert any(_pairs(b.frames) == whole for b in sink.batches[1:])


@pytest.mark.slow
def test_threads_calling_one_compiled_model_each_get_their_own_batches(engine):
    torch.manual_seed(0)
    model = Stack(n_blocks=1)
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report")
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 8, 16)
    compiled(x)  # compiled once, before the threads
    _served_in_threads(compiled, [[x] * 20] * 4, w, sink, engine)  # 81 batches
    w.detach()


@pytest.mark.slow
def test_threads_whose_calls_recompile_lose_no_batch(engine):
    """torch.compiler.is_compiling() is the process's flag: while one thread traced a new shape,
    the hooks running eagerly in the other threads took themselves for traced, left their calls
    unrecorded and their batches open, and later calls of those threads began no batch (13 of
    31 batches recorded before the fix)."""
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip("torch before 2.13 itself raises when a thread enters a compiled function while "
                    "another compiles ('using FX to symbolically trace a dynamo-optimized function')")

    torch.manual_seed(0)
    model = Stack(n_blocks=1)
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report")
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    compiled(torch.randn(2, 8, 16))
    shapes = ((2, 8, 16), (2, 4, 16), (3, 5, 16))
    _served_in_threads(compiled, [[torch.randn(*s) for _ in range(10)] for s in shapes], w, sink, engine)  # 31
    w.detach()


@pytest.mark.slow
def test_the_drop_in_prints_the_same_under_compile():
    """DebugUnderflowOverflow (the transformers.debug_utils drop-in) on a compiled model prints
    what it prints on the eager one."""
    import contextlib
    import io

    from tensorwatch_otel import DebugUnderflowOverflow

    outs = []
    for compile_it in (False, True):
        torch.manual_seed(0)
        model = Stack(n_blocks=1)
        dbg = DebugUnderflowOverflow(model, max_frames_to_save=4)
        call = torch.compile(model, backend="aot_eager") if compile_it else model
        x = torch.randn(2, 8, 16)
        call(x)
        with torch.no_grad():
            model.blocks[0].mlp.fc1.weight.fill_(1e38)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(ValueError) as ei:
            call(x)
        outs.append((buf.getvalue(), str(ei.value)))
        dbg.detach()
    assert "blocks.0.mlp.fc1" in outs[0][0]
    assert outs[1] == outs[0]


class _Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class _PlainBlock(nn.Module):
    """LayerNorm -> Linear -> activation -> Linear with a residual: no attention, so inductor
    is free to put one block's activation into the buffer of the block before."""

    def __init__(self, d: int, act: type):
        super().__init__()
        self.ln, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), act(), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class _PlainStack(nn.Module):
    def __init__(self, d: int, act: type, n_blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(_PlainBlock(d, act) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["watch_then_compile", "model_compile_then_watch", "watch_compiled"])
def test_values_are_eager_ones_whatever_buffers_inductor_reuses(how):
    """Without grad, inductor reuses the buffer of one block's activation for the next block's,
    writing it without moving the tensor's version: a statistic cached by tensor identity and
    version would be an earlier tensor's. Every (module, tensor) must carry its own values, for
    several widths and activations, and an inf born in an activation is named where eager names it."""
    for d, act in ((64, nn.GELU), (48, _Exp)):
        torch.manual_seed(0)
        model = _PlainStack(d, act)
        x = torch.randn(2, 8, d) * (0.3 if act is _Exp else 1.0)
        with torch.no_grad():
            eager = _eager_reference(model, x)
        w, sink, call = _compiled(model, how, "inductor")
        with torch.no_grad():
            call(x)
        frames = sink.batches[-1].frames
        assert _pairs(frames) == _pairs(eager)
        ref, got = _values(eager), _values(frames)
        stale = [(key, got[key], ref[key]) for key, (mn, mx) in ref.items()
                 if not (_close(got[key][1], mx, mx) and _close(got[key][0], mn, mx))]
        assert not stale, (d, act.__name__, stale)
        # an inf born inside the graph in block 1's activation (one element overflows)
        with torch.no_grad():
            model.blocks[1].fc1.bias[3] = 100.0 if act is _Exp else float("inf")
        sink_eager = Collect()
        w.detach()
        with torch.no_grad(), watch(model, sinks=[sink_eager], on_detect="report"):
            (model._orig_mod if hasattr(model, "_orig_mod") else model)(x)
        w, sink, call = _compiled(model, how, "inductor") if how != "model_compile_then_watch" else \
            (watch(model, sinks=[sink], on_detect="report"), sink, model)
        with torch.no_grad():
            call(x)
        (expected,) = sink_eager.of(NonFiniteEvent)
        (ev,) = sink.of(NonFiniteEvent)
        assert (ev.module, ev.tensor) == (expected.module, expected.tensor)
        assert ev.module == ("blocks.1.act" if act is _Exp else "blocks.1.fc1")
        w.detach()
        torch._dynamo.reset()


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["watch_then_compile", "watch_compiled", "compiled_submodule"])
def test_a_static_compile_over_four_shapes_compiles_no_frame_of_ours(how):
    """dynamic=False compiles one graph per input shape; the watcher's hooks must not add frames
    of their own (the root's hook, run from the module's eager call, compiled and recompiled per
    shape) nor recompiles. Every call is still one recorded batch with the eager frames. (Four
    shapes: a frame of ours would show at the second; dynamo's recompile limit is raised, so the
    count of shapes is no limit's.)"""
    import torch._dynamo

    def run(watched: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Stack(2, 16, 2)
        sink = Collect()
        if how == "compiled_submodule":
            model.blocks[0] = torch.compile(model.blocks[0], dynamic=False, backend="eager")
            w = watch(model, sinks=[sink]) if watched else None
            call = model
        elif how == "watch_compiled":
            call = torch.compile(model, dynamic=False, backend="eager")
            w = watch(call, sinks=[sink]) if watched else None
        else:
            w = watch(model, sinks=[sink]) if watched else None
            call = torch.compile(model, dynamic=False, backend="eager")
        before = _frames_compiled()
        with torch._dynamo.config.patch(cache_size_limit=64, recompile_limit=64):
            for t in range(1, 5):
                call(torch.randn(2, t, 16))
        if w is not None:
            w.detach()
        return _frames_compiled() - before, sink

    plain, _ = run(False)
    watched, sink = run(True)
    assert watched == plain, (watched, plain)
    assert [b.batch_number for b in sink.batches] == list(range(4))
    assert all(len(b.frames) == len(sink.batches[0].frames) for b in sink.batches)
    assert sink.batches[-1].frames[-1].module == ""


@pytest.mark.slow
def test_a_model_whose_submodules_hooks_never_run_is_said_once(monkeypatch, caplog):
    """Trust: a model watched but silently unwatched inside (its submodules' hooks dropped from a
    compiled graph, as torch < 2.13 did when dynamo folded is_exporting() to True, or a wrapper
    that calls their forward() directly) is said at WARNING once, with the batch and the count."""
    import logging

    from tensorwatch_otel.core.frames import compiled

    monkeypatch.setattr(compiled, "_exporting", lambda: True)  # what torch 2.11 made of it
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(n_blocks=1)
    sink = Collect()
    x = torch.randn(2, 8, 16)
    with caplog.at_level(logging.WARNING, logger="tensorwatch_otel"):
        with watch(model, sinks=[sink], on_detect="report"):
            call = torch.compile(model, backend="eager")
            for _ in range(3):
                call(x)
    assert [len(b.frames) for b in sink.batches] == [1, 1, 1]  # the root alone: unwatched inside
    said = [r for r in caplog.records if "submodules" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "batch 0" in said[0].getMessage() and "13 watched submodules" in said[0].getMessage()
    torch._dynamo.reset()
    # an eager model whose submodules run is never said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tensorwatch_otel"), watch(model, sinks=[sink]):
        model(x)
    assert not [r for r in caplog.records if "submodules" in r.getMessage()]
