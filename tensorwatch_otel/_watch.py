"""watch(): a core Watcher composed with the sinks the caller names, or with the text report
plus what the environment configures."""

from __future__ import annotations

import fnmatch
import inspect
import logging
from typing import List, Optional, Sequence

import torch

from .core import naming
from .core.config import WatchConfig, check_keywords
from .core.env import ENV_EXCLUDE, ENV_INCLUDE, ConfigError
from .core.ports import Sink
from .core.watcher import Watcher


def watch(model: torch.nn.Module, *, sinks: Optional[Sequence[Sink]] = None, max_frames: Optional[int] = None,
          trace_batches: Optional[Sequence[int]] = None, abort_after_batch: Optional[int] = None,
          every_n_batches: Optional[int] = None, gradients: Optional[bool] = None, include=None, exclude=None,
          on_detect: Optional[str] = None, check: Optional[str] = None, strict: bool = False,
          flush_timeout_s: Optional[float] = None, optimizer_state: Optional[bool] = None, capture_dir=None,
          grad_scaler=None, max_skipped_steps: Optional[int] = None,
          rerun_on_detect: Optional[bool] = None, guard_steps: Optional[bool] = None,
          target_dtypes: Optional[Sequence[str]] = None, max_overhead: Optional[float] = None,
          **unknown) -> Watcher:
    """Watch every module of `model` for inf/nan and export per-module abs min/max.

    An option left at None comes from its environment variable when that is set, else from its
    default (an argument always wins): max_frames (TENSORWATCH_MAX_FRAMES, 21), trace_batches
    (TENSORWATCH_TRACE_BATCHES, none), abort_after_batch (TENSORWATCH_ABORT_AFTER_BATCH, never),
    every_n_batches (TENSORWATCH_EVERY_N_BATCHES, 1), gradients (TENSORWATCH_GRADIENTS, False),
    include/exclude (TENSORWATCH_INCLUDE/EXCLUDE, comma-separated globs; all modules),
    on_detect (TENSORWATCH_ON_DETECT, "raise"; "report" records and goes on; "skip" also skips
    the optimizer step that would consume the inf/nan), check (TENSORWATCH_CHECK, "batch"),
    flush_timeout_s (TENSORWATCH_FLUSH_TIMEOUT_SECONDS, 5.0), optimizer_state
    (TENSORWATCH_OPTIMIZER_STATE, False), capture_dir (TENSORWATCH_CAPTURE_DIR, off),
    max_skipped_steps (TENSORWATCH_MAX_SKIPPED_STEPS, 20), rerun_on_detect
    (TENSORWATCH_RERUN_ON_DETECT, False), guard_steps (TENSORWATCH_GUARD_STEPS, True), target_dtypes
    (TENSORWATCH_TARGET_DTYPES, none), max_overhead (TENSORWATCH_MAX_OVERHEAD, off). An invalid
    value raises ConfigError (a ValueError)
    naming the option or variable and the valid range.

    Statistics stay on the device and come back in one transfer per batch (`check="batch"`);
    `check="module"` reads back after every module call (exact and immediate, slower).
    `sinks=None` means a TextReport plus what the environment configures
    (TENSORWATCH_PROMETHEUS_PORT, TENSORWATCH_JSONL, OTEL_EXPORTER_OTLP_*), exporting through the
    application's OpenTelemetry providers when it has installed SDK ones.

    `gradients=True` also watches parameter gradients: a non-finite gradient is a detection
    only when an optimizer step consumes it; a step skipped instead (torch.amp.GradScaler) is
    counted as a skipped step, and `max_skipped_steps` skips in a row raise an alert event.
    `grad_scaler` (a torch.amp.GradScaler) exports its scale and counts its skips.

    `guard_steps=True` (the default, when gradients are not watched): before each optimizer
    step, the gradients the step will consume are checked in one host read; a non-finite one is
    a detection (phase "backward", tensor `weight.grad`...) raised before the step changes the
    weights. A step GradScaler skips is not checked (it stays a skipped step).

    `every_n_batches=N` records statistics in one batch out of N, but detects in every batch: the
    output of an unsampled batch's outermost call (its loss alone when it carries one, as a
    transformers ModelOutput does) is checked in one read, and its optimizer step is guarded (with
    `gradients=True` too). A detection there replays the batch (its inputs held by reference, the
    RNG states of its start, the weights not yet stepped) with every module watched, and reports
    the event a recorded batch would have given: the module where the inf/nan was born, and its
    frames. When the replay finds none in the forward (born in a loss computed outside the model,
    or in the backward), the event is the check's own (the step guard's parameter gradient). A
    batch that cannot be replayed (no call of the root in it, inputs the forward changed in
    place, an FSDP-sharded model) keeps that event; said once in the log. A `batch()` block that
    calls the root several times replays the last of those calls.

    `target_dtypes=["float8_e4m3fn", "float16"]`: every measured tensor's frame statistic gains
    `underflow` / `overflow`, the share of its non-zero finite elements a cast to each dtype
    flushes to zero / puts beyond its largest value (8-bit floats with per-tensor current
    scaling), and `magnitude`, the power-of-two histogram they come from (core/measure/magnitude.py).

    `max_overhead=0.02`: the watcher times its own work and measures one batch in N, N chosen to
    keep its share of the step time within 2% (every_n_batches is the shortest interval it
    chooses, 1000 the longest; the first and traced batches are always measured). The step guard
    still checks every batch. `Watcher.measure_every_n_batches` and `Watcher.overhead` say where
    it stands; a change is an INFO log line and a `sampling_rate` event (core/batch/sampling.py).
    """
    if unknown:
        check_keywords("watch()", unknown, _OPTIONS)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    _check_grad_scaler(grad_scaler)
    config = WatchConfig.build(max_frames=max_frames, trace_batches=trace_batches,
                               abort_after_batch=abort_after_batch, every_n_batches=every_n_batches,
                               gradients=gradients, include=include, exclude=exclude,
                               on_detect=on_detect, check=check, flush_timeout_s=flush_timeout_s,
                               strict=strict, optimizer_state=optimizer_state, capture_dir=capture_dir,
                               max_skipped_steps=max_skipped_steps, rerun_on_detect=rerun_on_detect,
                               guard_steps=guard_steps, target_dtypes=target_dtypes, max_overhead=max_overhead)
    _check_patterns(model, config, include is None, exclude is None)
    owned: List[Sink] = []
    if sinks is not None:
        sinks = _sink_list(sinks)
    if sinks is None:
        from .sinks.text import TextReport

        owned = [TextReport()] + env_sinks()
        sinks = owned
    return Watcher(model, sinks, config, owned_sinks=owned, grad_scaler=grad_scaler)


