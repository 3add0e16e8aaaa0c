"""Makes the docs' pictures of what a user sees, from a real run: `tensorwatch-otel demo` with
an fp16 overflow injected at batch 12 and batches 11 and 12 traced, then

    docs/img/report-plot.png    `tensorwatch-otel report ... --plot` (the picture it writes)
    docs/img/diff-page.png      `tensorwatch-otel diff ... --plot diff.html`, the page as a
                                headless Chromium shows it
    docs/img/diff-terminal.png  `tensorwatch-otel diff ...`'s text output, as a terminal shows
                                it (the text on a terminal-like page, in the same browser)

The figures come from this machine's run, so they may differ in the last digits from another
CPU's. The browser: Debian's `chromium-headless-shell` (apt-get install chromium-headless-shell)
or any `chromium` / `google-chrome` on PATH, or `--browser PATH`.

    python3 scripts/docs_pictures.py                 # writes docs/img/
    python3 scripts/docs_pictures.py --out DIR       # somewhere else (tests/test_docs_pictures.py)
"""

from __future__ import annotations

import argparse
import html
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
PICTURES = ("report-plot.png", "diff-page.png", "diff-terminal.png")
_TERMINAL_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><style>
body {{ margin: 0; background: #1e1e1e; }}
.bar {{ background: #3c3c3c; color: #ccc; font: 13px sans-serif; padding: 6px 12px; }}
pre {{ margin: 0; padding: 12px 14px; color: #e6e6e6; font: 13px/1.35 'DejaVu Sans Mono', monospace; }}
.prompt {{ color: #8ae234; }}
</style></head><body><div class="bar">terminal</div><pre><span class="prompt">$</span> {command}
{output}</pre></body></html>
"""


def find_browser(given: Optional[str]) -> str:
    if given:
        return given
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    sys.exit("docs_pictures: no headless browser found (tried " + ", ".join(BROWSERS) + "): "
             "apt-get install chromium-headless-shell, or give --browser PATH")


def run(cmd: List[str], cwd: Path, ok: tuple = (0,)) -> str:
    """`cmd` in `cwd`; its stdout. Exits naming the command when its status is not in `ok`."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    if proc.returncode not in ok:
        sys.exit(f"docs_pictures: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def screenshot(browser: str, page: Path, out: Path, width: int, height: int) -> None:
    """`page` as the browser draws it in a `width` x `height` window, to `out` (PNG)."""
    run([browser, "--headless", "--no-sandbox", "--hide-scrollbars", "--disable-gpu",
         f"--window-size={width},{height}", f"--screenshot={out}", page.as_uri()], page.parent)
    if not out.is_file() or out.stat().st_size == 0:
        sys.exit(f"docs_pictures: {browser} wrote no picture of {page}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder for the pictures (docs/img)")
    p.add_argument("--browser", help="the headless browser to use (default: the first of "
                   + ", ".join(BROWSERS) + " on PATH)")
    args = p.parse_args(argv)
    browser = find_browser(args.browser)
    # the installed command, as a user runs it (its entry point, run by this interpreter)
    cli = [sys.executable, "-c", "import sys; from tensorwatch_otel.cli import main; sys.exit(main())"]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("docs_pictures: the demo (an fp16 overflow at batch 12, batches 11 and 12 traced)", flush=True)
        run(cli + ["demo", "--quiet", "--overflow-at-batch", "12", "--trace", "11,12", "--threads", "1"], work,
            ok=(3,))  # 3: the inf/nan was detected, as injected
        log = "tensorwatch-demo-events.jsonl"
        run(cli + ["report", log, "--event", "nonfinite_detected", "--plot", str(work / "report.png")], work)
        shutil.copyfile(work / "report.png", args.out / "report-plot.png")
        diff = ["diff", f"{log}:11", f"{log}:12"]
        run(cli + diff + ["--plot", "diff.html"], work, ok=(1,))  # 1: a divergence, as injected
        screenshot(browser, work / "diff.html", args.out / "diff-page.png", 1400, 940)
        text = run(cli + diff, work, ok=(1,))
        lines = text.splitlines()
        shown = lines[:44] + (["  ..."] if len(lines) > 44 else [])
        page = work / "terminal.html"
        page.write_text(_TERMINAL_PAGE.format(command=html.escape("tensorwatch-otel " + " ".join(diff)),
                                              output=html.escape("\n".join(shown))), encoding="utf-8")
        screenshot(browser, page, args.out / "diff-terminal.png", 980, 44 + 18 * (len(shown) + 2))
    for name in PICTURES:
        print(f"docs_pictures: wrote {args.out / name} ({os.path.getsize(args.out / name):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
