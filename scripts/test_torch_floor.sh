#!/usr/bin/env bash
# The torch floor job: the oldest torch pyproject.toml accepts, in a fresh virtual environment,
# running the tests of what depends most on torch's internals (hooks, dynamo, the compiled front
# end, the step guard, the drop-in). The floor's PyPI wheel is a CUDA build (several GB with
# its nvidia-* wheels; about 3 minutes to install here); it runs on a CPU. Below the floor the
# package is untested. Called by .ci/run; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

floor="$(python3 - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(m.group(1) for d in deps if (m := re.match(r"torch>=([0-9.]+)", d))))
PY
)"
case "$floor" in *.*.*) ;; *) floor="$floor.0" ;; esac
FLOOR_TESTS=(tests/test_compiled_frames.py tests/test_watcher.py tests/test_stats.py tests/test_step_guard.py
             tests/test_replay_localize.py tests/test_dropin_parity.py tests/test_skip_steps.py
             tests/test_graph_stats.py)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "== torch floor job: torch $floor (pyproject.toml's floor) in a fresh virtual environment"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
# torch's own pins (triton among them) come with it; everything else from constraints.txt
grep -v -E '^(torch|triton)==' constraints.txt > "$work/constraints.txt"
"$py" -m pip install -q --progress-bar off "torch==$floor"
"$py" -m pip install -q --progress-bar off -c "$work/constraints.txt" -e . pytest transformers
have="$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')"
if [ "$have" != "$floor" ]; then
  echo "torch floor job: torch $have installed, $floor wanted" >&2
  exit 1
fi
OMP_NUM_THREADS=1 "$py" -m pytest -q -p no:cacheprovider -m "not cuda" --junitxml="$work/floor.xml" \
  "${FLOOR_TESTS[@]}" "$@"
"$py" - "$work/floor.xml" "${FLOOR_TESTS[@]}" <<'PY'
import sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
ran = {next((p for p in c.get("classname", "").split(".") if p.startswith("test_")), "") for c in cases
       if c.find("skipped") is None and c.find("failure") is None and c.find("error") is None}
missing = [f for f in sys.argv[2:] if f.split("/")[-1][:-3] not in ran]
if missing:
    sys.exit(f"torch floor job: no test passed in {', '.join(missing)}")
print(f"torch floor job: {len(cases)} tests on the floor's torch, every file ran")
PY
