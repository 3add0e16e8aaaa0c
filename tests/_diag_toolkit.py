"""Fake CUDA toolkits and compilers for the doctor tests: folders with `nvcc`/`gcc` scripts that
print the real tools' version banners."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

NVCC_BANNER = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2023 NVIDIA Corporation
Built on Mon_Apr__3_17:16:06_PDT_2023
Cuda compilation tools, release {release}, {build}
Build cuda_{release}.r{release}/compiler.32688072_0"""

GCC_BANNER = """gcc (Ubuntu {version}-1ubuntu1~22.04) {version}
Copyright (C) 2021 Free Software Foundation, Inc.
This is free software; see the source for copying conditions.  There is NO
warranty; not even for MERCHANTABILITY or FITNESS FOR A PARTICULAR PURPOSE."""


def script(path: Path, output: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # printf is a shell builtin: the scripts work with a PATH holding only our fake folders.
    quoted = " ".join("'" + line + "'" for line in output.splitlines())
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' {quoted}\n")
    os.chmod(path, 0o755)
    return path


def toolkit(root: Path, release: str, build: Optional[str] = None, lib64: bool = True, cudart: bool = True) -> Path:
    """root/cuda-RELEASE with bin/nvcc and (optionally) lib64/libcudart.so*."""
    home = root / f"cuda-{release}"
    script(home / "bin" / "nvcc", NVCC_BANNER.format(release=release, build=build or f"V{release}.105"))
    (home / "include").mkdir(parents=True, exist_ok=True)
    if lib64:
        (home / "lib64").mkdir(parents=True, exist_ok=True)
        if cudart:
            major = release.split(".")[0]
            (home / "lib64" / f"libcudart.so.{major}").write_bytes(b"")
            (home / "lib64" / "libcudart.so").symlink_to(f"libcudart.so.{major}")
    return home


def host_tools(bindir: Path, gcc: str = "11.4.0", ninja: bool = True) -> Path:
    """bindir with gcc (and ninja); extra gcc-N can be added with gcc_n()."""
    script(bindir / "gcc", GCC_BANNER.format(version=gcc))
    if ninja:
        script(bindir / "ninja", "1.11.1")
    return bindir


def gcc_n(bindir: Path, major: int) -> Path:
    script(bindir / f"g++-{major}", GCC_BANNER.replace("gcc (", "g++ (").format(version=f"{major}.3.0"))
    return script(bindir / f"gcc-{major}", GCC_BANNER.format(version=f"{major}.3.0"))
