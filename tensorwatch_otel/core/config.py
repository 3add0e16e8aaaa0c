"""Watcher options: one frozen dataclass, validated when the watcher is built.

Precedence is argument, then environment variable, then default; the environment is read
when a watcher is built, never at import.
"""

from __future__ import annotations

import difflib
import math
import os
import tempfile
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, FrozenSet, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import env as _env
from .measure import graph_stats
from .measure.magnitude import parse_targets
from .rank import env_rank
from .env import ENV_EVERY_N_BATCHES, ENV_MAX_FRAMES, ENV_ON_DETECT, ConfigError  # noqa: F401  (re-exported)

ON_DETECT = ("raise", "report", "skip")
CHECK = ("batch", "module")


def _int_option(name: str, value: object, minimum: int, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or \
            (maximum is not None and value > maximum):
        rng = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ConfigError(f"{name}={value!r}: expected an integer {rng}")
    return value


def _patterns(name: str, value: Any) -> Tuple[str, ...]:
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


def check_keywords(owner: str, given: Iterable[str], valid: Sequence[str]) -> None:
    """TypeError for keywords `owner` does not take, listing the valid ones (and the closest
    one to each unknown): watch() and the framework callbacks say the same."""
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(valid), n=1)
        if close:
            hints.append(f"{name} (did you mean {close[0]}?)")
        else:
            hints.append(name)
    raise TypeError(f"{owner}: unknown watch() option(s) {', '.join(hints)}; valid: {', '.join(valid)}")


def _check_capture_dir(name: str, path: str) -> None:
    """ConfigError naming the option or variable unless `path` is, or can become, a folder that
    takes new files: found when the watcher is built, not at the first detection."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{name}={path!r}: {why}; expected a folder that can be created and written")

    if os.path.exists(path) and not os.path.isdir(path):
        raise bad("exists and is not a directory")
    why = folder_problem(path)
    if why is not None:
        raise bad(why)


def folder_problem(folder: str) -> Optional[str]:
    """Why no new file can be created in `folder` (which may not exist yet), or None. The first
    existing folder on its path decides: it must be a folder that takes a new file."""
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):  # folders still to create: the first existing one decides
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder!r} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"cannot create files in {folder!r} ({exc.strerror or exc})"
    return None


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
    guard_steps: bool = True
    #: torch dtype names (normalized) whose underflow/overflow shares every measured tensor gets
    target_dtypes: Tuple[str, ...] = ()
    #: the watcher's share of the step time to stay within (0 < x < 1); None: every_n_batches alone
    max_overhead: Optional[float] = None

    @property
    def sampling(self) -> bool:
        """Some batches may go unrecorded (every_n_batches > 1, or max_overhead choosing an
        interval): their outputs and optimizer steps are checked all the same, and their inputs
        held for the replay that names a detection's place (core/batch/detection.py)."""
        return self.every_n_batches > 1 or self.max_overhead is not None

    @classmethod
    def build(cls, *, max_frames: Optional[int] = None, trace_batches: Union[int, Iterable[int], None] = None,
              abort_after_batch: Optional[int] = None, every_n_batches: Optional[int] = None,
              gradients: Optional[bool] = None, include: Union[str, Iterable[str], None] = None,
              exclude: Union[str, Iterable[str], None] = None, on_detect: Optional[str] = None,
              check: Optional[str] = None, flush_timeout_s: Optional[float] = None, strict: bool = False,
              optimizer_state: Optional[bool] = None, capture_dir: Union[str, os.PathLike[str], None] = None,
              max_skipped_steps: Optional[int] = None, rerun_on_detect: Optional[bool] = None,
              guard_steps: Optional[bool] = None,
              target_dtypes: Union[str, torch.dtype, Iterable[Union[str, torch.dtype]], None] = None,
              max_overhead: Optional[float] = None,
              environ: Optional[Mapping[str, str]] = None) -> "WatchConfig":
        """Validated options. An option left at None comes from its TENSORWATCH_* variable (see
        core/env.py) when that is set, else from the field's default. ``environ``: the variables
        to read (default os.environ; ``{}`` for the defaults alone)."""
        env = os.environ if environ is None else environ

        def pick(option: str, value: Any) -> Tuple[str, Any]:
            # (the name an error message gives: the option or the variable, the value)
            if value is not None:
                return option, value
            var, parse = _ENV_OPTIONS[option]
            raw = _env.text(env, var)
            if raw is None:
                return option, getattr(cls, option)
            return var, parse(var, raw)

        max_frames = _int_option(*pick("max_frames", max_frames), *_INT_RANGE["max_frames"])
        every = _int_option(*pick("every_n_batches", every_n_batches), *_INT_RANGE["every_n_batches"])
        name, batches = pick("trace_batches", trace_batches)  # any value: checked here
        if isinstance(batches, int) and not isinstance(batches, bool):
            batches = (batches,)
        try:
            traced = frozenset(batches)
        except TypeError:
            raise ConfigError(f"{name}={batches!r}: expected a list of batch numbers >= 0") from None
        for b in traced:
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                raise ConfigError(f"{name}: {b!r} is not a batch number (an integer >= 0)")
        name, abort_after_batch = pick("abort_after_batch", abort_after_batch)
        if abort_after_batch is not None:
            abort_after_batch = _int_option(name, abort_after_batch, *_INT_RANGE["abort_after_batch"])
        name, on_detect = pick("on_detect", on_detect)
        if on_detect not in ON_DETECT:
            raise ConfigError(f"{name}={on_detect!r}: expected one of {', '.join(ON_DETECT)}")
        name, check = pick("check", check)
        if check not in CHECK:
            raise ConfigError(f"{name}={check!r}: expected one of {', '.join(CHECK)}")
        flags: Dict[str, Any] = {}  # checked below: True or False
        for option, value in (("gradients", gradients), ("optimizer_state", optimizer_state),
                              ("rerun_on_detect", rerun_on_detect), ("guard_steps", guard_steps)):
            name, flags[option] = pick(option, value)
            if not isinstance(flags[option], bool):
                raise ConfigError(f"{name}={flags[option]!r}: expected True or False")
        name, capture_dir = pick("capture_dir", capture_dir)
        if capture_dir is not None:
            capture_dir = os.fspath(capture_dir)
            _check_capture_dir(name, capture_dir)
        max_skipped = _int_option(*pick("max_skipped_steps", max_skipped_steps),
                                  *_INT_RANGE["max_skipped_steps"])
        name, flush_timeout_s = pick("flush_timeout_s", flush_timeout_s)
        if isinstance(flush_timeout_s, bool) or not (isinstance(flush_timeout_s, (int, float))
                                                     and 0 <= flush_timeout_s < math.inf):
            raise ConfigError(f"{name}={flush_timeout_s!r}: expected a finite number of seconds >= 0")
        name, include = pick("include", include)
        include = _patterns(name, include)
        name, exclude = pick("exclude", exclude)
        exclude = _patterns(name, exclude)
        target_dtypes = parse_targets(*pick("target_dtypes", target_dtypes))
        name, max_overhead = pick("max_overhead", max_overhead)
        if max_overhead is not None and (isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float))
                                         or not 0 < max_overhead < 1):
            raise ConfigError(f"{name}={max_overhead!r}: expected a number between 0 and 1 (exclusive), "
                              "e.g. 0.02 for 2%")
        _env.warn_unknown(env)
        env_rank(env)  # a bad RANK fails when the watcher is built, not in a sink or at a detection
        _env.cpu_kernel_mode(env)  # process-wide, read by core/measure/cpu_kernel.py; a bad value fails here, early
        graph_stats.use_mode(_env.graph_stats_mode(env))  # process-wide (dynamo guards on it); a bad value fails here
        return cls(max_frames=max_frames, trace_batches=traced, abort_after_batch=abort_after_batch,
                   every_n_batches=every, gradients=flags["gradients"], include=include,
                   exclude=exclude, on_detect=on_detect, check=check,
                   flush_timeout_s=float(flush_timeout_s), strict=bool(strict),
                   optimizer_state=flags["optimizer_state"], capture_dir=capture_dir,
                   max_skipped_steps=max_skipped, rerun_on_detect=flags["rerun_on_detect"],
                   guard_steps=flags["guard_steps"], target_dtypes=target_dtypes,
                   max_overhead=None if max_overhead is None else float(max_overhead))


