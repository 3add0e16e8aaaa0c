"""The batch lifecycle's state machine (core/batch/lifecycle.py, core/batch/thread_batch.py): each
thread's batch is IDLE, RECORDING, UNSAMPLED or QUIET, read here from inside real models' forwards
as they run, and the phase changes only through ThreadBatch.open / close (IDLE <-> an open phase)."""

from __future__ import annotations

import ast
import pathlib
import threading

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from _collect import Collect
from tensorwatch_otel import DebugUnderflowOverflow, NonFiniteDetected, watch
from tensorwatch_otel.core.batch.thread_batch import Phase, ThreadBatch
from tensorwatch_otel.core.record import Record

CORE = pathlib.Path(__file__).resolve().parent.parent / "tensorwatch_otel" / "core"
IDLE, RECORDING, UNSAMPLED, QUIET = Phase.IDLE, Phase.RECORDING, Phase.UNSAMPLED, Phase.QUIET


class Probe(nn.Module):
    """Writes down, as its forward runs, the phase of the calling thread's batch, its number and
    the call depth; raises when told to."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.life = None
        self.seen = []
        self.fail = False

    def forward(self, x):
        st = self.life.state()
        self.seen.append((st.phase, st.rec.batch_number if st.rec is not None else None, st.depth))
        if self.fail:
            raise RuntimeError("boom")
        return self.lin(x)


class Net(nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.probe = Probe()
        self.out = nn.Linear(4, 2)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = torch.relu(self.inp(x))
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.probe, h, use_reentrant=False)
        else:
            h = self.probe(h)
        return self.out(h)


def _watched(model, **kw):
    sink = Collect()
    w = watch(model, sinks=[sink], **kw)
    model.probe.life = w._session.life
    return w, sink


def _phases(model):
    return [p for p, _, _ in model.probe.seen]


def test_idle_between_batches_recording_inside_a_sampled_one():
    torch.manual_seed(0)
    model = Net()
    w, sink = _watched(model)
    assert w._session.life.phase is IDLE and w._session.life.state().rec is None
    x = torch.randn(3, 4)
    for b in range(3):
        model(x)
        assert w._session.life.phase is IDLE and w._session.life.state().depth == 0  # the root's return ended it
        assert w.batch_number == b + 1
    # inside: the probe's call is the root's child (depth 2: root and probe pre-hooks counted)
    assert model.probe.seen == [(RECORDING, 0, 2), (RECORDING, 1, 2), (RECORDING, 2, 2)]
    assert [b.batch_number for b in sink.batches] == [0, 1, 2]
    w.detach()


def test_unsampled_batches_are_quiet_and_unsampled_once_quiet_is_off():
    torch.manual_seed(0)
    model = Net()
    w, sink = _watched(model, every_n_batches=3)
    x = torch.randn(3, 4)
    for _ in range(4):
        model(x)
        assert w._session.life.phase is IDLE
    # batches 1 and 2: hooks off (the probe's pre-hook did not count: depth 1, the root's)
    assert model.probe.seen == [(RECORDING, 0, 2), (QUIET, 1, 1), (QUIET, 2, 1), (RECORDING, 3, 2)]
    # a second thread turns quiet batches off: an unsampled batch keeps every hook (UNSAMPLED)
    t = threading.Thread(target=model, args=(x,))
    t.start()
    t.join()  # batch 4 (unsampled), in that thread
    model.probe.seen.clear()
    for _ in range(3):
        model(x)  # batches 5 (unsampled), 6 (recorded: one in 3), 7 (unsampled)
    assert model.probe.seen == [(UNSAMPLED, 5, 2), (RECORDING, 6, 2), (UNSAMPLED, 7, 2)]
    assert w._session.life.phase is IDLE
    assert [b.batch_number for b in sink.batches] == [0, 3, 6]
    w.detach()


def test_a_batch_block_holds_the_batch_open_across_calls_and_ends_at_release():
    torch.manual_seed(0)
    model = Net()
    w, sink = _watched(model)
    x = torch.randn(3, 4)
    with w.batch():
        assert w._session.life.phase is IDLE  # a block in which nothing ran has begun no batch
        model(x)
        assert w._session.life.phase is RECORDING and w.batch_number == 0  # the root returned: still open
        with w.batch():  # nested: the same batch
            model.probe(x)
        assert w._session.life.phase is RECORDING
        model(x)
    assert w._session.life.phase is IDLE and w.batch_number == 1
    assert model.probe.seen == [(RECORDING, 0, 2), (RECORDING, 0, 1), (RECORDING, 0, 2)]
    assert [b.batch_number for b in sink.batches] == [0]
    assert [f.module for f in sink.batches[0].frames] == ["inp", "probe.lin", "probe", "out", "",
                                                          "probe.lin", "probe",
                                                          "inp", "probe.lin", "probe", "out", ""]
    w.detach()


def test_an_unsampled_batch_block_stays_quiet_until_release():
    torch.manual_seed(0)
    model = Net()
    w, sink = _watched(model, every_n_batches=2)
    x = torch.randn(3, 4)
    model(x)  # batch 0, recorded
    with w.batch():
        model(x)
        assert w._session.life.phase is QUIET
        model(x)
        assert w._session.life.phase is QUIET
    assert w._session.life.phase is IDLE
    assert _phases(model) == [RECORDING, QUIET, QUIET]
    model(x)  # batch 2: the hooks are back
    assert _phases(model)[-1] is RECORDING and w._session.life.phase is IDLE
    assert [b.batch_number for b in sink.batches] == [0, 2]
    w.detach()


def test_checkpoint_recomputation_in_backward_opens_no_batch():
    torch.manual_seed(0)
    model = Net(checkpointed=True)
    w, sink = _watched(model)
    x = torch.randn(3, 4)
    for _ in range(2):
        model(x).sum().backward()
        assert w._session.life.phase is IDLE
    # each forward: RECORDING; each backward recomputes the probe: IDLE, no batch number
    assert [(p, b) for p, b, _ in model.probe.seen] == [(RECORDING, 0), (IDLE, None), (RECORDING, 1), (IDLE, None)]
    assert w.batch_number == 2 and [b.batch_number for b in sink.batches] == [0, 1]
    w.detach()


def test_jit_trace_opens_no_batch():
    torch.manual_seed(0)
    model = Net()
    w, sink = _watched(model)
    torch.jit.trace(model, torch.randn(3, 4), check_trace=False)
    assert _phases(model) == [IDLE] and w.batch_number == 0 and not sink.batches
    w.detach()


@pytest.mark.parametrize("every", [1, 2])
def test_an_exception_in_forward_returns_the_thread_to_idle(every):
    torch.manual_seed(0)
    model = Net()
    w, sink = _watched(model, every_n_batches=every)
    x = torch.randn(3, 4)
    model(x)  # batch 0, recorded
    model.probe.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(x)  # batch 1: recorded (every=1) or quiet (every=2)
    assert w._session.life.phase is IDLE and w._session.life.state().depth == 0
    model.probe.fail = False
    model(x)  # batch 2: recorded either way
    assert _phases(model) == [RECORDING, RECORDING if every == 1 else QUIET, RECORDING]
    assert w._session.life.phase is IDLE and w.batch_number == 3
    w.detach()


def test_a_detection_raised_in_the_outermost_frame_still_ends_the_batch():
    torch.manual_seed(0)
    model = Net()
    w, _ = _watched(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        model.out.bias[0] = float("inf")
    with pytest.raises(NonFiniteDetected):
        model(x)
    assert w._session.life.phase is IDLE and w._session.life.state().depth == 0 and w.batch_number == 1
    w.detach()


def test_the_peers_submodule_calls_keep_one_batch_open_until_the_root_returns():
    torch.manual_seed(0)
    model = Net()
    o = DebugUnderflowOverflow(model)
    life = o._watcher._session.life
    model.probe.life = life
    x = torch.randn(3, 4)
    model.probe(x)  # an outermost call of a submodule: the batch goes on
    assert life.phase is RECORDING
    model(x)  # the root's call ends it
    assert life.phase is IDLE
    assert [(p, b) for p, b, _ in model.probe.seen] == [(RECORDING, 0), (RECORDING, 0)]
    o._watcher.detach()


def test_each_thread_has_its_own_phase():
    torch.manual_seed(0)
    model = Net()
    w, _ = _watched(model)
    seen = []
    inside = threading.Event()
    go = threading.Event()

    def other():
        with w.batch():
            model(torch.randn(3, 4))
            seen.append(w._session.life.phase)
            inside.set()
            go.wait(10)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    assert seen == [RECORDING] and w._session.life.phase is IDLE  # that thread's batch is open, not this one's
    go.set()
    t.join()
    w.detach()


def test_the_transitions_are_idle_to_an_open_phase_and_back_only():
    st = ThreadBatch(4)
    assert (st.phase, st.recording, st.quiet, st.rec) == (IDLE, False, False, None)
    with pytest.raises(RuntimeError, match="IDLE -> IDLE"):
        st.close()
    with pytest.raises(RuntimeError, match="no batch is open"):
        st.carry_on(Record(0))
    for phase, flags in ((RECORDING, (True, False)), (UNSAMPLED, (False, False)), (QUIET, (False, True))):
        rec = Record(7)
        st.open(rec, phase)
        assert (st.phase, st.recording, st.quiet, st.rec) == (phase, *flags, rec)
        for again in (RECORDING, UNSAMPLED, QUIET):
            with pytest.raises(RuntimeError, match=f"{phase.name} -> {again.name}"):
                st.open(Record(8), again)
        assert st.rec is rec and st.phase is phase  # a refused move changes nothing
        later = Record(7, header=False)
        assert st.carry_on(later) is rec and st.phase is phase
        st.entry = nn.Linear(1, 1)
        st.checked = 3
        assert st.close() is later
        assert (st.phase, st.recording, st.quiet, st.rec, st.entry, st.checked) == (IDLE, False, False, None, None, 0)
    with pytest.raises(RuntimeError, match="IDLE -> IDLE"):
        st.open(Record(9), IDLE)


_PHASE_FLAGS = {"phase", "recording", "quiet"}
_WRITERS = {"phase": {"__init__", "_to"}, "recording": {"__init__", "_to"}, "quiet": {"__init__", "_to"},
            "rec": {"__init__", "open", "close", "carry_on"}}


def _attribute_writes(tree):
    """(function name, attribute, object) for each `obj.attr = ...` / `obj.attr += ...`."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute):
                        found.append((fn.name, sub.attr, ast.unparse(sub.value)))
    return found


def test_only_the_thread_batch_changes_its_phase_and_record():
    """The phase, its flags and the record are written by ThreadBatch's own methods (the flags
    only where the phase changes): no hook or lifecycle method sets them past the transitions."""
    tree = ast.parse((CORE / "batch" / "thread_batch.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ThreadBatch"]
    inside = _attribute_writes(cls)
    assert {(f, a) for f, a, o in inside if a in _WRITERS} == \
        {(f, a) for a, fs in _WRITERS.items() for f in fs}
    assert all(o == "self" for _, a, o in inside if a in _WRITERS)
    outside = [(path.name, f, a, o) for path in sorted(CORE.rglob("*.py"))
               for f, a, o in _attribute_writes(ast.parse(path.read_text()))
               if a in _WRITERS and o != "self"]
    assert outside == []
    others = [w for w in _attribute_writes(tree) if w not in inside and w[1] in _PHASE_FLAGS | {"rec"}]
    assert others == []
