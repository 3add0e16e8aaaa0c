"""The integration examples of docs/integrations.md are copy-paste examples that work: each python
block of the "Where you train" section runs as a script and exits 0 (tests/test_docs.py leaves
them to this test: they train with the framework, which is slow)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _blocks():
    text = (ROOT / "docs" / "integrations.md").read_text()
    section = text[text.index("## Where you train"):]
    end = section.find("\n## ", 1)  # the next section, if any
    section = section if end < 0 else section[:end]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_section_has_one_example_per_framework():
    blocks = _blocks()
    assert len(blocks) == 3
    assert [("transformers" in b, "lightning" in b, "accelerate" in b) for b in blocks] == \
        [(True, False, False), (False, True, False), (False, False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1, 2], ids=["transformers", "lightning", "accelerate"])
def test_example_runs(index, tmp_path):
    pytest.importorskip(("transformers", "lightning", "accelerate")[index])
    code = _blocks()[index] + "\nprint('EXAMPLE OK')\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("EXAMPLE OK")
