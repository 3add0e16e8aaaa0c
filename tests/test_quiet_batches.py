"""Unsampled batches (`every_n_batches`) run the model's inner modules without our hooks.

A module with a forward hook goes through torch's slow call path (a closure, the hook loops),
which alone cost about 1.3x the forward at 5000 small modules. So a batch the watcher does not
record takes the forward hooks of every module but the root off at its start and puts them back,
in their places, when the root returns. Tested here: what a module sees during such a batch,
that everything is back in order afterwards, and the cases where the hooks stay (a batch a
sampled batch, a submodule called directly, a second thread, a compiled model, other hooks)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

from tensorwatch_otel import watch
from _collect import Collect


class Seen(nn.Linear):
    """A Linear that notes, at each call, whether it has forward hooks (its call took torch's
    slow path) and which of them."""

    def __init__(self, n: int = 4):
        super().__init__(n, n)
        self.seen: list = []

    def forward(self, x):
        self.seen.append((len(self._forward_pre_hooks), len(self._forward_hooks)))
        return super().forward(x)


class Net(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(*[Seen() for _ in range(n)])
        self.head = Seen()

    def forward(self, x):
        return self.head(self.blocks(x))


def _hooks(model):
    """Every module's forward hook dicts as (keys, callables), in order."""
    return [(list(m._forward_pre_hooks.items()), list(m._forward_hooks.items())) for m in model.modules()]


def _seen(model):
    return [s for m in model.modules() if isinstance(m, Seen) for s in m.seen]


def _clear(model):
    for m in model.modules():
        if isinstance(m, Seen):
            m.seen.clear()


def _sentries():
    return len(torch.nn.modules.module._global_forward_pre_hooks)


@pytest.fixture(autouse=True)
def _no_sentry_left():
    """A failed test must not leave a global hook behind for the others."""
    before = dict(torch.nn.modules.module._global_forward_pre_hooks)
    yield
    left = torch.nn.modules.module._global_forward_pre_hooks
    for k in [k for k in left if k not in before]:
        del left[k]


def test_an_unsampled_batch_runs_inner_modules_without_hooks_and_a_recorded_one_puts_them_back():
    model = Net()
    sink = Collect()
    w = watch(model, sinks=[sink], every_n_batches=3)
    placed = _hooks(model)
    off = [placed[0]] + [([], [])] * (len(placed) - 1)  # the root keeps its own
    x = torch.randn(2, 4)
    per_batch = []
    for b in range(7):
        _clear(model)
        model(x).sum().backward()
        per_batch.append(_seen(model))
        if b % 3 == 0:
            assert _hooks(model) == placed and _sentries() == 0, b  # same keys, callables, order
        else:
            assert _hooks(model) == off and _sentries() == 1, b  # off until the next recorded batch
    for b, seen in enumerate(per_batch):
        assert len(seen) == 4
        if b % 3 == 0:
            assert seen == [(1, 1)] * 4, b  # a recorded batch: every module hooked
        else:
            assert seen == [(0, 0)] * 4, b  # torch's fast path: no hook at all
    assert [b.batch_number for b in sink.batches] == [0, 3, 6]
    assert all(len(b.frames) == 6 for b in sink.batches)
    model(x)  # batch 7, unsampled: the hooks stay off after it
    assert _hooks(model) == off
    w.detach()
    assert _hooks(model) == [([], [])] * len(placed) and _sentries() == 0


class SentrySeen(nn.Linear):
    """A Linear of another model that notes, at each call, how many global forward pre-hooks
    exist (one: the call took torch's slow path and called the sentry)."""

    def __init__(self, n: int = 4):
        super().__init__(n, n)
        self.seen: list = []

    def forward(self, x):
        self.seen.append(_sentries())
        return super().forward(x)


def test_a_loss_module_between_batches_leaves_quiet_batches_on():
    """The common loop calls a loss module (not the watcher's) after the forward: between two
    batches, with the sentry up. A few such calls cost microseconds; the hooks stay off."""
    model = Net()
    crit = nn.MSELoss()
    w = watch(model, sinks=[], every_n_batches=3)
    x = torch.randn(2, 4)
    for b in range(7):
        _clear(model)
        out = model(x)
        crit(out, torch.zeros_like(out)).backward()
        assert _seen(model) == ([(1, 1)] * 4 if b % 3 == 0 else [(0, 0)] * 4), b
        assert _sentries() == (0 if b % 3 == 0 else 1), b
    w.detach()
    assert _sentries() == 0


