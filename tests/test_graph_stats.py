"""Statistics inside the compiled graph (core/measure/graph_stats.py, TENSORWATCH_GRAPH_STATS=1, switched on
here through graph_stats.ON): a compiled model's submodules are measured by plain aten ops in the
graph, so the generated code holds no op of ours; the frames equal eager watching's (names, order,
values within 1e-3 of their magnitude, dtypes, notes) on several model shapes and under
torch.compile(model) and watch(torch.compile(model)); an inf born in an activation is named where
eager names it; model.compile() too; sampling reads only recorded batches, and a graph break keeps
the frames in the order they ran; a watcher wanting what a site cannot give keeps the ops."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch import nn

from _collect import Collect

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _prenorm import Mlp, Stack  # noqa: E402
from tensorwatch_otel import NonFiniteEvent, watch  # noqa: E402
from tensorwatch_otel.core.frames import compiled
from tensorwatch_otel.core.measure import graph_stats  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def in_graph(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(graph_stats, "ON", True)
    yield
    torch._dynamo.reset()


class _Mlp(nn.Module):
    """Integer and bool inputs beside floats, an empty tensor, keyword inputs and a dict output."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, ids, mask):
        h = self.act(self.fc1(self.emb(ids)))
        y = self.norm(self.fc2(h)) * mask.unsqueeze(-1)
        return {"y": y, "n": ids.sum()}


class _Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _Mlp()
        self.head = nn.Linear(16, 4)

    def forward(self, ids, mask):
        return self.head(self.body(ids, mask)["y"])


def _frames_of(sink):
    return sink.batches[-1].frames


def _rows(frames):
    return [(f.module, f.phase, t.name, t.dtype, t.note) for f in frames for t in f.tensors]


def _values(frames):
    return {(f.module, t.name): (t.abs_min, t.abs_max) for f in frames for t in f.tensors}


def _close(a, b, scale):
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-3 * scale)


def _same_as_eager(eager, got):
    assert _rows(got) == _rows(eager)
    ref, vals = _values(eager), _values(got)
    for key, (mn, mx) in ref.items():
        scale = mx if mx is not None and math.isfinite(mx) else 1.0
        assert _close(vals[key][1], mx, scale) and _close(vals[key][0], mn, scale), (key, vals[key], (mn, mx))


def _cases():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.bool)
    return {
        "stack": (lambda: Stack(n_blocks=3, d=16, heads=2), (torch.randn(2, 8, 16),)),
        "wide stack": (lambda: Stack(n_blocks=2, d=64, heads=4), (torch.randn(3, 5, 64),)),
        "mlp with ints and bools": (_Root, (ids, mask)),
    }


@pytest.mark.parametrize("how", ["compile_model", "watch_compiled"])
@pytest.mark.parametrize("case", list(_cases()))
def test_frames_equal_eager_and_no_op_of_ours_is_in_the_graph(case, how):
    from torch._inductor.utils import run_and_get_code

    make, x = _cases()[case]
    torch.manual_seed(0)
    model = make()
    ref = Collect()
    with watch(model, sinks=[ref], on_detect="report"):
        model(*x)
    eager = _frames_of(ref)
    sink = Collect()
    if how == "compile_model":
        w = watch(model, sinks=[sink], on_detect="report")
        call = torch.compile(model)
    else:
        call = torch.compile(model)
        w = watch(call, sinks=[sink], on_detect="report")
    ran = compiled.ran.calls
    _, codes = run_and_get_code(call, *x)
    assert "tensorwatch" not in "\n".join(codes)  # no op with a Python body
    sites = compiled.ran.calls - ran  # bumped at trace time only, one per site
    for _ in range(2):
        call(*x)
    assert compiled.ran.calls - ran == sites  # nothing of ours ran in Python per call
    assert [b.batch_number for b in sink.batches] == [0, 1, 2]
    for b in sink.batches:
        frames = b.frames if how == "compile_model" else [f for f in b.frames if f.module != ""]
        _same_as_eager(eager if how == "compile_model" else [f for f in eager if f.module != ""], frames)
    w.detach()


