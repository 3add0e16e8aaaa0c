"""What `doctor` looks at: torch's build, the CUDA toolkits, PATH/LD_LIBRARY_PATH, gcc, ninja, /dev/shm.

Everything is read from the given environment mapping and the file system, and by running
`nvcc --version` / `gcc --version`; the checks in _doctor_checks never touch the machine.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

log = logging.getLogger("tensorwatch_otel.doctor")

COMMAND_TIMEOUT_S = 15.0


@dataclass
class Toolkit:
    home: str
    nvcc: Optional[str] = None       # path of bin/nvcc when present
    release: Optional[str] = None    # "12.1"
    build: str = ""                  # "V12.1.105"
    lib64: bool = False              # lib64/ exists
    cudart: bool = False             # lib64/ holds libcudart.so*


@dataclass
class Facts:
    torch_version: str = ""
    torch_cuda: Optional[str] = None      # torch.version.cuda of the installed build
    planned_cuda: Optional[str] = None    # --torch-cuda
    gpu_caps: List[Tuple[int, int]] = field(default_factory=list)
    torch_arch_list: List[str] = field(default_factory=list)
    cuda_root: str = "/usr/local"
    cuda_home: Optional[str] = None
    cuda_home_source: str = ""
    toolkit: Optional[Toolkit] = None
    side_by_side: List[Toolkit] = field(default_factory=list)
    path_nvcc: Optional[str] = None
    path_nvcc_release: Optional[str] = None
    ld_dirs: List[str] = field(default_factory=list)
    first_cudart_dir: Optional[str] = None
    gcc: Optional[str] = None
    gcc_version: Optional[str] = None
    gcc_candidates: Dict[int, str] = field(default_factory=dict)  # major -> path of gcc-N
    arch_list_env: Optional[str] = None
    ninja: Optional[str] = None
    shm_bytes: Optional[int] = None

    @property
    def target_cuda(self) -> Optional[str]:
        return self.planned_cuda or self.torch_cuda


def run_version(exe: str, env: Mapping[str, str]) -> str:
    """`exe --version` output, or "" when it cannot run."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, env=dict(env),
                             timeout=COMMAND_TIMEOUT_S)
        return out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("%s --version failed: %s", exe, exc)
        return ""


def parse_nvcc(banner: str) -> Tuple[Optional[str], str]:
    """("12.1", "V12.1.105") from `nvcc --version`, as torch reads it (`release X.Y`)."""
    m = re.search(r"release (\d+\.\d+)", banner)
    b = re.search(r"\b(V\d+\.\d+\.\d+)", banner)
    return (m.group(1) if m else None), (b.group(1) if b else "")


def parse_gcc(banner: str) -> Optional[str]:
    """"11.4.0" from the first line of `gcc --version` (its last version-looking word)."""
    first = banner.strip().splitlines()[0] if banner.strip() else ""
    found = re.findall(r"\b(\d+\.\d+(?:\.\d+)?)\b", first)
    return found[-1] if found else None


def has_cudart(directory: str) -> bool:
    return bool(glob.glob(os.path.join(directory, "libcudart.so*")))


def probe_toolkit(home: str, env: Mapping[str, str]) -> Toolkit:
    tk = Toolkit(home=home)
    nvcc = os.path.join(home, "bin", "nvcc")
    if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK):
        tk.nvcc = nvcc
        tk.release, tk.build = parse_nvcc(run_version(nvcc, env))
    lib64 = os.path.join(home, "lib64")
    tk.lib64 = os.path.isdir(lib64)
    tk.cudart = tk.lib64 and has_cudart(lib64)
    return tk


def find_cuda_home(env: Mapping[str, str], cuda_root: str) -> Tuple[Optional[str], str]:
    """torch.utils.cpp_extension's order: CUDA_HOME, CUDA_PATH, nvcc on PATH, then <root>/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            return env[var], var
    nvcc = shutil.which("nvcc", path=env.get("PATH", ""))
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc)), "nvcc on PATH"
    default = os.path.join(cuda_root, "cuda")
    if os.path.exists(default):
        return default, f"default {default}"
    return None, "not found"


def side_by_side(cuda_root: str, env: Mapping[str, str]) -> List[Toolkit]:
    homes = sorted(glob.glob(os.path.join(cuda_root, "cuda-*")), key=_release_key)
    return [probe_toolkit(h, env) for h in homes if os.path.isdir(h)]


def _release_key(path: str) -> Tuple[int, ...]:
    nums = re.findall(r"\d+", os.path.basename(path))
    return tuple(int(n) for n in nums) or (0,)


def gcc_candidates(path: str) -> Dict[int, str]:
    """gcc-N executables on PATH, newest path per major (what the `ln -s` fix can point at)."""
    found: Dict[int, str] = {}
    for d in [p for p in path.split(os.pathsep) if p]:
        for exe in glob.glob(os.path.join(d, "gcc-[0-9]*")):
            m = re.fullmatch(r"gcc-(\d+)", os.path.basename(exe))
            if m and os.access(exe, os.X_OK):
                found.setdefault(int(m.group(1)), exe)
    return found


def shm_size(path: str = "/dev/shm") -> Optional[int]:
    try:
        st = os.statvfs(path)
        return st.f_frsize * st.f_blocks
    except OSError:
        return None


def torch_facts(facts: Facts) -> None:
    try:
        import torch
    except ImportError:
        facts.torch_version = "not installed"
        return
    facts.torch_version = torch.__version__
    facts.torch_cuda = torch.version.cuda
    try:
        facts.torch_arch_list = list(torch.cuda.get_arch_list())
        if torch.cuda.is_available():
            facts.gpu_caps = [tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]
    except Exception as exc:  # a broken driver is reported as "no GPU visible", not a crash
        log.debug("torch.cuda query failed: %s", exc)


def probe(env: Mapping[str, str], cuda_root: str, planned_cuda: Optional[str] = None,
          shm_path: str = "/dev/shm", with_torch: bool = True) -> Facts:
    facts = Facts(planned_cuda=planned_cuda, cuda_root=cuda_root)
    if with_torch:
        torch_facts(facts)
    path = env.get("PATH", "")
    facts.cuda_home, facts.cuda_home_source = find_cuda_home(env, cuda_root)
    if facts.cuda_home:
        facts.toolkit = probe_toolkit(facts.cuda_home, env)
    facts.side_by_side = side_by_side(cuda_root, env)
    facts.path_nvcc = shutil.which("nvcc", path=path)
    if facts.path_nvcc:
        facts.path_nvcc_release = parse_nvcc(run_version(facts.path_nvcc, env))[0]
    facts.ld_dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    facts.first_cudart_dir = next((d for d in facts.ld_dirs if has_cudart(d)), None)
    in_toolkit = os.path.join(facts.cuda_home, "bin", "gcc") if facts.cuda_home else None
    facts.gcc = in_toolkit if in_toolkit and os.access(in_toolkit, os.X_OK) else shutil.which("gcc", path=path)
    if facts.gcc:
        facts.gcc_version = parse_gcc(run_version(facts.gcc, env))
    facts.gcc_candidates = gcc_candidates(path)
    facts.arch_list_env = env.get("TORCH_CUDA_ARCH_LIST")
    facts.ninja = shutil.which("ninja", path=path)
    facts.shm_bytes = shm_size(shm_path)
    return facts
