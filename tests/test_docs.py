"""The docs are the user's contract, so they are tested like code: the generated reference pages
equal what scripts/gen_docs.py makes of the code now, the mkdocs site builds with --strict (no
broken link or anchor, no page outside the nav), every ```python block of the README and of docs/
runs, and every `tensorwatch-otel COMMAND --option` the docs show is an option the command has.

A python block that cannot run on a CPU-only machine is marked on the line before its fence with
`<!-- not-run: why -->`, or `<!-- run-by: tests/test_x.py -->` when another test runs it."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```\n", re.M | re.S)
MARK = re.compile(r"<!--\s*(not-run|run-by):\s*(.+?)\s*-->")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _blocks(lang=None):
    """(page, line, language, code, mark) of every fenced block; mark: (kind, text) or None."""
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if lang is not None and m.group(1) != lang:
                continue
            before = [ln for ln in text[:m.start()].rstrip("\n").split("\n")[-1:] if ln.strip()]
            mark = MARK.search(before[0]) if before else None
            line = text.count("\n", 0, m.start()) + 1
            out.append((page.relative_to(ROOT).as_posix(), line, m.group(1), m.group(2),
                        mark.groups() if mark else None))
    return out


PYTHON = _blocks("python")


def test_generated_reference_pages_are_current():
    stale = [rel for rel, text in _gen_docs().generate().items()
             if not (ROOT / rel).is_file() or (ROOT / rel).read_text(encoding="utf-8") != text]
    assert not stale, f"{stale} differ from the code; regenerate with: python3 scripts/gen_docs.py"


def test_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extras (pip install -e '.[test]')")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "options" / "index.html").is_file()


def test_readme_is_short_and_has_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count("\n") <= 150
    blocks = "".join(code for page, _, lang, code, _ in _blocks("bash") if page == "README.md")
    assert "tensorwatch-otel demo" in blocks and "bash scripts/test.sh" in blocks


def test_every_python_block_is_run_or_marked():
    marks = [(page, line, mark) for page, line, _, _, mark in PYTHON if mark]
    for page, line, (kind, why) in marks:
        if kind == "run-by":
            target = why.split()[0]
            assert (ROOT / target).is_file(), f"{page}:{line}: run-by {target}: no such file"
    assert len(PYTHON) - len(marks) >= 8, "fewer runnable blocks than expected: is the fence pattern right?"


def _runnable():
    """The unmarked blocks, each distinct code once (the README's example is also the docs')."""
    seen = {}
    for page, line, _, code, mark in PYTHON:
        if mark is None:
            seen.setdefault(code, (page, line, code))
    return list(seen.values())


@pytest.mark.slow
@pytest.mark.waits  # (a block with a Prometheus sink waits at its end for a scrape that never comes: ~3 s)
@pytest.mark.parametrize("page,line,code", _runnable(), ids=[f"{p}:{ln}" for p, ln, _ in _runnable()])
def test_python_block_runs(page, line, code, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"{page}:{line} failed (mark it <!-- not-run: why --> if it cannot run " \
                                 f"here):\n{proc.stderr[-3000:]}"


def _subcommands():
    from tensorwatch_otel.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def test_command_line_options_in_the_docs_exist():
    commands = _subcommands()
    usage = re.compile(r"(?:tensorwatch-otel|-m tensorwatch_otel)\s+([a-z]+)\b([^`\n#|]*)")
    seen, wrong = 0, []
    for page in PAGES:
        for m in usage.finditer(page.read_text(encoding="utf-8")):
            name, rest = m.group(1), m.group(2)
            if name not in commands:
                if name in ("COMMAND",) or not rest.strip().startswith(("-", "[")):
                    continue
                wrong.append(f"{page.name}: no command {name!r}")
                continue
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                seen += 1
                if flag not in commands[name]:
                    wrong.append(f"{page.name}: tensorwatch-otel {name} has no {flag}")
    assert seen > 20
    assert not wrong, wrong
