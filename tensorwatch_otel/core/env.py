"""Every TENSORWATCH_* environment variable: one documented constant each, and the parsers that
turn a variable's text into an option value (an error names the variable and the valid range).

Nothing here reads the environment at import; watch() and the sinks read it when they are built.
Precedence everywhere: argument, then environment variable, then default.
"""

from __future__ import annotations

import difflib
import logging
import math
from typing import FrozenSet, Mapping, Optional, Sequence, Tuple

from .process import said_once

# -- watch() options (read by WatchConfig.build; an argument left at None falls back to them) -----
#: ``max_frames``: frames in the ring buffer that ends with the first bad one (integer >= 1; 21).
ENV_MAX_FRAMES = "TENSORWATCH_MAX_FRAMES"
#: ``every_n_batches``: watch one batch in N (integer >= 1; 1).
ENV_EVERY_N_BATCHES = "TENSORWATCH_EVERY_N_BATCHES"
#: ``on_detect``: ``raise`` (default), ``report`` or ``skip``.
ENV_ON_DETECT = "TENSORWATCH_ON_DETECT"
#: ``gradients``: also watch gradients (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``; off).
ENV_GRADIENTS = "TENSORWATCH_GRADIENTS"
#: ``include``: module path globs to watch, comma-separated (``encoder.*,lm_head``; all modules).
ENV_INCLUDE = "TENSORWATCH_INCLUDE"
#: ``exclude``: module path globs to leave out, comma-separated (none).
ENV_EXCLUDE = "TENSORWATCH_EXCLUDE"
#: ``trace_batches``: batch numbers (0-based) to trace frame by frame, comma-separated (none).
ENV_TRACE_BATCHES = "TENSORWATCH_TRACE_BATCHES"
#: ``abort_after_batch``: stop with AbortAfterBatch once this batch has finished (integer >= 0; never).
ENV_ABORT_AFTER_BATCH = "TENSORWATCH_ABORT_AFTER_BATCH"
#: ``check``: ``batch`` (one read-back per batch, default) or ``module`` (after every module call).
ENV_CHECK = "TENSORWATCH_CHECK"
#: ``optimizer_state``: also measure optimizer state tensors after each step (boolean; off).
ENV_OPTIMIZER_STATE = "TENSORWATCH_OPTIMIZER_STATE"
#: ``capture_dir``: on a detection, save the batch's inputs and RNG states under this folder (off).
ENV_CAPTURE_DIR = "TENSORWATCH_CAPTURE_DIR"
#: ``max_skipped_steps``: optimizer steps skipped in a row before an alert event (integer >= 1; 20).
ENV_MAX_SKIPPED_STEPS = "TENSORWATCH_MAX_SKIPPED_STEPS"
#: ``rerun_on_detect``: rerun the failing batch to confirm a detection (boolean; off).
ENV_RERUN_ON_DETECT = "TENSORWATCH_RERUN_ON_DETECT"
#: ``flush_timeout_s``: most seconds a detection waits for the sinks to record it (number >= 0; 5).
ENV_FLUSH_TIMEOUT_SECONDS = "TENSORWATCH_FLUSH_TIMEOUT_SECONDS"
#: ``guard_steps``: check the gradients an optimizer step consumes, in one read, before it runs
#: (boolean; on). ``gradients=True`` localizes in the backward instead.
ENV_GUARD_STEPS = "TENSORWATCH_GUARD_STEPS"
#: ``target_dtypes``: comma-separated torch dtype names (``float16,bfloat16,float8_e4m3fn``) each
#: measured tensor's underflow/overflow shares are computed for (none).
ENV_TARGET_DTYPES = "TENSORWATCH_TARGET_DTYPES"
#: ``max_overhead``: the watcher's share of the step time to stay within, a number between 0 and 1
#: (``0.02``: 2%); it measures one batch in N, N chosen to keep within it (off: every_n_batches).
ENV_MAX_OVERHEAD = "TENSORWATCH_MAX_OVERHEAD"
#: How CPU tensors are measured: ``native`` (a one-read kernel compiled on first use with the C
#: compiler, torch ops when there is none; default) or ``torch`` (torch ops only). Process-wide.
ENV_CPU_KERNEL = "TENSORWATCH_CPU_KERNEL"
#: Where a compiled model's submodules are measured with plain ops inside the graph (no Python
#: per module call; see docs/compile.md) instead of ops with a Python body: ``cpu`` (default:
#: graphs on the CPU), ``1`` (every device; CUDA not yet verified on a GPU) or ``0`` (nowhere).
#: Read once per process, at import.
ENV_GRAPH_STATS = "TENSORWATCH_GRAPH_STATS"

