"""Watcher options: one frozen dataclass, validated when the watcher is built.

Precedence is argument, then environment variable, then default; the environment is read
when a watcher is built, never at import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import FrozenSet, Optional, Tuple

ON_DETECT = ("raise", "report")
CHECK = ("batch", "module")

# Documented environment variables (read by watch(), and by sinks_from_env for sinks=None).
ENV_EVERY_N_BATCHES = "TENSORWATCH_EVERY_N_BATCHES"
ENV_MAX_FRAMES = "TENSORWATCH_MAX_FRAMES"
ENV_ON_DETECT = "TENSORWATCH_ON_DETECT"

#: Most frames the ring buffer may keep (max_frames). The watcher keeps whole batch records
#: until they cover the ring, so an unbounded value would keep every batch of the run.
MAX_FRAMES_LIMIT = 100_000


class ConfigError(ValueError):
    """An invalid option; the message names the option and the valid range."""


def _int_option(name: str, value, minimum: int, env: Optional[str] = None) -> int:
    if value is None and env and os.environ.get(env, "").strip():
        raw = os.environ[env].strip()
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{env}={raw!r}: expected an integer >= {minimum}") from None
        name = env
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r}: expected an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{name}={value!r}: expected an integer >= {minimum}")
    return value


def _patterns(name: str, value) -> Tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    try:
        out = tuple(value)
    except TypeError:
        raise ConfigError(f"{name}={value!r}: expected a glob pattern or a list of them") from None
    for p in out:
        if not isinstance(p, str):
            raise ConfigError(f"{name}: pattern {p!r} is not a string")
    return out


@dataclass(frozen=True)
class WatchConfig:
    max_frames: int = 21
    trace_batches: FrozenSet[int] = frozenset()
    abort_after_batch: Optional[int] = None
    every_n_batches: int = 1
    gradients: bool = False
    include: Tuple[str, ...] = ()
    exclude: Tuple[str, ...] = ()
    on_detect: str = "raise"
    check: str = "batch"
    flush_timeout_s: float = 5.0
    strict: bool = False
    optimizer_state: bool = False
    capture_dir: Optional[str] = None
    max_skipped_steps: int = 20
    rerun_on_detect: bool = False

    @classmethod
    def build(cls, *, max_frames=None, trace_batches=(), abort_after_batch=None, every_n_batches=None,
              gradients=False, include=None, exclude=None, on_detect=None, check="batch",
              flush_timeout_s=5.0, strict=False, optimizer_state=False, capture_dir=None,
              max_skipped_steps=None, rerun_on_detect=False) -> "WatchConfig":
        max_frames_arg = max_frames
        max_frames = _int_option("max_frames", max_frames, 1, ENV_MAX_FRAMES) if max_frames is not None or \
            os.environ.get(ENV_MAX_FRAMES) else 21
        if max_frames > MAX_FRAMES_LIMIT:
            name = "max_frames" if max_frames_arg is not None else ENV_MAX_FRAMES
            raise ConfigError(f"{name}={max_frames!r}: expected an integer from 1 to {MAX_FRAMES_LIMIT} "
                              "(frames kept in the ring buffer)")
        every = _int_option("every_n_batches", every_n_batches, 1, ENV_EVERY_N_BATCHES) \
            if every_n_batches is not None or os.environ.get(ENV_EVERY_N_BATCHES) else 1
        if trace_batches is None:
            trace_batches = ()
        if isinstance(trace_batches, int) and not isinstance(trace_batches, bool):
            trace_batches = (trace_batches,)
        try:
            traced = frozenset(trace_batches)
        except TypeError:
            raise ConfigError(f"trace_batches={trace_batches!r}: expected a list of batch numbers >= 0") from None
        for b in traced:
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                raise ConfigError(f"trace_batches: {b!r} is not a batch number (an integer >= 0)")
        if abort_after_batch is not None:
            abort_after_batch = _int_option("abort_after_batch", abort_after_batch, 0)
        if on_detect is None:
            on_detect = os.environ.get(ENV_ON_DETECT, "").strip() or "raise"
        if on_detect not in ON_DETECT:
            raise ConfigError(f"on_detect={on_detect!r}: expected one of {', '.join(ON_DETECT)}")
        if check not in CHECK:
            raise ConfigError(f"check={check!r}: expected one of {', '.join(CHECK)}")
        if not isinstance(gradients, bool):
            raise ConfigError(f"gradients={gradients!r}: expected True or False")
        for name, flag in (("optimizer_state", optimizer_state), ("rerun_on_detect", rerun_on_detect)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name}={flag!r}: expected True or False")
        if capture_dir is not None:
            capture_dir = os.fspath(capture_dir)
            if os.path.exists(capture_dir) and not os.path.isdir(capture_dir):
                raise ConfigError(f"capture_dir={capture_dir!r}: exists and is not a directory")
        max_skipped = 20 if max_skipped_steps is None else _int_option("max_skipped_steps", max_skipped_steps, 1)
        if not (isinstance(flush_timeout_s, (int, float)) and flush_timeout_s >= 0):
            raise ConfigError(f"flush_timeout_s={flush_timeout_s!r}: expected a number of seconds >= 0")
        return cls(max_frames=max_frames, trace_batches=traced, abort_after_batch=abort_after_batch,
                   every_n_batches=every, gradients=gradients, include=_patterns("include", include),
                   exclude=_patterns("exclude", exclude), on_detect=on_detect, check=check,
                   flush_timeout_s=float(flush_timeout_s), strict=bool(strict),
                   optimizer_state=optimizer_state, capture_dir=capture_dir, max_skipped_steps=max_skipped,
                   rerun_on_detect=rerun_on_detect)
