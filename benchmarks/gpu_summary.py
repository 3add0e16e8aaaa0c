"""One table of the GPU check (benchmarks/gpu_check.sh): every bench_gpu.py JSON in a folder,
per variant the step time (median and spread), its ratio to its unwatched twin, the kernels of
one step, host syncs, copies to the host, slot-buffer reads, and dynamo's graphs, recompiles,
graph breaks and cudagraph skips of the process that ran it; then the test log's last line.

    python benchmarks/gpu_summary.py gpu_out
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Dict, List, Optional

TWIN = {"watched": "unwatched", "watched_torch_ops": "unwatched", "compiled_watched": "compiled",
        "compiled_ro_watched": "compiled_ro"}


def rows(folder: str) -> List[dict]:
    """Every variant of every JSON in `folder`, with its process's dynamo counts."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                result = json.load(f)
        except (OSError, ValueError):
            continue
        dyn = result.get("dynamo", {})
        for name, v in result.get("variants", {}).items():
            out.append(dict(v, variant=name, file=os.path.basename(path), graphs=dyn.get("unique_graphs"),
                            recompiles=sum(dyn.get("recompiles", {}).values()),
                            breaks=sum(dyn.get("graph_breaks", {}).values()),
                            cg_skips=dyn.get("cudagraph_skips")))
    return out


def table(found: List[dict]) -> str:
    by_name: Dict[str, dict] = {r["variant"]: r for r in found}
    head = (f"{'variant':22} {'step ms':>8} {'spread':>15} {'ratio':>6} {'kernels':>8} {'syncs':>5} "
            f"{'copies':>6} {'reads':>5} {'graphs':>6} {'recomp':>6} {'breaks':>6} {'cg skip':>7}")
    lines = [head, "-" * len(head)]
    for r in found:
        med = r["step_ms_median"]
        twin: Optional[dict] = by_name.get(TWIN.get(r["variant"], ""))
        ratio = med / twin["step_ms_median"] if twin else 1.0
        spread = f"{min(r['step_ms']):.2f}-{max(r['step_ms']):.2f}"
        kernels = r.get("kernels", r.get("aten_ops", 0))
        lines.append(f"{r['variant']:22} {med:8.2f} {spread:>15} {ratio:6.3f} {kernels:8d} "
                     f"{r['host_syncs']:5d} {r['d2h_copies']:6d} {r['buffer_reads']:5d} {str(r['graphs']):>6} "
                     f"{r['recompiles']:6d} {r['breaks']:6d} {str(r['cg_skips']):>7}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    folder = args[0] if args else "gpu_out"
    found = rows(folder)
    print(table(found) if found else f"no bench_gpu.py results in {folder}")
    log = os.path.join(folder, "cuda_tests.log")
    if os.path.exists(log):
        with open(log, encoding="utf-8", errors="replace") as f:
            last = [line.strip() for line in f if line.strip()]
        print("tests/test_cuda.py:", last[-1] if last else "(empty log)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
