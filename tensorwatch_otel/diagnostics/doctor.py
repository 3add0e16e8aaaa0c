"""`tensorwatch-otel doctor`: can this machine build CUDA extensions for its torch, and if not, why?

Checks CUDA_HOME, nvcc vs torch's CUDA, side-by-side toolkits, PATH/LD_LIBRARY_PATH order, lib64,
host gcc, TORCH_CUDA_ARCH_LIST, ninja and /dev/shm; prints each finding with its fix.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Dict, List

HELP = "check the CUDA toolkit, host compiler and arch list used to build CUDA extensions"

DESCRIPTION = """\
Check that this machine can build CUDA extensions (DeepSpeed ops, custom kernels) for its torch.

Finds CUDA_HOME the way torch's extension builder does (CUDA_HOME, CUDA_PATH, nvcc on PATH,
then /usr/local/cuda), compares its nvcc with torch.version.cuda (or --torch-cuda), lists the
side-by-side toolkits under --cuda-root, checks PATH and LD_LIBRARY_PATH order, that lib64
holds libcudart.so, the host gcc against the newest gcc that CUDA release accepts,
TORCH_CUDA_ARCH_LIST syntax and coverage of the visible GPUs, ninja, and /dev/shm size.

Every finding says what is wrong, why it matters, and the exact fix (export PATH=...,
export LD_LIBRARY_PATH=..., ln -s /usr/bin/gcc-N .../bin/gcc, a TORCH_CUDA_ARCH_LIST value).
Exit status: 0 when nothing is wrong (warnings allowed), 1 when a problem was found,
2 for bad options.

examples:
  tensorwatch-otel doctor
  tensorwatch-otel doctor --torch-cuda 12.1            # for a torch build you plan to install
  tensorwatch-otel doctor --cuda-root /opt/nvidia --json
"""


def _cuda_version(text: str) -> str:
    if not re.fullmatch(r"\d+\.\d+", text.strip()):
        raise argparse.ArgumentTypeError(f"--torch-cuda expects MAJOR.MINOR such as 12.1, got {text!r}")
    return text.strip()


def _directory(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"--cuda-root {text!r} is not a directory")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print facts and findings as one JSON document")
    parser.add_argument("--torch-cuda", type=_cuda_version, metavar="X.Y",
                        help="check against a torch built for this CUDA version instead of the installed one")
    parser.add_argument("--cuda-root", type=_directory, metavar="DIR",
                        help="where side-by-side toolkits cuda-X.Y/ live (default: /usr/local)")


def run(args: argparse.Namespace) -> int:
    """Probes this machine, prints the findings; 1 when any is a problem."""
    from ._doctor_checks import diagnose
    from ._doctor_probe import probe

    facts = probe(os.environ, args.cuda_root or "/usr/local", planned_cuda=args.torch_cuda)
    findings = diagnose(facts)
    problems = sum(1 for f in findings if f.severity == "problem")
    if args.json:
        doc = {"ok": problems == 0, "problems": problems,
               "warnings": sum(1 for f in findings if f.severity == "warning"),
               "facts": _facts_json(facts), "findings": [f.to_json() for f in findings]}
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write("\n".join(render(facts, findings)) + "\n")
    return 1 if problems else 0


def _facts_json(facts: Any) -> Dict[str, Any]:
    from dataclasses import asdict

    doc = asdict(facts)
    doc["target_cuda"] = facts.target_cuda
    doc["gcc_candidates"] = {str(k): v for k, v in facts.gcc_candidates.items()}
    return doc


def _toolkit_line(tk: Any) -> str:
    rel = tk.release or "no nvcc"
    return f"{tk.home} ({rel}{'' if tk.cudart else ', no libcudart'})"


def render(facts: Any, findings: List[Any]) -> List[str]:
    from ._cuda_tables import max_gcc, parse_version

    f = facts
    torch_note = f"CUDA {f.torch_cuda}" if f.torch_cuda else "CPU-only build"
    if f.planned_cuda:
        torch_note += f"; checking against CUDA {f.planned_cuda} (--torch-cuda)"
    tk = f.toolkit
    lines = ["tensorwatch-otel doctor",
             f"  torch:      {f.torch_version} ({torch_note})",
             f"  CUDA_HOME:  {f.cuda_home or 'not found'} ({f.cuda_home_source})"]
    if tk:
        lines.append(f"  nvcc:       {tk.release or 'missing'}{' (' + tk.build + ')' if tk.build else ''}"
                     f"{' at ' + tk.nvcc if tk.nvcc else ''}")
    lines.append(f"  toolkits:   {', '.join(_toolkit_line(t) for t in f.side_by_side) or 'none'} under {f.cuda_root}")
    if f.gcc:
        limit = max_gcc(parse_version(tk.release), tk.build) if tk and tk.release else None
        note = f"; CUDA {tk.release} accepts gcc <= {limit}" if limit else ""
        lines.append(f"  host gcc:   {f.gcc_version or '?'} ({f.gcc}){note}")
    else:
        lines.append("  host gcc:   not found")
    gpus = ", ".join(f"{a}.{b}" for a, b in f.gpu_caps) or "none visible"
    lines.append(f"  arch list:  TORCH_CUDA_ARCH_LIST={f.arch_list_env!r}; GPUs: {gpus}; "
                 f"torch built for: {' '.join(f.torch_arch_list) or 'none'}")
    lines.append(f"  ninja:      {f.ninja or 'not found'}")
    shm = f"{f.shm_bytes / 2**30:.1f} GiB" if f.shm_bytes is not None else "unknown"
    lines.append(f"  /dev/shm:   {shm}")
    for fd in findings:
        lines += ["", f"{fd.severity.upper()} [{fd.id}] {fd.what}", f"  why: {fd.why}"]
        if fd.fix:
            lines.append("  fix:")
            lines += [f"    {line}" for line in fd.fix]
    problems = sum(1 for fd in findings if fd.severity == "problem")
    warnings = sum(1 for fd in findings if fd.severity == "warning")
    lines += ["", f"doctor: {problems} problem(s), {warnings} warning(s)"
              + ("" if problems else " - ready to build CUDA extensions")]
    return lines