def _fresh_forward_code(make_model, x: torch.Tensor, watched: bool) -> str:
    """The code inductor generates for `make_model()`'s training forward, watched or not,
    compiled afresh (a graph loaded from the caches brings its backward's code along)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make_model().train()
    w = watch(model, sinks=[Collect()]) if watched else None
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            _, codes = run_and_get_code(torch.compile(model), x)
    finally:
        if w is not None:
            w.detach()
    return "".join(codes)


def test_an_activations_statistics_read_its_stored_output_instead_of_computing_it_again():
    """A GELU module's output is stored for the next Linear; its statistics are fused into the
    loop that stores it. Without that, inductor computes the GELU a second time inside the
    reduction (the erf of every element twice per forward): the watched step's largest cost."""
    x = torch.randn(4, 32, 64)

    def erfs(watched: bool) -> int:
        code = _fresh_forward_code(lambda: Mlp(64), x, watched)
        return code.count(".erf()") + code.count("std::erf(")

    unwatched = erfs(False)
    assert unwatched >= 1
    assert erfs(True) == unwatched


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.a1 = nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()
        self.c2, self.a2 = nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()

    def forward(self, x):
        return self.a2(self.c2(self.a1(self.c1(x)))).mean()


def test_a_conv_nets_statistics_add_no_layout_copy():
    """Around convolutions inductor keeps 4-D tensors channels-last; the statistics take them as
    they are (no view pinning eager's layout, which costs a transposing copy each: 6 transposes
    instead of 4 here, and 1.4x instead of 1.06x on a 3-block conv net's CPU step)."""
    x = torch.randn(2, 3, 16, 16)

    def transposes(watched: bool) -> int:
        return _fresh_forward_code(_ConvNet, x, watched).count("transpose_mxn")

    assert transposes(True) == transposes(False)


def test_an_inf_born_in_an_activation_is_named_where_eager_names_it():
    def run(compile_it):
        torch.manual_seed(0)
        model = Stack(n_blocks=3, d=16, heads=2)
        x = torch.randn(2, 8, 16)
        sink = Collect()
        with watch(model, sinks=[sink], on_detect="report"):
            call = torch.compile(model) if compile_it else model
            call(x)
            with torch.no_grad():
                model.blocks[1].mlp.fc1.weight.fill_(1e38)  # finite weights, an inf output
            call(x)
        (ev,) = sink.of(NonFiniteEvent)
        return ev.module, ev.tensor, ev.kind, ev.batch_number, [f.module for f in ev.frames][-3:]

    eager, graph = run(False), run(True)
    assert graph == eager and eager[:4] == ("blocks.1.mlp.fc1", "output", "inf", 1)


def test_a_detection_raises_out_of_the_compiled_call():
    from tensorwatch_otel import NonFiniteDetected

    torch.manual_seed(0)
    model = Stack(n_blocks=2)
    w = watch(model, sinks=[Collect()])  # on_detect="raise"
    call = torch.compile(model)
    x = torch.randn(2, 8, 16)
    call(x)
    with torch.no_grad():
        model.blocks[0].mlp.fc2.bias[3] = float("nan")
    with pytest.raises(NonFiniteDetected) as ei:
        call(x)
    assert (ei.value.event.module, ei.value.event.tensor) == ("blocks.0.mlp.fc2", "bias")
    w.detach()


