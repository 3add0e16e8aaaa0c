"""`doctor`'s verdicts: pure functions from Facts to findings (what is wrong, why, the fix).

Severity `problem` makes the command exit 1; `warning` and `info` do not.
"""

from __future__ import annotations

import glob
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from . import _cuda_tables as tables
from ._doctor_probe import Facts, Toolkit

SHM_MIN_BYTES = 512 * 2**20


@dataclass
class Finding:
    id: str
    severity: str  # problem | warning | info
    what: str
    why: str
    fix: List[str] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def _use_toolkit(home: str) -> List[str]:
    return [f"export CUDA_HOME={home}", f"export PATH={home}/bin:$PATH",
            f"export LD_LIBRARY_PATH={home}/lib64:$LD_LIBRARY_PATH"]


def _same(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def matching_toolkit(facts: Facts, want: str) -> Optional[Toolkit]:
    """A complete side-by-side toolkit with the wanted release (else the same major)."""
    v = tables.parse_version(want)
    complete = [t for t in facts.side_by_side if t.release and t.cudart]
    exact = [t for t in complete if tables.parse_version(t.release) == v]
    major = [t for t in complete if v and tables.parse_version(t.release)[0] == v[0]]
    return (exact or major or [None])[-1]


def check_torch(f: Facts) -> List[Finding]:
    if f.torch_cuda or f.planned_cuda:
        return []
    fix = [f"pip install torch --index-url https://download.pytorch.org/whl/{tables.cu_tag(v)}"
           for v in [tables.parse_version(f.toolkit.release)] if f.toolkit and f.toolkit.release and v]
    return [Finding("torch-cpu-only", "problem",
                    f"torch {f.torch_version} is a CPU-only build (torch.version.cuda is None)",
                    "CUDA extensions (DeepSpeed ops and others) need a torch built for CUDA; toolkit checks "
                    "below run without a version to compare. Pass --torch-cuda X.Y to check against the build "
                    "you plan to install.", fix or ["pip install torch  # a CUDA build from https://pytorch.org"])]


def check_cuda_home(f: Facts) -> List[Finding]:
    target = f.target_cuda
    if not f.cuda_home:
        tk = matching_toolkit(f, target) if target else None
        fix = _use_toolkit(tk.home) if tk else [f"install the CUDA toolkit {target or 'matching torch'} "
                                               f"(e.g. into {f.cuda_root}/cuda-{target or 'X.Y'})"]
        return [Finding("cuda-home-missing", "problem" if target else "warning",
                        "no CUDA toolkit found (CUDA_HOME/CUDA_PATH unset, no nvcc on PATH, "
                        f"no {f.cuda_root}/cuda)", "torch's extension builder needs CUDA_HOME to compile .cu files",
                        fix)]
    tk = f.toolkit
    if not os.path.isdir(f.cuda_home):
        return [Finding("cuda-home-invalid", "problem", f"CUDA_HOME={f.cuda_home} ({f.cuda_home_source}) "
                        "is not a directory", "every extension build will fail to find nvcc and headers",
                        _fix_for_target(f))]
    if tk is None or not tk.nvcc:
        return [Finding("nvcc-missing", "problem", f"no nvcc at {f.cuda_home}/bin/nvcc (CUDA_HOME from "
                        f"{f.cuda_home_source})", "torch runs CUDA_HOME/bin/nvcc to compile; without it the "
                        "build stops with 'nvcc not found'", _fix_for_target(f))]
    if not tk.release:
        return [Finding("nvcc-unreadable", "problem", f"{tk.nvcc} --version did not print 'release X.Y'",
                        "the toolkit's version cannot be compared with torch's; nvcc may be broken or a wrapper",
                        [f"{tk.nvcc} --version   # should print 'Cuda compilation tools, release X.Y'"])]
    return []


def _fix_for_target(f: Facts) -> List[str]:
    want = f.target_cuda
    tk = matching_toolkit(f, want) if want else None
    if tk:
        return _use_toolkit(tk.home)
    if want:
        return [f"install the CUDA toolkit {want} into {f.cuda_root}/cuda-{want}, then:"] + \
            _use_toolkit(f"{f.cuda_root}/cuda-{want}")
    return ["point CUDA_HOME at a complete toolkit: export CUDA_HOME=/usr/local/cuda-X.Y"]


def check_version(f: Facts) -> List[Finding]:
    tk, want = f.toolkit, f.target_cuda
    if not (tk and tk.release and want):
        return []
    have_v, want_v = tables.parse_version(tk.release), tables.parse_version(want)
    if have_v == want_v:
        return []
    fix = _fix_for_target(f)
    if not matching_toolkit(f, want):
        fix = fix + [f"# or use a torch built for CUDA {tk.release}: pip install torch --index-url "
                     f"https://download.pytorch.org/whl/{tables.cu_tag(have_v)}"]
    source = "--torch-cuda" if f.planned_cuda else "torch.version.cuda"
    if have_v[0] != want_v[0]:
        return [Finding("cuda-major-mismatch", "problem",
                        f"nvcc at {tk.nvcc} is CUDA {tk.release} but torch needs {want} ({source})",
                        "torch refuses to build extensions across a major CUDA version (RuntimeError: The detected "
                        "CUDA version mismatches the version that was used to compile PyTorch)", fix)]
    return [Finding("cuda-minor-mismatch", "warning",
                    f"nvcc at {tk.nvcc} is CUDA {tk.release}, torch was built with {want} ({source})",
                    "torch and DeepSpeed allow a minor mismatch within a major release with a warning; "
                    "a matching toolkit avoids surprises", fix)]


def check_path(f: Facts) -> List[Finding]:
    tk = f.toolkit
    if not (tk and tk.nvcc):
        return []
    if not f.path_nvcc:
        return [Finding("nvcc-not-on-path", "warning", f"nvcc is not on PATH (CUDA_HOME is {f.cuda_home})",
                        "builds that call nvcc directly (CMake, Makefiles, some setup.py) will not find it",
                        [f"export PATH={f.cuda_home}/bin:$PATH"])]
    if _same(os.path.dirname(os.path.dirname(f.path_nvcc)), f.cuda_home) or f.path_nvcc_release == tk.release:
        return []
    return [Finding("path-order", "problem",
                    f"the first nvcc on PATH is {f.path_nvcc} (CUDA {f.path_nvcc_release}), "
                    f"not CUDA_HOME's {tk.nvcc} (CUDA {tk.release})",
                    "tools that call nvcc from PATH compile with another toolkit than torch's builder, "
                    "mixing headers and libraries of two CUDA versions",
                    [f"export PATH={f.cuda_home}/bin:$PATH"])]


def check_libs(f: Facts) -> List[Finding]:
    tk = f.toolkit
    if not (tk and tk.nvcc):
        return []
    out: List[Finding] = []
    if not tk.cudart:
        targets = [d for d in sorted(glob.glob(os.path.join(tk.home, "targets", "*", "lib")))
                   if os.path.isdir(d)]
        other = matching_toolkit(f, tk.release) if tk.release else None
        if targets and not tk.lib64:
            fix = [f"ln -s {targets[0]} {tk.home}/lib64"]
        elif other and not _same(other.home, tk.home):
            fix = _use_toolkit(other.home)
        else:
            dash = (tk.release or "X.Y").replace(".", "-")
            fix = [f"sudo apt install cuda-cudart-dev-{dash}  # or reinstall the toolkit"]
        what = f"{tk.home}/lib64 does not exist" if not tk.lib64 else f"{tk.home}/lib64 holds no libcudart.so*"
        out.append(Finding("lib64-missing" if not tk.lib64 else "cudart-missing", "problem", what,
                           "extensions link against CUDA_HOME/lib64/libcudart.so; the link step fails "
                           "(cannot find -lcudart)", fix))
    elif f.first_cudart_dir and not _same(os.path.dirname(f.first_cudart_dir), tk.home):
        out.append(Finding("ld-library-path-order", "problem",
                           f"LD_LIBRARY_PATH finds libcudart first in {f.first_cudart_dir}, not in {tk.home}/lib64",
                           "the loader then pairs an extension built with one CUDA with another CUDA's runtime "
                           "(undefined symbols, 'CUDA driver version is insufficient')",
                           [f"export LD_LIBRARY_PATH={tk.home}/lib64:$LD_LIBRARY_PATH"]))
    elif not any(_same(d, os.path.join(tk.home, "lib64")) for d in f.ld_dirs):
        out.append(Finding("ld-library-path-unset", "info", f"{tk.home}/lib64 is not on LD_LIBRARY_PATH",
                           "torch's builder links with -L CUDA_HOME/lib64 itself; other tools may need it",
                           [f"export LD_LIBRARY_PATH={tk.home}/lib64:$LD_LIBRARY_PATH"]))
    return out


def check_gcc(f: Facts) -> List[Finding]:
    tk = f.toolkit
    if not (tk and tk.release):
        return []
    if not f.gcc or not f.gcc_version:
        return [Finding("gcc-missing", "problem", "no gcc found (neither CUDA_HOME/bin/gcc nor gcc on PATH)",
                        "nvcc needs a host C++ compiler", ["sudo apt install gcc g++"])]
    limit = tables.max_gcc(tables.parse_version(tk.release), tk.build)
    major = int(f.gcc_version.split(".")[0])
    if limit is None:
        return [Finding("gcc-unknown-limit", "info", f"no known gcc limit for CUDA {tk.release}",
                        "newer than the table this tool knows", [])]
    if major <= limit:
        return []
    pick = max((n for n in f.gcc_candidates if n <= limit), default=None)
    gcc = f.gcc_candidates[pick] if pick is not None else f"/usr/bin/gcc-{limit}"
    gxx = os.path.join(os.path.dirname(gcc), "g++-" + gcc.rsplit("-", 1)[1])
    fix = [] if pick is not None else [f"sudo apt install gcc-{limit} g++-{limit}"]
    fix += [f"ln -s {gcc} {tk.home}/bin/gcc", f"ln -s {gxx} {tk.home}/bin/g++"]
    return [Finding("gcc-too-new", "problem",
                    f"host gcc {f.gcc_version} ({f.gcc}) is newer than CUDA {tk.release} accepts (gcc <= {limit})",
                    "nvcc stops with 'unsupported GNU version!'; -allow-unsupported-compiler skips the check "
                    "at your own risk", fix)]


def suggested_arch_list(f: Facts, keep: List[str]) -> str:
    entries = [e for e in keep]
    for cap in f.gpu_caps:
        if not tables.covers(entries, cap):
            entries.append(f"{cap[0]}.{cap[1]}")
    if not entries:
        torch_list = [a[3:] for a in f.torch_arch_list if a.startswith("sm_")]
        entries = [f"{int(a[:-1])}.{a[-1]}" for a in torch_list if a.isdigit()]
    if not entries:
        want = tables.parse_version(f.target_cuda or "") or (12, 0)
        return tables.DEFAULT_ARCH_LIST.get(want[0], tables.DEFAULT_ARCH_LIST[12])
    entries = sorted(set(entries), key=tables.arch_version)
    if not any(e.endswith("+PTX") for e in entries):
        entries[-1] += "+PTX"
    return ";".join(entries)


def check_arch(f: Facts) -> List[Finding]:
    raw = f.arch_list_env
    if raw is None or raw.strip() == "" or raw == "native":
        if f.target_cuda and not f.gpu_caps:
            value = suggested_arch_list(f, [])
            return [Finding("arch-list-unset", "problem", "TORCH_CUDA_ARCH_LIST is unset and no GPU is visible",
                            "torch picks architectures from the visible GPUs; with none (a login node, a docker "
                            "build) the build fails or targets nothing", [f'export TORCH_CUDA_ARCH_LIST="{value}"'])]
        return []
    entries = tables.expand_arch_list(raw)
    bad = tables.invalid_arches(entries)
    if bad:
        good = [e for e in entries if e not in bad]
        return [Finding("arch-list-invalid", "problem",
                        f"TORCH_CUDA_ARCH_LIST={raw!r} has unknown entries: {', '.join(repr(b) for b in bad)}",
                        "torch raises 'Unknown CUDA arch' before compiling; entries are X.Y (optionally +PTX) "
                        "separated by ';' or spaces, or family names (Ampere, Hopper, ...)",
                        [f'export TORCH_CUDA_ARCH_LIST="{suggested_arch_list(f, good)}"'])]
    out: List[Finding] = []
    release = tables.parse_version(f.toolkit.release) if f.toolkit and f.toolkit.release else None
    if release:
        unsupported = [e for e in entries if not tables.nvcc_supports(e, release)]
        if unsupported:
            keep = [e for e in entries if e not in unsupported]
            out.append(Finding("arch-unsupported-by-nvcc", "problem",
                               f"CUDA {f.toolkit.release} cannot compile for {', '.join(unsupported)}",
                               "nvcc stops with 'Unsupported gpu architecture'",
                               [f'export TORCH_CUDA_ARCH_LIST="{suggested_arch_list(f, keep)}"']))
    missing = [c for c in f.gpu_caps if not tables.covers(entries, c)]
    if missing:
        caps = ", ".join(f"{a}.{b}" for a, b in sorted(set(missing)))
        out.append(Finding("arch-list-uncovered", "problem",
                           f"TORCH_CUDA_ARCH_LIST={raw!r} does not cover the visible GPU(s) of capability {caps}",
                           "the extension loads but fails with 'no kernel image is available for execution on "
                           "the device'", [f'export TORCH_CUDA_ARCH_LIST="{suggested_arch_list(f, entries)}"']))
    return out


def check_tools(f: Facts) -> List[Finding]:
    out: List[Finding] = []
    if not f.ninja:
        out.append(Finding("ninja-missing", "problem" if f.target_cuda else "warning", "ninja is not on PATH",
                           "torch's JIT builds (DeepSpeed ops built on first use) require ninja; setup.py "
                           "builds fall back to a slow serial build", ["pip install ninja"]))
    if f.shm_bytes is not None and f.shm_bytes < SHM_MIN_BYTES:
        out.append(Finding("shm-small", "warning", f"/dev/shm is {f.shm_bytes / 2**20:.0f} MiB (< 512 MiB)",
                           "DataLoader workers and NCCL use shared memory; a small /dev/shm causes bus errors "
                           "and hangs", ["docker run --shm-size=8g ...   # in a container",
                                         "sudo mount -o remount,size=8G /dev/shm   # on a host"]))
    return out


CHECKS = (check_torch, check_cuda_home, check_version, check_path, check_libs, check_gcc, check_arch, check_tools)


def diagnose(f: Facts) -> List[Finding]:
    findings: List[Finding] = []
    for check in CHECKS:
        findings.extend(check(f))
    return findings
