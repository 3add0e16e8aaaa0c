#!/usr/bin/env bash
# The one command that installs everything pinned and runs the tests on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null || ! command -v amtool >/dev/null; then
  echo "== installing prometheus and alertmanager (Debian packages)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus prometheus-alertmanager >/dev/null
  # The packages start services we do not use; the tests start their own on free ports.
  $SUDO systemctl stop prometheus prometheus-alertmanager prometheus-node-exporter 2>/dev/null || true
fi

echo "== installing tensorwatch-otel with test extras (pinned by constraints.txt)"
python3 -m pip install -q -c constraints.txt -e '.[test]'

echo "== lint (ruff) and type check (mypy, strict on tensorwatch_otel/core; see pyproject.toml)"
python3 -m ruff check .
python3 -m mypy

echo "== running tests"
python3 -m pytest "$@"
