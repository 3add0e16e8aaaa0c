"""Side by side: tensorwatch_otel.DebugUnderflowOverflow / detect_overflow against
transformers.debug_utils (the peer) on tiny real transformers models, with real fp16 overflows.

Method: two identical copies of a model (deepcopy before anything is attached: the peer's hooks
can never be removed), the peer on one and ours on the other, the same batches, stdout captured;
the printed text must be equal line for line and both must raise ValueErrors with the same
message. Where the peer has a documented defect, the tests show the peer has it and ours not.

Golden files (tests/golden/*.txt) pin the report's format only: the peer's text with every
number written as `d.dde±dd` (its `%8.2e` field). The numbers themselves depend on the CPU's
float16 kernels (the third digit moves between x86-64 machines), so they are compared live
against the peer, which runs on the same machine; a number printed in another format, a line
added, dropped or reordered, or an inf/nan where the golden has none still fails. Regenerate
after an intended change with

    TENSORWATCH_REGEN_GOLDEN=1 python -m pytest tests/test_dropin_parity.py

and review the diff (git diff tests/golden) before committing.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path
from typing import Callable, Optional, Tuple

import pytest
import torch

import _models as M

debug_utils = pytest.importorskip("transformers.debug_utils")
import tensorwatch_otel as tw  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("TENSORWATCH_REGEN_GOLDEN", "") not in ("", "0")
ARCHS = ["t5", "gpt2", "bert"]

Result = Tuple[str, Optional[BaseException]]


def capture(fn: Callable[[], object]) -> Result:
    """stdout of fn() and the exception it raised (None if none)."""
    buf = io.StringIO()
    exc = None
    with contextlib.redirect_stdout(buf):
        try:
            fn()
        except Exception as e:  # compared by the caller
            exc = e
    return buf.getvalue(), exc


def side_by_side(arch: str, n: int, inject_before: Optional[int] = None, dtype=torch.float16,
                 wrap=None, before_batch=None, **kwargs):
    """Run `n` batches on twin models, the peer on one and ours on the other.
    Returns (peer_result, ours_result, peer_object, ours_object)."""
    a, b = M.twins(arch, dtype)
    if wrap is not None:
        a, b = wrap(a), wrap(b)
    peer = debug_utils.DebugUnderflowOverflow(a, **kwargs)
    ours = tw.DebugUnderflowOverflow(b, **kwargs)

    def runner(model):
        def go():
            for i, kw in enumerate(M.batches(arch, n)):
                if i == inject_before:
                    M.inject_overflow(model, _path(model, arch))
                if before_batch is not None:
                    before_batch(model, i)
                with torch.no_grad():
                    model(**kw)
        return go

    return capture(runner(a)), capture(runner(b)), peer, ours


def _path(model, arch):
    prefix = "inner." if hasattr(model, "inner") else ""
    return prefix + M.OVERFLOW_AT[arch]


def assert_same(peer: Result, ours: Result) -> None:
    (pt, pe), (ot, oe) = peer, ours
    assert ot == pt, "report text differs from the peer's"
    assert (pe is None) == (oe is None), f"peer raised {pe!r}, ours {oe!r}"
    if pe is not None:
        assert isinstance(pe, ValueError) and isinstance(oe, ValueError)
        assert str(oe) == str(pe)


# A finite number as the report prints it ("%8.2e"): the only machine-dependent part of the text.
_NUMBER = re.compile(r"(?<![\w.])\d\.\d\de[-+]\d{2,3}(?![\w.])")
NUMBER_MASK = "d.dde\u00b1dd"


def skeleton(text: str) -> str:
    """The report's format: `text` with every printed finite number masked."""
    return _NUMBER.sub(NUMBER_MASK, text)


def check_golden(name: str, text: str, reference: str) -> None:
    """Ours (`text`) against the peer's live `reference` for the numbers, and against the stored
    skeleton for the format; the flag stores the skeleton of the peer's text."""
    assert text == reference, "report text differs from the peer's (live, same machine)"
    path = GOLDEN / f"{name}.txt"
    if REGEN:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(skeleton(reference), encoding="utf-8")
    assert path.exists(), f"{path} missing: run with TENSORWATCH_REGEN_GOLDEN=1"
    assert skeleton(text) == path.read_text(encoding="utf-8"), \
        f"format differs from {path} (TENSORWATCH_REGEN_GOLDEN=1 regenerates)"