def test_another_model_between_batches_turns_quiet_batches_off_and_takes_the_fast_path():
    """A second model trained in the same process (a teacher, a reference model, a benchmark's
    unwatched twin): while the sentry is up every module call in the process takes torch's
    slow path (a global hook exists) and calls the sentry (measured: an unwatched 5000-module
    model's step 1.25x with a sampled watcher on another model, docs/performance.md). At the
    FOREIGN_CALLS-th call of modules not ours between two batches the hooks go back and the
    sentry goes for good: the other model's later calls run on torch's fast path, the watched
    model's unsampled batches keep their hooks on (they cost the watched model, not the other
    one), and its recorded batches are the same."""
    from tensorwatch_otel.core.frames.quiet import FOREIGN_CALLS

    torch.manual_seed(0)
    watched = Net()
    other = nn.Sequential(*[SentrySeen() for _ in range(FOREIGN_CALLS + 16)])
    sink = Collect()
    w = watch(watched, sinks=[sink], every_n_batches=3)
    placed = _hooks(watched)
    x = torch.randn(2, 4)
    watched(x).sum().backward()  # batch 0, recorded
    watched(x).sum().backward()  # batch 1, unsampled: the hooks stay off after it
    assert _sentries() == 1 and _hooks(watched) != placed
    other(x).sum().backward()  # the other model, between two unsampled batches
    assert _sentries() == 0 and _hooks(watched) == placed
    seen = [m.seen[0] for m in other]
    # (its root's call is the first; the FOREIGN_CALLS-th, module FOREIGN_CALLS - 2's, puts the
    # hooks back and takes the sentry off before that module's forward runs)
    assert seen == [1] * (FOREIGN_CALLS - 2) + [0] * 18, seen
    for _ in range(5):  # batches 2..6 of the watched model, the other model's steps between them
        _clear(watched)
        watched(x).sum().backward()
        assert _seen(watched) == [(1, 1)] * 4 and _sentries() == 0  # hooks on in every batch
        other(x).sum().backward()
    assert all(m.seen[1:] == [0] * 5 for m in other)  # never the slow path again
    assert [b.batch_number for b in sink.batches] == [0, 3, 6]
    assert all(len(b.frames) == 6 for b in sink.batches)
    w.detach()
    assert _sentries() == 0 and _hooks(watched) == [([], [])] * len(placed)


def test_recorded_batches_are_the_same_as_without_quiet_batches():
    torch.manual_seed(0)
    a = Net()
    b = Net()
    b.load_state_dict(a.state_dict())
    sa, sb = Collect(), Collect()
    wa = watch(a, sinks=[sa], every_n_batches=2)
    wb = watch(b, sinks=[sb], every_n_batches=1)
    x = torch.randn(2, 4)
    for _ in range(5):
        a(x)
        b(x)
    kept = [s for s in sb.batches if s.batch_number % 2 == 0]
    assert [s.batch_number for s in sa.batches] == [s.batch_number for s in kept] == [0, 2, 4]
    for ra, rb in zip(sa.batches, kept):
        fa, fb = ra.frames, rb.frames
        assert [(f.module, [(t.name, t.abs_min, t.abs_max) for t in f.tensors]) for f in fa] == \
            [(f.module, [(t.name, t.abs_min, t.abs_max) for t in f.tensors]) for f in fb]
    wa.detach()
    wb.detach()


def test_another_hook_on_a_module_keeps_its_place_and_runs_in_every_batch():
    model = Net()
    w = watch(model, sinks=[], every_n_batches=4)
    runs = []
    user = model.blocks[1].register_forward_hook(lambda m, a, o: runs.append(1))  # after ours
    placed = _hooks(model)
    x = torch.randn(2, 4)
    for _ in range(4):
        model(x)
    model.blocks[0](x)  # a call the sentry sees: every hook back
    assert _hooks(model) == placed
    assert len(runs) == 4
    assert model.blocks[1].seen[1:] == [(1, 2)] * 3  # that module kept both of ours, in order
    assert model.blocks[0].seen[1:4] == [(0, 0)] * 3
    user.remove()
    w.detach()


def test_a_submodule_called_directly_is_its_own_batch_as_before():
    model = Net()
    sink = Collect()
    w = watch(model, sinks=[sink], every_n_batches=2)
    x = torch.randn(2, 4)
    model(x)          # batch 0, recorded
    model.blocks(x)   # batch 1: its own batch (not recorded)
    model.blocks(x)   # batch 2: recorded, the blocks' frames
    model(x)          # batch 3: unsampled, hooks off after it
    model.blocks(x)   # batch 4: called while the hooks are off: the sentry puts them back
    model.blocks[2](x)  # batch 5
    model.head(x)     # batch 6
    assert [b.batch_number for b in sink.batches] == [0, 2, 4, 6]
    assert [f.module for f in sink.batches[1].frames] == ["blocks.0", "blocks.1", "blocks.2", "blocks"]
    assert [f.module for f in sink.batches[2].frames] == ["blocks.0", "blocks.1", "blocks.2", "blocks"]
    assert [f.module for f in sink.batches[3].frames] == ["head"]
    assert w.batch_number == 7
    w.detach()