# -- sinks that watch(sinks=None) adds to the text report ------------------------------------------
#: Serve Prometheus ``/metrics`` on this port plus LOCAL_RANK (0..65535; off when unset).
ENV_PROMETHEUS_PORT = "TENSORWATCH_PROMETHEUS_PORT"
#: Address the Prometheus endpoint binds (``127.0.0.1``).
ENV_PROMETHEUS_ADDR = "TENSORWATCH_PROMETHEUS_ADDR"
#: ``PrometheusMetrics(max_series=)``: (module, tensor) pairs per gauge (integer >= 1; 10000).
ENV_PROMETHEUS_MAX_SERIES = "TENSORWATCH_PROMETHEUS_MAX_SERIES"
#: ``PrometheusMetrics(linger_s=)``: after a detection, seconds to wait at exit for a scrape (>= 0; 30).
ENV_PROMETHEUS_LINGER_SECONDS = "TENSORWATCH_PROMETHEUS_LINGER_SECONDS"
#: ``PrometheusMetrics(detail=)``: per-module series served: ``all`` (default), ``summary`` (per-rank
#: series only) or ``top:K`` (the K (module, tensor) pairs with the largest range used, K >= 1).
ENV_PROMETHEUS_DETAIL = "TENSORWATCH_PROMETHEUS_DETAIL"
#: ``PrometheusMetrics(detail_ranks=)``: ranks that serve every per-module series whatever
#: ``detail`` says, comma-separated integers >= 0 (none).
ENV_PROMETHEUS_DETAIL_RANKS = "TENSORWATCH_PROMETHEUS_DETAIL_RANKS"
#: ``window_s=`` of both metric sinks: seconds of batches the tensor gauges cover (>= 0; 60; 0: last batch).
ENV_METRICS_WINDOW_SECONDS = "TENSORWATCH_METRICS_WINDOW_SECONDS"
#: Append the JSON lines event log to this path (``{rank}`` in it: one file per rank; off when unset).
ENV_JSONL = "TENSORWATCH_JSONL"

# -- test suite only -------------------------------------------------------------------------------
#: ``nettest`` fault injection, ``KIND:RANK[,KIND:RANK]`` (for the test suite).
ENV_NETTEST_FAULT = "TENSORWATCH_NETTEST_FAULT"

#: Every variable above, in the order the documentation lists them.
ALL: Tuple[str, ...] = (
    ENV_MAX_FRAMES, ENV_EVERY_N_BATCHES, ENV_ON_DETECT, ENV_GRADIENTS, ENV_INCLUDE, ENV_EXCLUDE,
    ENV_TRACE_BATCHES, ENV_ABORT_AFTER_BATCH, ENV_CHECK, ENV_OPTIMIZER_STATE, ENV_CAPTURE_DIR,
    ENV_MAX_SKIPPED_STEPS, ENV_RERUN_ON_DETECT, ENV_FLUSH_TIMEOUT_SECONDS, ENV_GUARD_STEPS,
    ENV_TARGET_DTYPES, ENV_MAX_OVERHEAD, ENV_CPU_KERNEL, ENV_GRAPH_STATS,
    ENV_PROMETHEUS_PORT, ENV_PROMETHEUS_ADDR, ENV_PROMETHEUS_MAX_SERIES, ENV_PROMETHEUS_LINGER_SECONDS,
    ENV_PROMETHEUS_DETAIL, ENV_PROMETHEUS_DETAIL_RANKS,
    ENV_METRICS_WINDOW_SECONDS, ENV_JSONL, ENV_NETTEST_FAULT,
)