def test_golden_check_pins_format_not_digits(tmp_path, monkeypatch):
    # The digits of a number may differ from the stored golden (another CPU); its format, the
    # lines and inf/nan may not; and ours must equal the peer's live text in every digit.
    monkeypatch.setattr(__import__(__name__), "GOLDEN", tmp_path)
    monkeypatch.setattr(__import__(__name__), "REGEN", False)
    ref = "                  m Linear\n9.06e-06 6.59e-02 weight\n1.07e+00      inf output\n"
    (tmp_path / "g.txt").write_text(skeleton(ref), encoding="utf-8")
    assert skeleton(ref) == ("                  m Linear\nd.dde\u00b1dd d.dde\u00b1dd weight\n"
                             "d.dde\u00b1dd      inf output\n")
    other_cpu = ref.replace("9.06e-06 6.59e-02", "9.07e-06 6.61e-02").replace("1.07e+00", "9.99e-01")
    check_golden("g", other_cpu, other_cpu)  # other digits, same format: passes
    for ours, peer in [
        (other_cpu, ref),  # a numeric disagreement with the live peer
        (ref.replace("9.06e-06", "9.1e-06"), ref.replace("9.06e-06", "9.1e-06")),  # another format
        (ref.replace("     inf", "1.00e+04"), ref.replace("     inf", "1.00e+04")),  # inf gone
        (ref.replace("weight", "bias"), ref.replace("weight", "bias")),  # another tensor line
        (ref + "extra\n", ref + "extra\n"),  # a line added
    ]:
        with pytest.raises(AssertionError):
            check_golden("g", ours, peer)


def test_goldens_hold_no_digits_of_a_number():
    # what makes them CPU-independent: every finite value is masked in the stored files
    files = sorted(GOLDEN.glob("*.txt"))
    assert len(files) == 5
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\d\.\d+e[-+]?\d+", text), path
    assert NUMBER_MASK in (GOLDEN / "t5_detect_batch0.txt").read_text(encoding="utf-8")


def frames_listed(text: str) -> int:
    m = re.search(r"Last (\d+) forward frames:", text)
    return int(m.group(1)) if m else -1


def has_lines(text: str):
    return [ln for ln in text.splitlines() if ln.endswith((" has nans", " has infs"))]


# ------------------------------------------------------------------ detection mode


