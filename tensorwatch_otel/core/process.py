"""What one process shares between its watchers, in one place.

A watcher keeps its state in its own objects. A few things belong to the process by nature:
compiled graphs refer to hook slots by number and outlive any one watcher; the CPU kernel is
built once; torch's global optimizer hooks and `detect_overflow()` reach every live watcher.
Each of those is one object of its module, listed in PROCESS_WIDE with why. The core keeps no
other module-level mutable state (tests/test_process_state.py checks the source: a name rebound
with `global`, or a module-level object written in place or made as an empty container, lock,
counter or thread-local at import, must be listed here). Memo caches of pure functions are
`functools` caches on those functions.

Log lines said once per process go through `said_once`.
"""

from __future__ import annotations

import threading
from types import MappingProxyType
from typing import Hashable, Mapping, Set

#: "module.NAME" (a module of tensorwatch_otel/core, dotted from there: "measure.stats") -> why the
#: process holds it
PROCESS_WIDE: Mapping[str, str] = MappingProxyType({
    "frames.op_slots.SLOTS": "slot number -> the hooks an op call site in a compiled graph runs; graphs hold the "
                             "numbers and may outlive the watcher that placed them",
    "frames.compiled.OPEN": "per thread, the module calls whose pre op ran inside a compiled graph and whose post "
                            "op has not run yet (an exception inside the graph leaves them open)",
    "frames.compiled.ran": "pre ops run so far by every compiled graph of the process: where it moved, an "
                           "unsampled batch keeps the hooks on (core/frames/quiet.py)",
    "frames.compiled.EAGER": "the hook code objects dynamo must run eagerly when reached as a frame of their own, "
                             "marked once dynamo is loaded",
    "measure.cpu_kernel.KERNEL": "the CPU statistics kernel, built once per process on a thread of its own",
    "measure.cpu_kernel_build.COMPILERS": "compiler processes still running, killed with their process groups at exit",
    "measure.device_path.DEVICE_PATH": "which devices take the fused device path (a test/benchmark switch) and the "
                                       "fused kernels, built once per process",
    "measure.device_path.IMMEDIATE": "per thread, inside a compiled graph's ops: frames are measured at once, never "
                                     "deferred (inductor reuses the graph's buffers without a version bump)",
    "measure.graph_sites.SITES": "in-graph statistics: the call sites compiled graphs were traced with (their "
                                 "values are stored on them after each run) and the per-device sequence counters",
    "measure.graph_stats.ROOT_TRACED": "the tracing contexts (weakly held) whose graph traced a model's own hooks: "
                                       "their submodules keep the ops",
    "measure.graph_stats._TRACE_TIME": "the functions (of graph_stats and compiled) marked for dynamo to run at trace "
                                       "time, at the first watch()",
    "measure.graph_stats.ON": "whether submodules of compiled graphs are measured inside the graph "
                              "(TENSORWATCH_GRAPH_STATS, where a watcher's options are built; dynamo guards on it)",
    "measure.graph_stats.EVERY_DEVICE": "whether graphs on every device measure inside, or only the CPU's (set "
                                        "with ON)",
    "events.TRACE_IDS": "where events take the current trace id from (the OpenTelemetry sink sets it)",
    "fleet_node.NODE_FILES": "node files this process opened, numbered in the same sequence on every local rank",
    "frames.quiet._instances": "every quiet-batch switch alive: a sentry pre-hook registered globally consults them",
    "steps.skip._CLASSES": "optimizer class -> its stand-in class for a skipped step, made once per class",
    "measure.stats._scratch": "per thread, the reused chunk buffers of the torch-ops CPU path",
    "watcher.ACTIVE": "watchers alive, weakly held: detect_overflow() hands its findings to them",
})

_said: Set[Hashable] = set()
_said_lock = threading.Lock()


def said_once(key: Hashable) -> bool:
    """True the first time `key` is given in this process, False after: for log lines said once."""
    with _said_lock:
        if key in _said:
            return False
        _said.add(key)
        return True


def forget_said(key: Hashable) -> None:
    """Let `key` be said again (tests)."""
    with _said_lock:
        _said.discard(key)