def warn_unknown(environ: Mapping[str, str]) -> None:
    """One warning per process and name for a TENSORWATCH_* variable that is none of ours (a
    misspelt one would otherwise be ignored without a word), naming the closest real one."""
    prefix = "TENSORWATCH_"
    for name in environ:
        if not isinstance(name, str) or not name.startswith(prefix) or name in ALL \
                or not said_once(("unknown variable", name)):
            continue
        close = difflib.get_close_matches(name, ALL, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "see docs/reference/options.md for the variables"
        logging.getLogger(__name__).warning("tensorwatch_otel: %s is not a tensorwatch_otel variable and is "
                                            "ignored; %s", name, hint)


_TRUE: FrozenSet[str] = frozenset({"1", "true", "yes", "on"})
_FALSE: FrozenSet[str] = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """An invalid option or variable; the message names it and the valid range."""


def text(environ: Mapping[str, str], name: str) -> Optional[str]:
    """The variable's value without surrounding blanks, or None when unset or blank."""
    raw = environ.get(name, "")
    raw = raw.strip() if isinstance(raw, str) else ""
    return raw or None


def parse_int(name: str, raw: str, minimum: int, maximum: Optional[int] = None) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        rng = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ConfigError(f"{name}={raw!r}: expected an integer {rng}")
    return value


def parse_float(name: str, raw: str, minimum: float) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not value >= minimum or not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r}: expected a finite number >= {minimum:g}")
    return value


def parse_share(name: str, raw: str) -> float:
    """A number strictly between 0 and 1."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise ConfigError(f"{name}={raw!r}: expected a number between 0 and 1 (exclusive), e.g. 0.02 for 2%")
    return value


def parse_bool(name: str, raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r}: expected one of 1, true, yes, on (or 0, false, no, off)")


def parse_choice(name: str, raw: str, choices: Sequence[str]) -> str:
    if raw.lower() in choices:
        return raw.lower()
    if raw not in choices:
        raise ConfigError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


def parse_list(name: str, raw: str) -> Tuple[str, ...]:
    """Comma-separated items, blanks dropped."""
    items = tuple(p.strip() for p in raw.split(","))
    return tuple(p for p in items if p)


def parse_batches(name: str, raw: str) -> Tuple[int, ...]:
    """Comma-separated batch numbers (integers >= 0)."""
    out = []
    for part in parse_list(name, raw):
        try:
            n = int(part)
        except ValueError:
            n = -1
        if n < 0:
            raise ConfigError(f"{name}={raw!r}: {part!r} is not a batch number; expected integers >= 0 "
                           f"separated by commas")
        out.append(n)
    return tuple(out)


CPU_KERNELS = ("native", "torch")
GRAPH_STATS_MODES = ("1", "cpu", "0")


def graph_stats_mode(environ: Mapping[str, str]) -> str:
    """``1`` (every device, the default), ``cpu`` (graphs on the CPU only) or ``0`` (off), from
    TENSORWATCH_GRAPH_STATS (true/false words too)."""
    raw = text(environ, ENV_GRAPH_STATS)
    if raw is None:
        return GRAPH_STATS_MODES[0]
    low = raw.lower()
    if low in _TRUE:
        return "1"
    if low in _FALSE:
        return "0"
    return parse_choice(ENV_GRAPH_STATS, low, GRAPH_STATS_MODES)


def cpu_kernel_mode(environ: Mapping[str, str]) -> str:
    """``native`` or ``torch``, from TENSORWATCH_CPU_KERNEL (default ``native``)."""
    raw = text(environ, ENV_CPU_KERNEL)
    return CPU_KERNELS[0] if raw is None else parse_choice(ENV_CPU_KERNEL, raw, CPU_KERNELS)