def test_model_compile_too():
    """model.compile(): the model's own hooks run eagerly around the compiled call here as well, so
    its submodules are sites (were the model's hooks traced into the graph, mark_root_traced()
    would keep the ops: the batch would end inside the graph, before the sites' values are stored)."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = Stack(n_blocks=1)
    x = torch.randn(2, 8, 16)
    ref = Collect()
    with watch(model, sinks=[ref], on_detect="report"):
        model(x)
    model.compile()
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report")
    counters.clear()
    _, codes = run_and_get_code(model, x)
    model(x)
    assert "tensorwatch" not in "\n".join(codes)
    _same_as_eager(_frames_of(ref), _frames_of(sink))
    assert not counters["graph_break"] and counters["frames"]["ok"] == counters["frames"]["total"] >= 1
    w.detach()


def test_sampling_reads_recorded_batches_only_and_a_graph_break_keeps_the_order():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            x = self.b(x)
            return self.c(x)

    torch.manual_seed(0)
    model = Broken()
    x = torch.randn(4, 8)
    ref = Collect()
    with watch(model, sinks=[ref], on_detect="report"):
        model(x)
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report", every_n_batches=2)
    call = torch.compile(model)
    for i in range(5):
        call(x * (i + 1))
    assert [b.batch_number for b in sink.batches] == [0, 2, 4]
    assert [f.module for f in _frames_of(sink)] == ["a", "b", "c", ""]
    last = _values(_frames_of(sink))
    model(x * 5)  # (eager, unwatched by the compiled call's graph: the same values)
    eager5 = Collect()
    w.detach()
    with watch(model, sinks=[eager5], on_detect="report"):
        model(x * 5)
    for key, (mn, mx) in _values(_frames_of(eager5)).items():
        assert _close(last[key][1], mx, mx) and _close(last[key][0], mn, mx), key


def test_what_a_site_cannot_give_keeps_the_ops():
    """target_dtypes counts (and gradients=True, check="module") are not measured inside the
    graph: such a watcher's graphs keep the ops, and record what eager watching records."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = Stack(n_blocks=1)
    x = torch.randn(2, 8, 16) * 1e3
    ref = Collect()
    with watch(model, sinks=[ref], on_detect="report", target_dtypes=("float16",)):
        model(x)
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report", target_dtypes=("float16",))
    _, codes = run_and_get_code(torch.compile(model), x)
    assert "tensorwatch" in "\n".join(codes)
    got, eager = _frames_of(sink), _frames_of(ref)
    _same_as_eager(eager, got)
    assert [t.overflow for f in got for t in f.tensors] == [t.overflow for f in eager for t in f.tensors]
    w.detach()


def test_two_watched_compiled_models_keep_their_own_frames():
    """Each watcher reads and clears its own sites only: a model called between another's
    batches (or inside one) leaves the other's frames whole."""
    torch.manual_seed(0)
    a, b = Stack(n_blocks=1), Stack(n_blocks=2)
    x = torch.randn(2, 8, 16)
    ref_a, ref_b = Collect(), Collect()
    with watch(a, sinks=[ref_a], on_detect="report"), watch(b, sinks=[ref_b], on_detect="report"):
        a(x)
        b(x)
    sink_a, sink_b = Collect(), Collect()
    wa = watch(a, sinks=[sink_a], on_detect="report")
    wb = watch(b, sinks=[sink_b], on_detect="report")
    ca, cb = torch.compile(a), torch.compile(b)
    for _ in range(2):
        ca(x)
        cb(x)
    _same_as_eager(_frames_of(ref_a), _frames_of(sink_a))
    _same_as_eager(_frames_of(ref_b), _frames_of(sink_b))
    wa.detach()
    wb.detach()


