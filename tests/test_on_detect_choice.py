"""`on_detect` is chosen once per watch as a behaviour object (core/steps/on_detect.py) and asked where
it decides: no module of the package compares the option's value, so a new value is one class."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tensorwatch_otel import NonFiniteDetected, watch
from tensorwatch_otel.core.steps import on_detect
from tensorwatch_otel.core.config import ON_DETECT

PACKAGE = Path(__file__).resolve().parent.parent / "tensorwatch_otel"


def _compares_the_option(node: ast.AST) -> bool:
    """`x.on_detect == "..."` / `on_detect != ...` / `cfg.on_detect in (...)`."""
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    named = any((isinstance(s, ast.Attribute) and s.attr == "on_detect")
                or (isinstance(s, ast.Name) and s.id == "on_detect") for s in sides)
    return named and any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides)


def test_no_module_compares_the_options_value():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _compares_the_option(node):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_check_finds_a_comparison():
    assert _compares_the_option(ast.parse('cfg.on_detect == "skip"').body[0].value)
    assert not _compares_the_option(ast.parse("self._on_detect.stops_ranks").body[0].value)


def test_every_value_of_the_option_has_its_behaviour():
    assert {on_detect.choose(name).name for name in ON_DETECT} == set(ON_DETECT)
    raise_, report, skip = (on_detect.choose(n) for n in ("raise", "report", "skip"))
    assert (raise_.stops_ranks, report.stops_ranks, skip.stops_ranks) == (True, False, False)
    assert (raise_.step_waits_for_verdict, report.step_waits_for_verdict, skip.step_waits_for_verdict) == \
        (True, False, True)
    assert raise_.skipper() is None and report.skipper() is None and skip.skipper() is not None


@pytest.mark.parametrize("value", ON_DETECT)
def test_each_behaviour_does_what_its_value_says(value):
    """A forward inf: raise raises; report and skip record it and go on (skip also skips the
    step that would consume it, so the weights do not change in that step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with watch(model, sinks=[], on_detect=value) as w:
        bad = x.clone()
        bad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        raised = False
        try:
            model(bad).sum().backward()
            opt.step()
        except NonFiniteDetected:
            raised = True
        opt.zero_grad()
        assert raised == (value == "raise")
        # report lets the step run: the gradients the inf made are a second detection, at the step
        assert w.detections == (2 if value == "report" else 1)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert unchanged == (value != "report")  # raise stopped before the step; skip skipped it
