"""The CPU kernel is built off the training thread: a hanging compiler holds no batch (torch ops
measure meanwhile), is killed with its whole process group at the timeout, and a working
compiler's kernel takes over once built."""

from __future__ import annotations

import os
import shutil
import stat
import time

import pytest
import torch

from _collect import Collect
from tensorwatch_otel import watch
from tensorwatch_otel.core.measure import cpu_kernel, cpu_kernel_build, stats


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie nobody reaped (PID 1 of a container may not) is gone too
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_for_file(path: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path, encoding="ascii") as fh:
                text = fh.read().strip()
            if text:
                return text
        time.sleep(0.02)
    raise AssertionError(f"{path} never written")


@pytest.fixture
def fresh_kernel():
    """A loader that builds again; the process's kernel is put back afterwards."""
    saved = cpu_kernel.KERNEL.wait()
    cpu_kernel.KERNEL.reset()
    yield cpu_kernel.KERNEL
    cpu_kernel.KERNEL.reset(saved, done=True)


@pytest.fixture
def hanging_cc(tmp_path, monkeypatch):
    """A `cc` that starts a child and then sleeps forever; both write their pid."""
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n"
                  f"sleep 1000 & echo $! > {tmp_path}/child.pid\n"
                  f"echo $$ > {tmp_path}/cc.pid\n"
                  "wait\n")
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(cpu_kernel_build, "COMPILE_TIMEOUT_S", 1.5)
    return tmp_path


def _big(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * stats._CHUNK + 5, generator=g)
    x[17] = -123.5
    return x


@pytest.mark.timing
def test_a_hanging_compiler_holds_no_batch_and_is_killed_with_its_children(fresh_kernel, hanging_cc):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(4, 64)
    sink = Collect()
    with watch(model, sinks=[sink]):
        t0 = time.monotonic()
        model(x)
        first = time.monotonic() - t0
    assert first < 1.0, first  # the build runs on a thread of its own
    w = model[0].weight.detach().abs()
    got = {t.name: (t.abs_min, t.abs_max) for t in sink.batches[0].frames[0].tensors}
    assert got["weight"] == (w.min().item(), w.max().item())  # the torch ops' exact values
    cc_pid = int(_wait_for_file(str(hanging_cc / "cc.pid")))
    child_pid = int(_wait_for_file(str(hanging_cc / "child.pid")))
    assert _alive(cc_pid) and _alive(child_pid)  # the compiler really hangs
    assert fresh_kernel.wait(timeout=30) is None  # timed out: torch ops for good
    deadline = time.monotonic() + 5
    while (_alive(cc_pid) or _alive(child_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(cc_pid) and not _alive(child_pid)  # the whole process group is gone
    y = _big(1)
    a = y.abs()
    assert [v.item() for v in stats.measure(y)] == [a.min().item(), a.max().item()]


def test_a_working_compiler_takes_over_once_built(fresh_kernel):
    cc = cpu_kernel_build.find_compiler()
    if not cc or not (os.path.isabs(cc) or shutil.which(cc)):
        pytest.skip("no C compiler on this machine")
    x = _big(2)
    a = x.abs()
    want = [a.min().item(), a.max().item()]
    assert [v.item() for v in stats.measure(x)] == want  # first call: torch ops, build started
    kernel = fresh_kernel.wait(timeout=120)
    assert kernel is not None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = stats.measure(x)
    assert [v.item() for v in got] == want
    ops = {e.name for e in prof.events()}
    assert not ops & {"aten::abs", "aten::aminmax"}, ops  # the kernel measured it


def test_the_torch_mode_builds_nothing(fresh_kernel, monkeypatch):
    monkeypatch.setenv("TENSORWATCH_CPU_KERNEL", "torch")
    assert fresh_kernel.get() is None
    assert fresh_kernel.wait(timeout=1) is None


@pytest.mark.timing
def test_a_process_exiting_during_the_build_leaves_no_compiler_behind(hanging_cc):
    """The interpreter exits while the hanging compiler runs: the exit kills its process group,
    does not wait for it, and the build's thread has ended before the interpreter's finalization."""
    import subprocess
    import sys

    # registered before the package's own handler, so it runs after it, just before the
    # interpreter's finalization: the build's thread must be gone by then
    script = ("import atexit, os, threading, time, torch\n"
              "atexit.register(lambda: print('left running:', [t.name for t in threading.enumerate()\n"
              "                                                if t.name.startswith('tensorwatch')], flush=True))\n"
              "from tensorwatch_otel.core.measure import stats\n"
              "stats.measure(torch.randn(1 << 17))  # starts the build\n"
              f"while not os.path.exists({str(hanging_cc / 'child.pid')!r}): time.sleep(0.02)\n"
              "print('exiting', flush=True)\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ))
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-2000:]
    assert "left running: []" in done.stdout, done.stdout
    assert time.monotonic() - t0 < 30
    cc_pid = int(_wait_for_file(str(hanging_cc / "cc.pid")))
    child_pid = int(_wait_for_file(str(hanging_cc / "child.pid")))
    deadline = time.monotonic() + 5
    while (_alive(cc_pid) or _alive(child_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(cc_pid) and not _alive(child_pid)


def _edge_tensors():
    """Small tensors of every dtype the kernel reads, with the values a pattern compare can get
    wrong: signed zeros, subnormals, the largest finite, inf, NaN."""
    out = []
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        fi = torch.finfo(dt)
        out.append(torch.tensor([-0.0, 0.0, fi.tiny / 4, -fi.max, 3.5], dtype=dt))
        out.append(torch.tensor([1.0, -float("inf"), 2.0], dtype=dt))
        out.append(torch.tensor([1.0, float("nan"), -7.0], dtype=dt))
        out.append(torch.randn(3, 5, dtype=torch.float64).to(dt))
    return out


def _as_floats(pair):
    return [float("nan") if v != v else v for v in pair]


def test_the_per_frame_call_is_a_python_function_where_pythons_headers_are(fresh_kernel):
    """Where Python's headers are (sysconfig's include folder has Python.h) the kernel's per-frame
    call is a function of a Python extension built with it: no ctypes call (about 0.75 us on the
    2-core machine against 0.24 us; docs/performance.md). Its values are the ctypes call's."""
    import sysconfig

    cc = cpu_kernel_build.find_compiler()
    if not cc or not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no C compiler or no Python headers on this machine")
    kernel = fresh_kernel.wait(timeout=120)
    assert kernel is not None
    assert type(kernel.host_call).__name__ == "builtin_function_or_method", kernel.host_call
    for t in _edge_tensors():
        a = t.double().abs()
        want = [a.min().item(), a.max().item()] if not t.isnan().any() else [float("nan")] * 2
        got = kernel.host(t)
        assert all(isinstance(v, float) for v in got)
        assert str(_as_floats(got)) == str(want), (t, got, want)


def test_without_pythons_headers_the_ctypes_call_measures_the_same(fresh_kernel, monkeypatch, tmp_path):
    cc = cpu_kernel_build.find_compiler()
    if not cc or not (os.path.isabs(cc) or shutil.which(cc)):
        pytest.skip("no C compiler on this machine")
    monkeypatch.setattr(cpu_kernel_build, "python_include", lambda: None)
    kernel = fresh_kernel.wait(timeout=120)
    assert kernel is not None
    assert type(kernel.host_call).__name__ != "builtin_function_or_method"
    for t in _edge_tensors():
        a = t.double().abs()
        want = [a.min().item(), a.max().item()] if not t.isnan().any() else [float("nan")] * 2
        assert str(_as_floats(kernel.host(t))) == str(want), t