@pytest.mark.parametrize("arch", ARCHS)
def test_detection_overflow_at_batch0(arch):
    peer, ours, _, _ = side_by_side(arch, 2, inject_before=0)
    assert_same(peer, ours)
    text = ours[0]
    assert "Detected inf/nan during batch_number=0" in text
    assert 0 < frames_listed(text) <= 21
    assert "*** Starting batch number=0 ***" in text
    assert "      inf output" in text  # a real fp16 overflow, not an injected inf
    if arch == "t5":
        check_golden("t5_detect_batch0", text, peer[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_detection_later_batch_ring_spans_boundary(arch):
    # enough frames that the ring reaches back into batch 1: the batch 2 header is inside it
    peer, ours, _, _ = side_by_side(arch, 4, inject_before=2, max_frames_to_save=40)
    assert_same(peer, ours)
    text = ours[0]
    assert "Detected inf/nan during batch_number=2" in text
    assert "*** Starting batch number=2 ***" in text
    if arch == "gpt2":
        check_golden("gpt2_detect_batch2_span", text, peer[0])


@pytest.mark.parametrize("arch,frames", [("bert", 1), ("gpt2", 3)])
def test_detection_small_ring(arch, frames):
    peer, ours, _, _ = side_by_side(arch, 3, inject_before=1, max_frames_to_save=frames)
    assert_same(peer, ours)
    assert frames_listed(ours[0]) == frames


def test_detection_large_ring_spans_several_batches():
    peer, ours, _, _ = side_by_side("gpt2", 5, inject_before=3, max_frames_to_save=200)
    assert_same(peer, ours)
    text = ours[0]
    assert 21 < frames_listed(text) < 200  # everything since batch 0
    assert "*** Starting batch number=0 ***" in text and "*** Starting batch number=3 ***" in text


def test_detection_keyword_only_root():
    # the root takes keyword-only inputs (invisible to the peer) and returns a plain tensor
    peer, ours, _, _ = side_by_side("gpt2", 3, inject_before=1, wrap=M.KeywordOnly,
                                    max_frames_to_save=60)
    assert_same(peer, ours)
    assert "                   KeywordOnly\n" in ours[0]  # root frame without any input line


# ------------------------------------------------------------------ trace and abort


def test_trace_fp32_no_overflow():
    peer, ours, _, _ = side_by_side("t5", 4, dtype=torch.float32, trace_batch_nums=[0, 2])
    assert_same(peer, ours)
    text = ours[0]
    assert ours[1] is None
    assert "*** Starting batch number=0 ***" in text and "*** Starting batch number=2 ***" in text
    # untraced batches print nothing, their headers included
    assert "batch number=1 ***" not in text and "batch number=3 ***" not in text
    assert "Detected" not in text
    # outputs the peer cannot look into: ModelOutput at the root, None in tuples and inputs
    assert "     not a tensor output\n" in text
    assert "             None " in text


def test_trace_with_abort():
    peer, ours, _, _ = side_by_side("gpt2", 4, trace_batch_nums=[0, 2], abort_after_batch_num=2)
    assert_same(peer, ours)
    assert "aborting after 3 batches" in str(ours[1])
    check_golden("gpt2_trace_0_2_abort_2", ours[0], peer[0])


def test_detection_right_after_a_trace():
    # the peer's buffer starts empty after a traced batch (its frames were printed already):
    # a detection early in the next batch lists only that batch's frames, in ours too
    peer, ours, _, _ = side_by_side("gpt2", 3, inject_before=1, trace_batch_nums=[0])
    assert_same(peer, ours)
    assert frames_listed(ours[0]) < 21


class _Sample(torch.nn.Module):
    """Samples the next token: torch.multinomial refuses the NaN probabilities an overflow makes."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, **kw):
        logits = self.inner(input_ids=input_ids, **kw).logits[:, -1].float()
        return torch.multinomial(torch.softmax(logits, -1), 1)


def test_forward_failing_after_the_overflow():
    # The peer raises inside the forward at the first bad module; ours checks when the root's
    # forward ends, so a forward that fails later on its own reaches ours' check only through
    # the always_call hook, where torch keeps the forward's own error (and warns about ours).
    # The report printed is the same; the exception is the model's error, not a ValueError.
    with pytest.warns(UserWarning, match="always_call"):
        peer, ours, _, _ = side_by_side("gpt2", 1, inject_before=0, wrap=_Sample)
    assert ours[0] == peer[0] and "Detected inf/nan during batch_number=0" in ours[0]
    assert isinstance(peer[1], ValueError)
    assert isinstance(ours[1], RuntimeError) and "probability tensor" in str(ours[1])


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_abort_alone(arch):
    peer, ours, _, _ = side_by_side(arch, 4, abort_after_batch_num=1)
    assert_same(peer, ours)
    assert ours[0] == "" and isinstance(ours[1], ValueError)
    assert str(ours[1]) == ("DebugUnderflowOverflow: aborting after 2 batches due to "
                            "`abort_after_batch_num=1` arg")


@pytest.mark.parametrize("arch", ARCHS)
def test_trace_of_an_overflowing_batch(arch):
    # batch 1 overflows while traced: the peer prints `{ctx} has nans/infs` as it checks each
    # tensor; downstream tensors hold inf AND nan and both lines are printed. It is the last
    # batch, so the peer's sticky abort (a defect, tested below) does not come into it.
    peer, ours, _, _ = side_by_side(arch, 2, inject_before=1, trace_batch_nums=[1])
    assert_same(peer, ours)
    lines = has_lines(ours[0])
    assert any(ln.endswith("has infs") for ln in lines)
    if arch == "gpt2":
        both = {ln[:-len(" has nans")] for ln in lines if ln.endswith("nans")} & \
            {ln[:-len(" has infs")] for ln in lines if ln.endswith("infs")}
        assert both, "expected a tensor holding both inf and nan in this trace"
        check_golden("gpt2_trace_overflowing_batch", ours[0], peer[0])


# ------------------------------------------------------------------ detect_overflow


def _overflowed_activation() -> torch.Tensor:
    """A real fp16 activation after the injected overflow: GPT-2's c_fc output and its GELU."""
    model = M.build("gpt2")
    M.inject_overflow(model, M.OVERFLOW_AT["gpt2"])
    got = {}
    mlp = model.get_submodule("transformer.h.0.mlp")
    mlp.c_fc.register_forward_hook(lambda m, i, o: got.__setitem__("c_fc", o))
    mlp.act.register_forward_hook(lambda m, i, o: got.__setitem__("act", o))
    with torch.no_grad():
        model(**M.batches("gpt2", 1)[0])
    return got


def test_detect_overflow_lines_and_result():
    acts = _overflowed_activation()
    cases = [
        (torch.ones(4, dtype=torch.float16), "finite"),
        (acts["c_fc"], "c_fc"),  # infs only
        (acts["act"], "act"),  # GELU(-inf) = nan beside +inf: both
        (torch.tensor([float("nan"), 1.0]), "nan_only"),
    ]
    texts = []
    for t, ctx in cases:
        (pt, pe), (ot, oe) = capture(lambda t=t, ctx=ctx: debug_utils.detect_overflow(t, ctx)), \
            capture(lambda t=t, ctx=ctx: tw.detect_overflow(t, ctx))
        assert pe is None and oe is None
        assert ot == pt
        assert tw.detect_overflow(t, ctx) == debug_utils.detect_overflow(t, ctx)
        texts.append((ot, pt))
    assert texts[0][0] == "" and texts[2][0] == "act has nans\nact has infs\n"
    check_golden("detect_overflow", "".join(t[0] for t in texts), "".join(t[1] for t in texts))


def test_detect_overflow_non_tensor_is_value_error():
    with pytest.raises(ValueError):
        tw.detect_overflow([1.0], "list")


# ------------------------------------------------------------------ the peer's defects, fixed


def test_defect_frame_buffer_bounded_after_trace():
    # after a traced batch the peer swaps its bounded deque for a list that grows forever and
    # dumps every frame since the trace; ours keeps the last max_frames_to_save
    peer, ours, p, o = side_by_side("gpt2", 4, inject_before=3, trace_batch_nums=[0],
                                    max_frames_to_save=5)
    assert isinstance(p.frames, list)  # the peer really has the defect
    assert frames_listed(peer[0]) > 5
    assert frames_listed(ours[0]) == 5
    assert isinstance(ours[1], ValueError) and str(ours[1]) == str(peer[1])
    # the trace itself and the last 5 frames are the same text
    trace_end = peer[0].index("\nDetected")
    assert ours[0][:trace_end] == peer[0][:trace_end]
    tail = ours[0][ours[0].index("metadata\n", trace_end) + len("metadata\n"):]
    assert peer[0].endswith(tail)
    assert len(o._watcher._session.history().records) <= 2


def _restore_after(batch):
    saved = {}

    def hook(model, i):
        w = model.get_submodule(M.OVERFLOW_AT["gpt2"]).weight
        if i == batch - 1:
            saved["w"] = w.detach().clone()
        if i == batch + 1:
            with torch.no_grad():
                w.copy_(saved["w"])
    return hook


def test_defect_inf_while_tracing_is_not_sticky():
    # batch 1 overflows while traced; the weight is repaired before batch 2. The peer aborts at
    # the first hook of batch 2 anyway; ours goes on.
    peer, ours, _, _ = side_by_side("gpt2", 4, inject_before=1, trace_batch_nums=[1],
                                    before_batch=_restore_after(1))
    assert isinstance(peer[1], ValueError) and "Detected inf/nan during batch_number=2" in peer[0]
    assert ours[1] is None and "Detected" not in ours[0]
    assert ours[0] == peer[0][:len(ours[0])]  # same trace up to the peer's false alarm


def test_defect_nan_at_root_output_has_right_batch_number():
    peer, ours, _, _ = side_by_side("gpt2", 2, dtype=torch.float32, wrap=M.LogLogits)
    assert "Detected inf/nan during batch_number=1" in peer[0]  # one too high
    assert "Detected inf/nan during batch_number=0" in ours[0]
    assert str(ours[1]) == str(peer[1])
    # apart from the number (and the batch header the peer already appended), the same frames
    assert ours[0].replace("batch_number=0", "batch_number=1") == \
        peer[0].replace("\n\n\n                  *** Starting batch number=1 ***\nabs min  abs max  metadata", "")


def test_defect_hooks_can_be_removed():
    a, b = M.twins("gpt2")
    peer = debug_utils.DebugUnderflowOverflow(a)
    assert not hasattr(peer, "detach")  # the peer keeps no handles
    ours = tw.DebugUnderflowOverflow(b)
    ours.detach()
    ours.detach()  # idempotent
    M.inject_overflow(b, M.OVERFLOW_AT["gpt2"])
    text, exc = capture(lambda: M.run(b, "gpt2", 1))
    assert text == "" and exc is None
    assert not any(m._forward_hooks for m in b.modules())

    c = M.build("bert")
    with tw.DebugUnderflowOverflow(c, trace_batch_nums=[0]):
        text, exc = capture(lambda: M.run(c, "bert", 1))
    assert "*** Starting batch number=0 ***" in text and exc is None
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in c.modules())


def test_defect_traces_print_on_rank0_only(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    peer, ours, _, _ = side_by_side("bert", 2, trace_batch_nums=[0])
    assert "*** Starting batch number=0 ***" in peer[0]  # the peer prints on every rank
    assert ours == ("", None)
    # a detection is printed by the rank that found it
    peer, ours, _, _ = side_by_side("bert", 2, inject_before=1)
    assert_same(peer, ours)


# ------------------------------------------------------------------ inf beside nan


@pytest.mark.parametrize("arch", ARCHS)
def test_first_overflow_frame_has_no_inf_beside_nan(arch):
    # abs min/max of a tensor holding NaN are nan/nan, so ours cannot see an inf beside it and
    # would print only `has nans` where the peer prints both. In real overflows the first
    # non-finite frame holds infs only (inf beside nan appears downstream, which traces show
    # exactly), so detection reports match.
    peer, _, _, _ = side_by_side(arch, 1, inject_before=0)
    lines = has_lines(peer[0])
    assert lines and all(ln.endswith("has infs") for ln in lines)


class _OppositeInfs(torch.nn.Module):
    """A residual sum of two overflowing branches of opposite sign: inf and nan in one output."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4).half()
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(4))
            self.proj.bias.zero_()

    def forward(self, x):
        y = self.proj(x) * 3.0e4  # computed in this module's forward: no frame in between
        return y + y.roll(1, -1)  # +inf + -inf = nan beside -inf


@pytest.mark.xfail(strict=True, reason="abs min/max cannot show an inf beside a NaN in the frame "
                   "that first overflows; only a made-up module gets there")
def test_inf_beside_nan_in_first_frame():
    a = torch.nn.Sequential(_OppositeInfs(), torch.nn.Identity())
    b = torch.nn.Sequential(_OppositeInfs(), torch.nn.Identity())
    debug_utils.DebugUnderflowOverflow(a)
    tw.DebugUnderflowOverflow(b)
    x = torch.tensor([[4.0, -3.0, 2.0, -5.0]], dtype=torch.float16)
    peer, ours = capture(lambda: a(x)), capture(lambda: b(x))
    assert peer[0].startswith("output has nans\noutput has infs\n")  # what the peer prints
    assert ours[0].startswith("output has nans\n\n")  # ours: the inf is hidden by the NaN
    assert_same(peer, ours)  # fails on that line only
