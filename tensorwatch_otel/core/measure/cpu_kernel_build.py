"""Building the CPU statistics kernel (core/measure/cpu_kernel.py): its C source, a file of the
package, compiled into a shared library with the machine's C compiler, and the compiler processes.

The library is built with `-march=native` (the process's own CPU: nothing built here runs on
another machine). Where torch runs on OpenMP (libgomp, already loaded) the library links that
same runtime, so the kernel splits large tensors over torch's threads instead of starting a second
pool. `CC` names the compiler. Each compiler command runs in a session of its own: one still
running after COMPILE_TIMEOUT_S, or at the interpreter's exit (`kill_running`), is killed with
its whole process group (its own children too).
"""

from __future__ import annotations

import importlib.resources
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from typing import List, Optional, Tuple

import torch

COMPILE_TIMEOUT_S = 60.0  # most seconds one compiler command may run

# The kernel's C source, a file of the package (tensorwatch_otel/core/measure/cpu_kernel.c), and
# its per-frame call as a Python extension function (cpu_kernel_host.c), linked in where Python's
# headers are
SOURCE_FILE = "cpu_kernel.c"
HOST_SOURCE_FILE = "cpu_kernel_host.c"
HOST_MODULE = "_tw_cpu_host"  # the extension module's name (its PyInit_ function)


def source(name: str = SOURCE_FILE) -> str:
    """A C source of the kernel, read from the package."""
    return importlib.resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def python_include() -> Optional[str]:
    """The folder holding this Python's headers (Python.h), or None where they are not installed
    (a distribution's Python without its -dev package)."""
    folder = sysconfig.get_paths().get("include")
    return folder if folder and os.path.isfile(os.path.join(folder, "Python.h")) else None


def find_compiler() -> Optional[str]:
    """The C compiler the kernel is built with: `CC`, else cc, gcc or clang on PATH; None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def loaded_libgomp() -> Optional[str]:
    """The path of the libgomp this process has loaded (torch's OpenMP runtime), if any."""
    if not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rstrip("\n").split(None, 5)[-1]
                if os.path.basename(path).startswith("libgomp") and ".so" in path and os.path.isfile(path):
                    return path
    except OSError:
        return None
    return None


def compile_library(cc: str, folder: str, openmp: Optional[str]) -> Tuple[str, bool]:
    """The kernel's shared library, built with `cc` in `folder` (linking the OpenMP runtime at
    path `openmp`, if given): its path, and whether it is also the extension module HOST_MODULE
    (built in where Python's headers are and the host source compiles; the library without it
    otherwise). RuntimeError naming what each failed command said; subprocess.TimeoutExpired
    past COMPILE_TIMEOUT_S."""
    src, obj, lib = (os.path.join(folder, n) for n in ("kernel.c", "kernel.o", "kernel.so"))
    host_src, host_obj = os.path.join(folder, "host.c"), os.path.join(folder, "host.o")
    with open(src, "w", encoding="utf-8") as fh:
        fh.write(source())
    include = python_include()
    if include:
        with open(host_src, "w", encoding="utf-8") as fh:
            fh.write(source(HOST_SOURCE_FILE))
    errors: List[str] = []
    for arch in (["-march=native"], []):  # a compiler that does not know the flag still builds
        # compile with OpenMP, link the runtime torch already runs (no second thread pool)
        code, stderr = _run([cc, "-O3", "-fPIC", *arch, *(["-fopenmp"] if openmp else []), "-c", src, "-o", obj])
        if code != 0:
            said = stderr.strip().splitlines()
            errors.append(said[-1] if said else f"{cc} exited with {code}")
            continue
        # the Python function: left out (the ctypes call stays) when it does not compile here
        with_host = bool(include) and _run([cc, "-O2", "-fPIC", *arch, f"-I{include}", "-c", host_src,
                                            "-o", host_obj])[0] == 0
        objs = [obj, host_obj] if with_host else [obj]
        code, stderr = _run([cc, "-shared", *objs, "-o", lib, *([openmp] if openmp else [])])
        if code == 0:
            return lib, with_host
        said = stderr.strip().splitlines()
        errors.append(said[-1] if said else f"{cc} exited with {code}")
    raise RuntimeError("; ".join(errors))


class _Compilers:
    """Compiler processes in flight, killed at interpreter exit; none starts after it."""

    def __init__(self) -> None:
        self.running: "set[subprocess.Popen[str]]" = set()
        self.lock = threading.Lock()
        self.exiting = False


COMPILERS = _Compilers()


def _run(cmd: List[str]) -> Tuple[int, str]:
    """Run one compiler command in a session of its own; past COMPILE_TIMEOUT_S the whole
    process group is killed (a driver's cc1/as/ld children too) and TimeoutExpired raised."""
    with COMPILERS.lock:  # started and registered at once: the exit handler sees every compiler
        if COMPILERS.exiting:
            raise RuntimeError("the interpreter is exiting")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        COMPILERS.running.add(proc)
    try:
        _, stderr = proc.communicate(timeout=COMPILE_TIMEOUT_S)
        return proc.returncode, stderr or ""
    except BaseException:
        _kill_group(proc)
        try:
            proc.communicate(timeout=5)  # reap the leader, close its pipe
        except (subprocess.TimeoutExpired, OSError, ValueError):
            pass
        raise
    finally:
        with COMPILERS.lock:
            COMPILERS.running.discard(proc)


def _kill_group(proc: "subprocess.Popen[str]") -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session's group id is the leader's pid
    except (ProcessLookupError, PermissionError):
        pass


def kill_running() -> None:
    """The interpreter exits during a build: leave no compiler behind, and start none after (the
    build's thread reaps its own process; core/measure/cpu_kernel.py's exit handler waits a
    moment for that thread)."""
    with COMPILERS.lock:
        COMPILERS.exiting = True
        procs = list(COMPILERS.running)
    for proc in procs:
        _kill_group(proc)
