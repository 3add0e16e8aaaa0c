"""Facts about CUDA releases that `doctor` checks against: host gcc limits and GPU architectures.

gcc limits come from each toolkit's crt/host_config.h; the arch names and valid entries follow
torch.utils.cpp_extension's TORCH_CUDA_ARCH_LIST parser.
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

Version = Tuple[int, int]

# (first release, newest gcc major it accepts); a release uses the last row at or below it.
_GCC_MAX: List[Tuple[Version, int]] = [
    ((9, 0), 6), ((9, 2), 7), ((10, 1), 8), ((11, 0), 9), ((11, 1), 10),
    ((11, 5), 11), ((12, 0), 12), ((12, 4), 13), ((12, 8), 14), ((13, 0), 15), ((14, 0), -1),
]

NAMED_ARCHES = [  # combined names first, as torch expands them
    ("Kepler+Tesla", "3.7"), ("Kepler", "3.5+PTX"), ("Maxwell+Tegra", "5.3"), ("Maxwell", "5.0;5.2+PTX"),
    ("Pascal", "6.0;6.1+PTX"), ("Volta+Tegra", "7.2"), ("Volta", "7.0+PTX"), ("Turing", "7.5+PTX"),
    ("Ampere+Tegra", "8.7"), ("Ampere", "8.0;8.6+PTX"), ("Ada", "8.9+PTX"), ("Hopper", "9.0+PTX"),
    ("Blackwell+Tegra", "11.0"), ("Blackwell", "10.0;10.3;12.0;12.1+PTX"),
]
SUPPORTED_ARCHES = ["3.5", "3.7", "5.0", "5.2", "5.3", "6.0", "6.1", "6.2", "7.0", "7.2", "7.5", "8.0",
                    "8.6", "8.7", "8.9", "9.0", "9.0a", "10.0", "10.0a", "11.0", "11.0a", "10.3", "10.3a",
                    "12.0", "12.0a", "12.1", "12.1a"]

# Oldest CUDA release whose nvcc can compile for an architecture, and the first one that dropped it.
_ARCH_FIRST = {(8, 0): (11, 0), (8, 6): (11, 1), (8, 7): (11, 4), (8, 9): (11, 8), (9, 0): (11, 8),
               (10, 0): (12, 8), (10, 3): (12, 9), (11, 0): (13, 0), (12, 0): (12, 8), (12, 1): (12, 9)}
_ARCH_DROPPED = {3: (12, 0), 5: (13, 0), 6: (13, 0)}
_ARCH_DROPPED_EXACT = {(7, 0): (13, 0), (7, 2): (13, 0)}

# What to suggest when no GPU is visible and torch's own list is empty (a CPU build).
DEFAULT_ARCH_LIST = {11: "7.0;7.5;8.0;8.6+PTX", 12: "7.5;8.0;8.6;8.9;9.0+PTX", 13: "7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX"}


def parse_version(text: str) -> Optional[Version]:
    m = re.match(r"^\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def max_gcc(release: Version, build: str = "") -> Optional[int]:
    """Newest gcc major the release's nvcc accepts, None when unknown. 11.4.0 (nvcc V11.4.48)
    still stops at gcc 10; 11.4.1 and later accept gcc 11."""
    if release == (11, 4) and build.startswith("V11.4.") and build[6:].isdigit() and int(build[6:]) < 100:
        return 10
    if release in ((11, 4),):
        return 11
    best: Optional[int] = None
    for first, gcc in _GCC_MAX:
        if release >= first:
            best = gcc
    return best if best and best > 0 else None


def expand_arch_list(text: str) -> List[str]:
    """TORCH_CUDA_ARCH_LIST split and named families expanded, exactly as torch does."""
    text = text.replace(" ", ";")
    for name, value in NAMED_ARCHES:
        text = text.replace(name, value)
    return text.split(";")


def invalid_arches(entries: List[str]) -> List[str]:
    valid = set(SUPPORTED_ARCHES) | {a + "+PTX" for a in SUPPORTED_ARCHES}
    return [e for e in entries if e not in valid]


def arch_version(entry: str) -> Version:
    base = entry.split("+")[0].rstrip("af")
    major, minor = base.split(".")
    return int(major), int(minor)


def covers(entries: List[str], capability: Version) -> bool:
    """True when a build for `entries` runs on a GPU of `capability`: a cubin of the same major
    and lower-or-equal minor, or PTX of a lower-or-equal version (JIT-compiled by the driver)."""
    for e in entries:
        v = arch_version(e)
        if e.split("+")[0][-1] in "af":  # arch-specific cubins run only on that exact GPU
            if v == capability:
                return True
            continue
        if v[0] == capability[0] and v[1] <= capability[1]:
            return True
        if e.endswith("+PTX") and v <= capability:
            return True
    return False


def nvcc_supports(entry: str, release: Version) -> bool:
    v = arch_version(entry)
    first = _ARCH_FIRST.get(v)
    if first and release < first:
        return False
    dropped = _ARCH_DROPPED_EXACT.get(v) or _ARCH_DROPPED.get(v[0])
    return not (dropped and release >= dropped)


def cu_tag(release: Version) -> str:
    """PyTorch wheel index tag for a CUDA release: 12.1 -> cu121."""
    return f"cu{release[0]}{release[1]}"
