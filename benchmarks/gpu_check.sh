#!/usr/bin/env bash
# The GPU checks of a lent device machine (see docs/performance.md). Writes logs and JSON under
# $OUT (default ./gpu_out) and ends with one table (benchmarks/gpu_summary.py): per variant the
# step time and its ratio, kernels, host syncs, copies, slot-buffer reads, graphs, recompiles,
# graph breaks and cudagraph skips.
#   bash benchmarks/gpu_check.sh all               # tests, eager, compiled, reduce_overhead, table
#   bash benchmarks/gpu_check.sh tests eager       # some phases (the table follows)
#   bash benchmarks/gpu_check.sh eager_fused       # AdamW(fused=True), on_detect="raise": the guard's flag
# Each compiled variant runs in a process of its own (dynamo's caches and counters are per process).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
ROUNDS=${ROUNDS:-20}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/gpu.txt"
python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
bench() {  # bench NAME TIMEOUT VARIANTS [extra args]
  local name=$1 limit=$2 variants=$3
  shift 3
  timeout "$limit" python3 benchmarks/bench_gpu.py --device cuda --variants "$variants" --rounds "$ROUNDS" \
    --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/bench_$name.log" | grep -v "^W[0-9]" | tail -12
}
phases=("$@")
[ "${phases[*]}" = "all" ] && phases=(tests eager compiled reduce_overhead)
for phase in "${phases[@]}"; do
  echo "=== $phase $(date +%T)"
  case $phase in
    tests) timeout 170 python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tee "$OUT/cuda_tests.log" | tail -25 ;;
    eager) bench eager 150 unwatched,watched,watched_torch_ops ;;
    eager_fused) bench eager_fused 120 unwatched,watched --fused --on-detect raise ;;
    compiled) bench compiled 150 compiled; bench compiled_watched 180 compiled_watched ;;
    reduce_overhead) bench compiled_ro 150 compiled_ro; bench compiled_ro_watched 180 compiled_ro_watched ;;
    *) echo "unknown phase $phase" ;;
  esac
done
echo "=== done $(date +%T)"
python3 benchmarks/gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