def test_a_checkpointed_block_recomputed_in_the_backward_is_no_batch_as_before():
    from torch.utils.checkpoint import checkpoint

    class Ckpt(Net):
        def forward(self, x):
            return self.head(checkpoint(self.blocks, x, use_reentrant=False))

    torch.manual_seed(0)
    model = Ckpt()
    sink = Collect()
    w = watch(model, sinks=[sink], every_n_batches=2)
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(5):
        model(x).sum().backward()
    assert [b.batch_number for b in sink.batches] == [0, 2, 4]
    assert [len(b.frames) for b in sink.batches] == [6, 6, 6]
    assert w.batch_number == 5
    w.detach()


def test_a_detach_inside_an_unsampled_batch_leaves_no_hook_behind():
    model = Net()
    w = watch(model, sinks=[], every_n_batches=2)
    x = torch.randn(2, 4)
    model(x)

    class Detach(nn.Module):
        def forward(self, x):
            w.detach()
            return x

    model.blocks.append(Detach())  # found at the next outermost call (not hooked: it detaches)
    model(x)  # batch 1, unsampled: detached from inside the forward
    assert _hooks(model) == [([], [])] * len(list(model.modules()))


def test_a_second_thread_turns_quiet_batches_off_and_both_threads_are_recorded():
    model = Net()
    sink = Collect()
    w = watch(model, sinks=[sink], every_n_batches=2)
    x = torch.randn(2, 4)
    model(x)  # batch 0 in this thread
    inside = threading.Event()
    go_on = threading.Event()

    class Pause(nn.Module):
        def forward(self, x):
            if threading.current_thread() is threading.main_thread() and not inside.is_set():
                inside.set()
                assert go_on.wait(10)
            return x

    model.blocks.insert(1, Pause())
    t = threading.Thread(target=lambda: (inside.wait(10), model(x), go_on.set()))
    t.start()
    model(x)  # batch 1 (unsampled) here; the thread's call in the middle of it is batch 2
    t.join(10)
    assert not t.is_alive()
    model(x)  # batch 3
    model(x)  # batch 4: recorded, with every hook on again
    numbers = [b.batch_number for b in sink.batches]
    assert numbers == [0, 2, 4]
    assert [len(b.frames) for b in sink.batches[1:]] == [7, 7]  # every module, in both threads
    assert model.blocks[2].seen[-1] == (1, 1)
    w.detach()


@pytest.mark.slow
def test_a_compiled_submodule_gets_no_recompile_per_batch():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = nn.Sequential(nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]), nn.Linear(4, 4))
    model[0].compile(backend="aot_eager")
    sink = Collect()
    w = watch(model, sinks=[sink], every_n_batches=3)
    x = torch.randn(2, 4)
    model(x)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(6):
        model(x)
    assert counters["stats"]["unique_graphs"] == graphs
    assert [b.batch_number for b in sink.batches] == [0, 3, 6]
    assert all(len(b.frames) == 6 for b in sink.batches)
    w.detach()


@pytest.mark.slow
def test_a_model_compiled_after_unsampled_batches_is_traced_with_every_hook():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = nn.Sequential(nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]), nn.Linear(4, 4))
    sink = Collect()
    w = watch(model, sinks=[sink], every_n_batches=2)
    x = torch.randn(2, 4)
    model(x)
    model(x)  # batch 1, unsampled: the hooks are off after it, the sentry placed
    assert _sentries() == 1
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(4):
        compiled(x)  # batches 2..5
    assert _sentries() == 0
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert [b.batch_number for b in sink.batches] == [0, 2, 4]
    assert [len(b.frames) for b in sink.batches] == [6, 6, 6]
    w.detach()


def test_batch_blocks_that_call_submodules_are_quiet_when_unsampled_and_whole_when_recorded():
    model = Net()
    sink = Collect()
    w = watch(model, sinks=[sink], every_n_batches=2)
    x = torch.randn(2, 4)
    for _ in range(4):
        _clear(model)
        with w.batch():  # a training_step that calls submodules directly (the Lightning callback's block)
            model.head(model.blocks(x))
            model.blocks[0](x)
    assert [b.batch_number for b in sink.batches] == [0, 2]
    assert [f.module for f in sink.batches[1].frames] == ["blocks.0", "blocks.1", "blocks.2", "blocks", "head",
                                                          "blocks.0"]
    assert model.blocks[1].seen == [(0, 0)]  # batch 3: the blocks' own call kept its hooks, not theirs
    assert w.batch_number == 4
    model(x)  # batch 4: recorded, every module
    assert len(sink.batches[-1].frames) == 6
    w.detach()
    assert _sentries() == 0


def test_calls_that_alternate_between_two_entries_are_each_their_own_batch():
    model = Net()
    sink = Collect()
    w = watch(model, sinks=[sink], every_n_batches=3)
    x = torch.randn(2, 4)
    for _ in range(4):  # an encoder called directly, then the whole model (encoder-decoder generate)
        model.blocks(x)
        model(x)
    assert [b.batch_number for b in sink.batches] == [0, 3, 6]
    assert [len(b.frames) for b in sink.batches] == [4, 6, 4]
    assert w.batch_number == 8
    w.detach()

