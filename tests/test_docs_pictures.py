"""The docs' pictures of what a user sees are made by a script from a real run
(scripts/docs_pictures.py: the demo's overflow, `report --plot`, `diff --plot` in a headless
browser, `diff` as a terminal shows it), and the docs show each of them."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import docs_pictures  # noqa: E402


def _png_size(path: Path):
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_every_picture_is_in_docs_img_and_shown_by_a_page():
    shown = set()
    for page in (ROOT / "docs").rglob("*.md"):
        shown.update(re.findall(r"!\[[^\]]*\]\(img/([^)]+)\)", page.read_text(encoding="utf-8")))
    for name in docs_pictures.PICTURES:
        assert (ROOT / "docs" / "img" / name).is_file(), f"docs/img/{name}: run python3 scripts/docs_pictures.py"
        assert name in shown, f"no page shows docs/img/{name}"


@pytest.mark.slow
def test_the_script_makes_the_pictures_from_a_real_run(tmp_path):
    if not any(shutil.which(b) for b in docs_pictures.BROWSERS):
        pytest.skip("no headless browser: scripts/test.sh installs chromium-headless-shell")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_pictures.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sizes = {name: _png_size(tmp_path / name) for name in docs_pictures.PICTURES}
    assert sizes["diff-page.png"] == (1400, 940)  # the browser's window
    width, height = sizes["diff-terminal.png"]
    assert width == 980 and height > 600  # the text of the diff, about 50 lines
    assert min(sizes["report-plot.png"]) > 300
    # the pictures hold drawings, not an empty page: a blank PNG of that size compresses to a few KB
    assert all((tmp_path / name).stat().st_size > 30_000 for name in docs_pictures.PICTURES)


def test_the_script_names_the_package_to_install_without_a_browser(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_pictures.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/nonexistent"})
    assert proc.returncode != 0
    assert "apt-get install chromium-headless-shell" in proc.stderr
