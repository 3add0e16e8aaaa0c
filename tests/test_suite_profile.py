"""scripts/suite_profile.py, the suite's time recorder: a test that sleeps is counted as waiting,
one that spins as the worker's CPU, one that waits for a spinning child as the child's CPU; the
summary lists them by file and by test, and per worker when it was busy and how long it stood idle
at the end while another still ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TESTS = textwrap.dedent("""
    import subprocess, sys, time

    def _spin(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    def test_sleeps():
        time.sleep(1.5)  # (more than a loaded machine keeps the other two off a CPU)

    def test_spins():
        _spin(0.4)

    def test_waits_for_a_child():
        subprocess.run([sys.executable, "-c",
                        "import time\\nend = time.process_time() + 0.4\\nwhile time.process_time() < end: pass"],
                       check=True)
""")


def test_records_and_summary(tmp_path):
    (tmp_path / "test_three.py").write_text(_TESTS)
    out = tmp_path / "records.jsonl"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "scripts"), TENSORWATCH_SUITE_PROFILE=str(out))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_profile", "-p", "no:cacheprovider",
                           "test_three.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = {json.loads(line)["id"].split("::")[1]: json.loads(line) for line in out.read_text().splitlines()}
    assert set(records) == {"test_sleeps", "test_spins", "test_waits_for_a_child"}
    sleeps, spins, child = records["test_sleeps"], records["test_spins"], records["test_waits_for_a_child"]
    assert sleeps["wall"] >= 1.49 and sleeps["cpu"] < 0.2 and sleeps["child"] < 0.1
    assert {r["worker"] for r in records.values()} == {"main"}  # (run by an xdist worker, not one itself)
    assert spins["cpu"] >= 0.39 and spins["child"] < 0.1
    assert child["child"] >= 0.39 and child["cpu"] < 0.3
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "suite_profile.py"), str(out), "--most", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("3 tests: wall ") and "by file (1 of 1):" in text
    assert "by test, most wall (2 of 3):" in text and "by test, most waiting (2 of 3):" in text
    waiting = text[text.index("most waiting"):].splitlines()[2]
    assert waiting.endswith("test_three.py::test_sleeps"), text


def test_the_workers_idle_tail_is_told(tmp_path):
    """Records of two workers (as pytest-xdist's give): the one that finished first stood idle
    until the other's last test ended, and the summary says how long."""
    records = [{"id": "tests/a.py::one", "wall": 10.0, "cpu": 9.0, "child": 0.0, "start": 100.0, "worker": "gw0"},
               {"id": "tests/a.py::two", "wall": 5.0, "cpu": 5.0, "child": 0.0, "start": 110.0, "worker": "gw0"},
               {"id": "tests/b.py::three", "wall": 30.0, "cpu": 29.0, "child": 0.0, "start": 100.5, "worker": "gw1"}]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "suite_profile.py"), str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    i = lines.index("workers (the run: 30.5 s from the first test's start to the last one's end):")
    assert lines[i + 1].split() == ["gw0", "2", "tests,", "busy", "15.0", "s,", "idle", "at", "the", "end", "15.5", "s"]
    assert lines[i + 2].split() == ["gw1", "1", "tests,", "busy", "30.0", "s,", "idle", "at", "the", "end", "0.0", "s"]


def test_a_missing_file_is_one_line_naming_it(tmp_path):
    missing = tmp_path / "none.jsonl"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "suite_profile.py"), str(missing)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"cannot read {missing}" in proc.stderr and "Traceback" not in proc.stderr