log = logging.getLogger(__name__)
#: watch()'s options, for the error that lists them.
_OPTIONS = tuple(n for n, p in inspect.signature(watch).parameters.items() if p.kind is p.KEYWORD_ONLY)


def _is_sink(s) -> bool:
    return isinstance(s, Sink) or (hasattr(s, "on_event") and hasattr(s, "on_batch"))


def _sink_list(sinks) -> List[Sink]:
    if _is_sink(sinks):
        name = type(sinks).__name__
        raise TypeError(f"sinks: expected a list of sinks, got one {name}; write sinks=[{name}(...)]")
    try:
        out = list(sinks)
    except TypeError:
        raise TypeError(f"sinks: expected a list of sinks (see tensorwatch_otel.sinks), got "
                        f"{type(sinks).__name__}") from None
    for s in out:
        if not _is_sink(s):
            raise TypeError(f"sinks: {s!r} is not a sink (see tensorwatch_otel.sinks)")
    return out


def _check_grad_scaler(scaler) -> None:
    # what the watcher reads of it: the scale (core/steps/guard.py ScaleReader) and whether it is on
    if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in ("get_scale", "update", "step")):
        raise TypeError(f"grad_scaler={scaler!r}: expected a torch.amp.GradScaler (or None)")


def _check_patterns(model: torch.nn.Module, config: WatchConfig, include_from_env: bool,
                    exclude_from_env: bool) -> None:
    """include matching no module path is a ConfigError: a model that is silently not watched
    is the worst outcome of a watcher. An exclude pattern (or one of several include patterns)
    matching nothing is a warning: the rest of the model is still watched."""
    if not config.include and not config.exclude:
        return
    labels = _module_labels(model)

    def matches(pattern: str) -> bool:
        return any(fnmatch.fnmatchcase(label, pattern) for label in labels)

    some = ", ".join(labels[:6]) + (", ..." if len(labels) > 6 else "")
    inc_name = ENV_INCLUDE if include_from_env else "include"
    exc_name = ENV_EXCLUDE if exclude_from_env else "exclude"
    unmatched_inc = [p for p in config.include if not matches(p)]
    if config.include and len(unmatched_inc) == len(config.include):
        raise ConfigError(f"{inc_name}={list(config.include)!r} matches no module, so nothing would be "
                          f"watched; module paths are glob-matched, e.g. {some}")
    if not any((not config.include or any(fnmatch.fnmatchcase(label, p) for p in config.include))
               and not any(fnmatch.fnmatchcase(label, p) for p in config.exclude) for label in labels):
        raise ConfigError(f"{inc_name}={list(config.include)!r} with {exc_name}={list(config.exclude)!r} leaves no "
                          f"module, so nothing would be watched; module paths are glob-matched, e.g. {some}")
    unmatched = [(inc_name, p) for p in unmatched_inc] + [(exc_name, p) for p in config.exclude if not matches(p)]
    if unmatched:
        log.warning("tensorwatch_otel: %s match no module of %s (module paths: %s)",
                    ", ".join(f"{n} pattern {p!r}" for n, p in unmatched), type(model).__name__, some)


def _module_labels(model: torch.nn.Module) -> List[str]:
    """Module paths as include/exclude see them (core/frames/attach.py): the user's model inside
    DDP / torch.compile wrappers, wrapper segments dropped, the root as ``(root)``."""
    inner = naming.unwrap_root(model)
    out = ["(root)"]
    for path, module in inner.named_modules():
        if module is not inner and type(module).__name__ not in naming.INNER_WRAPPERS:
            out.append(naming.user_path(path))
    return out


def env_sinks() -> List[Sink]:
    """The sinks the environment configures (TENSORWATCH_*, OTEL_*)."""
    try:
        from .sinks.from_env import sinks_from_env
    except ImportError:  # exporters not installed in this build
        return []
    return list(sinks_from_env())
