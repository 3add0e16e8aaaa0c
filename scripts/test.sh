#!/usr/bin/env bash
# The one command that installs everything pinned and runs the tests on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null || ! command -v amtool >/dev/null \
    || ! command -v chromium-headless-shell >/dev/null; then
  # (the headless browser draws the docs' pictures: scripts/docs_pictures.py, tests/test_docs_pictures.py)
  echo "== installing prometheus, alertmanager and a headless Chromium (Debian packages; about a minute)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus prometheus-alertmanager \
    chromium-headless-shell fonts-dejavu-core >/dev/null
  # The packages start services we do not use; the tests start their own on free ports.
  $SUDO systemctl stop prometheus prometheus-alertmanager prometheus-node-exporter 2>/dev/null || true
fi

echo "== installing tensorwatch-otel with test extras (pinned by constraints.txt; about 2 minutes on a fresh machine)"
# pip prints nothing useful with -q and pages of notes without it: one line per package it
# fetches or installs shows where a long install is; the whole output is shown if it fails.
pip_log="$(mktemp)"
if ! python3 -m pip install -c constraints.txt -e '.[test]' 2>&1 | tee "$pip_log" \
    | awk '/^(Collecting|Installing collected|Successfully installed)/ { print "   " substr($0, 1, 150); fflush() }'; then
  cat "$pip_log"
  echo "== pip install failed (full output above)" >&2
  exit 1
fi
rm -f "$pip_log"
echo "   installed (${SECONDS}s so far)"

echo "== lint (ruff) and type check (mypy, strict on tensorwatch_otel/core; see pyproject.toml)"
python3 -m ruff check .
python3 -m mypy

if [ "$#" -gt 0 ]; then  # tests of one's choice: as asked, in this process
  echo "== running tests (${SECONDS}s so far)"
  python3 -m pytest "$@"
  exit
fi
# In parallel worker processes (pytest-xdist), one per CPU: the run is CPU-bound (compiling
# models is most of it), and one more worker made it slower on 2 cores (679 s against 653 s with
# an empty inductor cache, docs/architecture.md). Then the tests marked `timing` (wall-clock
# bounds) alone, so the others' load does not decide them.
# The tests marked `waits` (mostly waiting for a real server's interval or a timeout) run at the
# same time in a process of their own: they use the CPU time the others leave while they wait.
workers="${TENSORWATCH_TEST_WORKERS:-$(nproc)}"
# One intra-op thread per test process (as torchrun gives each rank unless told otherwise): with
# every core already running a test, torch's parallel regions in each process only wait for
# each other (the compiled-model files on two workers: 114-121 s against 120-130 s, 6-8% less
# CPU; docs/architecture.md). Tests that need several threads set them themselves.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
waits_log="$(mktemp)"
echo "== running the tests that mostly wait, in one process in the background (output below when done)"
python3 -m pytest -p no:cacheprovider -p no:benchmark -m "waits and not timing" >"$waits_log" 2>&1 &
waits_pid=$!
trap 'kill "$waits_pid" 2>/dev/null || true; rm -f "$waits_log"' EXIT  # (an interrupted run leaves no process behind)
echo "== running the other tests (${SECONDS}s so far; 8 to 25 minutes on 2 cores by the CPU, less with the compiled graphs an earlier run cached, in ${workers} processes, a dot per test)"
status=0
python3 -m pytest -p no:cacheprovider -p no:benchmark -n "$workers" --dist worksteal -m "not timing and not waits" \
  || status=$?
waits_status=0
wait "$waits_pid" || waits_status=$?
trap - EXIT
echo "== the tests that mostly wait (${SECONDS}s so far):"
if [ "$waits_status" -eq 0 ]; then tail -n 1 "$waits_log"; else cat "$waits_log"; fi
rm -f "$waits_log"
if [ "$status" -ne 0 ] || [ "$waits_status" -ne 0 ]; then
  echo "== tests failed (parallel pass: exit $status; waiting tests: exit $waits_status)" >&2
  exit 1
fi
echo "== running the timing tests (${SECONDS}s so far; one to two minutes)"
# (only the files that mark some: collecting all the others takes seconds and runs nothing)
mapfile -t timing_files < <(grep -l "pytest.mark.timing" tests/test_*.py)
# One at a time, but for those that wait in-process for a timeout, which run beside them in a
# second worker (tests/conftest.py's xdist groups)
timing_workers=(-n 2 --dist loadgroup)
if [ "$workers" -lt 2 ]; then timing_workers=(); fi
python3 -m pytest -p no:cacheprovider -p no:benchmark "${timing_workers[@]}" -m timing "${timing_files[@]}"
echo "== all tests passed in ${SECONDS}s"
