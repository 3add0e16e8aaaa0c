"""Every bad command line ends in one line, `tensorwatch-otel COMMAND: error: ...` (exit 2), as
docs/cli.md promises, and no start prints torch's NumPy warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "tensorwatch_otel", *args], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, line", [
    (("demo", "--steps", "x"), "tensorwatch-otel demo: error: argument --steps: invalid int value: 'x' "
                               "(see tensorwatch-otel demo --help)"),
    (("report",), "tensorwatch-otel report: error: the following arguments are required: EVENTS.jsonl "
                  "(see tensorwatch-otel report --help)"),
    (("nosuch",), "tensorwatch-otel COMMAND: error: argument COMMAND: invalid choice: 'nosuch' (choose from "),
])
def test_argparse_errors_are_one_line(args, line):
    proc = _cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), proc.stderr
    assert "usage:" not in proc.stderr


def test_help_prints_no_numpy_warning():
    proc = _cli("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: tensorwatch-otel")
    assert "numpy" not in proc.stderr.lower(), proc.stderr