def test_the_traced_hooks_add_no_guard_on_the_watchers_objects_or_parameter_keys():
    """Dynamo checks a graph's guards at every call: a traced hook that read its ModuleInfo, or
    walked a module's parameter dict, added guards on them for every watched module (among them
    one in Python: `module._parameters is info.params`). The sites read what they need as
    constants of the graph instead."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch.manual_seed(0)
    model = Stack(n_blocks=2)
    x = torch.randn(2, 8, 16)
    with watch(model, sinks=[Collect()], on_detect="report"):
        torch.compile(model)(x)
        entries = _debug_get_cache_entry_list(type(model).forward.__code__)
        assert entries
        guards = str(entries[0].guard_manager)
    assert "._info" not in guards
    assert "._parameters))" not in guards  # (a guard on a parameter dict's keys: list(dict.keys(m._parameters)))


def test_the_variable_is_read_where_the_options_are_built_not_at_import(monkeypatch):
    """TENSORWATCH_GRAPH_STATS set after the package was imported still decides, at watch()."""
    monkeypatch.setattr(graph_stats, "ON", graph_stats.ON)  # (both put back after the test)
    monkeypatch.setattr(graph_stats, "EVERY_DEVICE", graph_stats.EVERY_DEVICE)
    seen = []
    for value in ("0", "cpu", "1", None):
        if value is None:
            monkeypatch.delenv("TENSORWATCH_GRAPH_STATS", raising=False)
        else:
            monkeypatch.setenv("TENSORWATCH_GRAPH_STATS", value)
        watch(nn.Linear(2, 2), sinks=[]).detach()
        seen.append((graph_stats.ON, graph_stats.EVERY_DEVICE))
    assert seen == [(False, False), (True, False), (True, True), (True, True)]


def test_the_default_is_every_device_and_a_bad_value_is_an_error_naming_the_variable(monkeypatch):
    from tensorwatch_otel.core import env
    from tensorwatch_otel.core.env import ConfigError

    assert env.graph_stats_mode({}) == "1"  # every device
    assert [env.graph_stats_mode({"TENSORWATCH_GRAPH_STATS": v}) for v in ("1", "on", "0", "off", "CPU")] == \
        ["1", "1", "0", "0", "cpu"]
    monkeypatch.setattr(graph_stats, "EVERY_DEVICE", False)
    assert graph_stats.device_allowed("cpu") and not graph_stats.device_allowed("cuda")
    monkeypatch.setattr(graph_stats, "EVERY_DEVICE", True)
    assert graph_stats.device_allowed("cuda")
    monkeypatch.setenv("TENSORWATCH_GRAPH_STATS", "sometimes")
    with pytest.raises(ConfigError, match="TENSORWATCH_GRAPH_STATS='sometimes'"):
        watch(nn.Linear(2, 2), sinks=[])


def test_a_watched_model_run_inside_another_ones_compiled_call_leaves_its_frames_whole():
    """Model B (watched on its own, compiled) runs in a graph break of model A's compiled call:
    B's batch begins while A's first graph holds its sites' values unread. Each watcher clears
    and reads only its own sites, so A keeps the frames of both its graphs."""
    torch.manual_seed(0)
    other = Stack(n_blocks=1)
    other_c = torch.compile(other)

    @torch._dynamo.disable
    def run_other(h):
        return other_c(h)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            h = self.body(x)
            y = run_other(h)
            return self.head(y)

    outer = Outer()
    x = torch.randn(2, 8, 16)
    ref = Collect()
    with watch(outer, sinks=[ref], on_detect="report"), watch(other, sinks=[Collect()], on_detect="report"):
        outer(x)
    sink, sink_other = Collect(), Collect()
    wa = watch(outer, sinks=[sink], on_detect="report")
    wb = watch(other, sinks=[sink_other], on_detect="report")
    compiled = torch.compile(outer)
    for _ in range(2):
        compiled(x)
    assert [f.module for f in _frames_of(sink)] == ["body", "head", ""]
    _same_as_eager(_frames_of(ref), _frames_of(sink))
    assert len(sink_other.batches) == 2 and len(_frames_of(sink_other)) > 1
    wa.detach()
    wb.detach()


def test_a_second_thread_calling_a_compiled_watched_model_is_warned_of_once(caplog):
    """A site's values are the process's: threads running one watcher's graphs at the same time
    can read each other's. The watcher says so once, at WARNING, naming the switch back to the
    ops (per thread); batches run one after another keep their values."""
    import logging
    import threading

    torch.manual_seed(0)
    model = Stack(n_blocks=1)
    xs = [torch.randn(2, 8, 16), torch.randn(2, 8, 16) * 100]
    refs = []
    for x in xs:
        ref = Collect()
        with watch(model, sinks=[ref], on_detect="report"):
            model(x)
        refs.append(_frames_of(ref))
    sink = Collect()
    w = watch(model, sinks=[sink], on_detect="report")
    compiled = torch.compile(model)
    compiled(xs[0])
    _same_as_eager(refs[0], _frames_of(sink))
    caplog.set_level(logging.WARNING, logger="tensorwatch_otel")
    for _ in range(2):
        t = threading.Thread(target=lambda: compiled(xs[1]))
        t.start()
        t.join()
    said = [r for r in caplog.records if "TENSORWATCH_GRAPH_STATS=0" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    _same_as_eager(refs[1], _frames_of(sink))
    compiled(xs[0])
    _same_as_eager(refs[0], _frames_of(sink))
    w.detach()


def test_threads_calling_an_eager_watched_model_say_nothing_of_graphs(caplog):
    """Only a watcher with sites of its own warns: an eager model called from two threads (a
    server, a data-parallel replica) says nothing of compiled graphs."""
    import threading

    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with watch(model, sinks=[Collect()], on_detect="report"):
        model(x)
        t = threading.Thread(target=lambda: model(x))
        t.start()
        t.join()
        model(x)
    assert graph_stats.ON is True
    assert not [r for r in caplog.records if "TENSORWATCH_GRAPH_STATS=0" in r.getMessage()]


def _train_step_compiled_watched(seed: int) -> None:
    """One watched training step of a fresh pre-norm stack, compiled (forward and backward)."""
    torch.manual_seed(seed)
    model = Stack(n_blocks=2)
    with watch(model, sinks=[Collect()], on_detect="report"):
        torch.compile(model)(torch.randn(2, 8, 16)).pow(2).mean().backward()


def test_a_watched_model_compiled_again_in_the_same_process_loads_its_graphs_from_the_caches():
    """A second watch of the same architecture (a new trial, a restarted loop, a test after a
    test) traces the same graph, so inductor's and AOTAutograd's caches serve it: its layouts
    are numbered by what they are, not by how many were traced before (a process counter in
    the graph made every compile after the first a cache miss: a watched model's whole
    compile, tens of seconds, again)."""
    from torch._dynamo.utils import counters

    _train_step_compiled_watched(0)
    torch._dynamo.reset()
    counters.clear()
    _train_step_compiled_watched(1)
    inductor, aot = dict(counters["inductor"]), dict(counters["aot_autograd"])
    assert inductor.get("fxgraph_cache_miss", 0) == 0, inductor
    assert inductor.get("fxgraph_cache_hit", 0) >= 1, inductor
    assert aot.get("autograd_cache_hit", 0) >= 1 and aot.get("autograd_cache_miss", 0) == 0, aot


def test_a_layouts_number_is_the_same_in_every_process_whatever_was_traced_before():
    """A layout's number is a constant of the graph: if it depended on the layouts a process
    traced before (a counter), the same model compiled in another process (a restarted run
    that compiled its eval model first, another rank, another test) would be another graph,
    a miss in inductor's cache shared on disk. Two fresh registries fed the same layouts in
    opposite orders give each the same number, a float64 holds it exactly, and a registry
    holding one already gives it back for the same layout."""
    from tensorwatch_otel.core.measure.graph_sites import _Sites

    layouts = [("cpu", -1, "(T)T", ("weight", "bias"), "mmmm", ("float32",) * 4),
               ("cpu", -1, "(T)T", (), "mm", ("float32", "float32")),
               ("cpu", -1, "(T)T", (), "mm", ("float16", "float16")),
               ("cpu", -1, "(TN)(TT)", ("weight",), "mmmm", ("bfloat16",) * 4)]
    first, second = _Sites(), _Sites()
    forward = [first.add(*layout) for layout in layouts]
    backward = [second.add(*layout) for layout in reversed(layouts)][::-1]
    assert forward == backward and len(set(forward)) == len(layouts), (forward, backward)
    assert all(0 < n < 2 ** 53 and float(n) == n for n in forward)
    assert [first.add(*layout) for layout in layouts] == forward


def test_compiling_a_watched_model_traces_it_once():
    """The row id and the batch stamp the graph reads are not scalars dynamo turns into
    symbolic floats: one of those, specialized after the trace, made dynamo trace the whole
    model a second time (a restart of its analysis: seconds of compile time on every watched
    compile)."""
    import logging

    restarts = []

    class _Restarts(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "Restarting analysis" in record.getMessage():
                restarts.append(record.getMessage())

    handler = _Restarts(level=logging.INFO)
    log = logging.getLogger("torch._dynamo.convert_frame")
    torch._logging.set_logs(dynamo=logging.INFO)
    log.addHandler(handler)
    try:
        _train_step_compiled_watched(0)
    finally:
        log.removeHandler(handler)
        torch._logging.set_logs()
    assert restarts == []