#: Valid ranges of the integer options, (minimum, maximum or None): for arguments and variables alike.
#: Most frames the ring buffer may keep (max_frames). The watcher keeps whole batch records
#: until they cover the ring, so an unbounded value would keep every batch of the run.
MAX_FRAMES_LIMIT = 100_000

_INT_RANGE = {
    "max_frames": (1, MAX_FRAMES_LIMIT),
    "every_n_batches": (1, None),
    "abort_after_batch": (0, None),
    "max_skipped_steps": (1, None),
}


def _ints(option: str) -> Callable[[str, str], int]:
    return lambda var, raw: _env.parse_int(var, raw, *_INT_RANGE[option])


#: option -> (its TENSORWATCH_* variable, the parser of the variable's text)
_ENV_OPTIONS = {
    "max_frames": (_env.ENV_MAX_FRAMES, _ints("max_frames")),
    "every_n_batches": (_env.ENV_EVERY_N_BATCHES, _ints("every_n_batches")),
    "on_detect": (_env.ENV_ON_DETECT, lambda var, raw: _env.parse_choice(var, raw, ON_DETECT)),
    "gradients": (_env.ENV_GRADIENTS, _env.parse_bool),
    "include": (_env.ENV_INCLUDE, _env.parse_list),
    "exclude": (_env.ENV_EXCLUDE, _env.parse_list),
    "trace_batches": (_env.ENV_TRACE_BATCHES, _env.parse_batches),
    "abort_after_batch": (_env.ENV_ABORT_AFTER_BATCH, _ints("abort_after_batch")),
    "check": (_env.ENV_CHECK, lambda var, raw: _env.parse_choice(var, raw, CHECK)),
    "optimizer_state": (_env.ENV_OPTIMIZER_STATE, _env.parse_bool),
    "capture_dir": (_env.ENV_CAPTURE_DIR, lambda var, raw: raw),
    "max_skipped_steps": (_env.ENV_MAX_SKIPPED_STEPS, _ints("max_skipped_steps")),
    "rerun_on_detect": (_env.ENV_RERUN_ON_DETECT, _env.parse_bool),
    "guard_steps": (_env.ENV_GUARD_STEPS, _env.parse_bool),
    "target_dtypes": (_env.ENV_TARGET_DTYPES, lambda var, raw: raw),
    "max_overhead": (_env.ENV_MAX_OVERHEAD, _env.parse_share),
    "flush_timeout_s": (_env.ENV_FLUSH_TIMEOUT_SECONDS, lambda var, raw: _env.parse_float(var, raw, 0.0)),
}

#: The effective defaults (what an option left at None becomes when its variable is unset).
DEFAULTS = {f.name: f.default for f in fields(WatchConfig)}
