#!/usr/bin/env bash
# The GPU checks of a lent device machine, in phases that fit its short lease (see
# docs/performance.md). Writes logs and JSON under $OUT (default ./gpu_out).
#   bash benchmarks/gpu_check.sh tests eager compiled     # first call
#   bash benchmarks/gpu_check.sh reduce_overhead          # second call
#   bash benchmarks/gpu_check.sh graph_stats              # the in-graph statistics (experimental)
#   bash benchmarks/gpu_check.sh eager_fused              # AdamW(fused=True), on_detect="raise": the guard's flag
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/gpu.txt"
python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case $phase in
    tests) timeout 170 python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tee "$OUT/cuda_tests.log" | tail -25 ;;
    eager) timeout 120 python3 benchmarks/bench_gpu.py --device cuda --variants unwatched,watched,watched_torch_ops --rounds 30 \
             --json "$OUT/eager.json" 2>&1 | tee "$OUT/bench_eager.log" ;;
    eager_fused) timeout 120 python3 benchmarks/bench_gpu.py --device cuda --variants unwatched,watched --rounds 30 \
             --fused --on-detect raise --json "$OUT/eager_fused.json" 2>&1 | tee "$OUT/bench_eager_fused.log" ;;
    compiled) timeout 240 python3 benchmarks/bench_gpu.py --device cuda --variants compiled,compiled_watched --rounds 20 \
             --json "$OUT/compiled.json" 2>&1 | tee "$OUT/bench_compiled.log" ;;
    graph_stats) TENSORWATCH_GRAPH_STATS=1 timeout 300 python3 benchmarks/bench_gpu.py --device cuda \
             --variants compiled,compiled_watched,compiled_ro,compiled_ro_watched --rounds 20 \
             --json "$OUT/graph_stats.json" 2>&1 | tee "$OUT/bench_graph_stats.log"
           TENSORWATCH_GRAPH_STATS=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_graph_stats.py \
             2>&1 | tee "$OUT/graph_stats_tests.log" | tail -5 ;;
    reduce_overhead) timeout 240 python3 benchmarks/bench_gpu.py --device cuda --variants compiled_ro,compiled_ro_watched --rounds 20 \
             --json "$OUT/compiled_ro.json" 2>&1 | tee "$OUT/bench_compiled_ro.log" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
echo "=== done $(date +%T)"
