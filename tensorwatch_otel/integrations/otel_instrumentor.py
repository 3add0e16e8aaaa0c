"""Zero code: an OpenTelemetry instrumentor, so `opentelemetry-instrument python train.py` watches
every transformers and Lightning Trainer's model through the application's OpenTelemetry providers.

Declared as entry point `tensorwatch_otel` in the `opentelemetry_instrumentor` group; turned off by
`OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=tensorwatch_otel`. The frameworks are patched when the
application imports them (post-import hooks), never imported here.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from typing import Any, Callable, Collection, List, Optional

import wrapt
from opentelemetry.instrumentation.dependencies import DependencyConflict, get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import unwrap

from ..core.config import ConfigError, WatchConfig
from ..core.ports import Sink

__all__ = ["TensorwatchInstrumentor"]

log = logging.getLogger(__name__)

# Any one of them is enough (the others are then simply never patched).
_INSTRUMENTS_ANY = ("transformers >= 4.40", "lightning >= 2.0", "pytorch-lightning >= 2.0")

# The modules that define the Trainers whose __init__ gets a callback added.
_TARGETS = {"transformers.trainer": "transformers", "lightning.pytorch.trainer.trainer": "lightning",
            "pytorch_lightning.trainer.trainer": "pytorch_lightning"}
_HOOKED: set = set()  # post-import hooks are registered once per process (wrapt cannot remove them)
_PROXY = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)  # what wrap_function_wrapper leaves


class TensorwatchInstrumentor(BaseInstrumentor):
    """Adds a TensorwatchCallback to every `transformers.Trainer`, `lightning.pytorch.Trainer` and
    `pytorch_lightning.Trainer` built while instrumented, its options from the TENSORWATCH_*
    variables. Their watchers share one set of sinks, made at the first Trainer: the text report
    and what `watch(sinks=None)` adds (Prometheus, JSON lines, OpenTelemetry through the
    application's providers, e.g. those the distro set up), or OpenTelemetry through
    `tracer_provider`/`meter_provider` when instrument() is given them."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()  # any one of _INSTRUMENTS_ANY, checked below

    def _check_dependency_conflicts(self) -> Optional[DependencyConflict]:
        conflicts = [get_dependency_conflicts([dep]) for dep in _INSTRUMENTS_ANY]
        return None if any(c is None for c in conflicts) else conflicts[0]

    def _instrument(self, **kwargs: Any) -> None:
        self._active = False
        try:
            WatchConfig.build()  # every option from its TENSORWATCH_* variable: fail now, naming it
        except ConfigError as exc:
            log.error("tensorwatch_otel: not instrumenting: %s", exc)
            return
        self._tracer_provider = kwargs.get("tracer_provider")
        self._meter_provider = kwargs.get("meter_provider")
        self._sinks: Optional[List[Sink]] = None
        self._lock = threading.Lock()
        self._callbacks: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._active = True
        for name in _TARGETS:
            if name in sys.modules:
                _patch(sys.modules[name])
            elif name not in _HOOKED:
                _HOOKED.add(name)
                wrapt.register_post_import_hook(_patch, name)

    def _uninstrument(self, **kwargs: Any) -> None:
        if not getattr(self, "_active", False):
            return
        self._active = False
        for name in _TARGETS:
            module = sys.modules.get(name)
            if module is not None:
                unwrap(module.Trainer, "__init__")
        for cb in list(self._callbacks):
            cb.detach()
        sinks, self._sinks = self._sinks, None
        for s in sinks or ():
            try:
                s.close()
            except Exception as exc:  # closing must not raise into user code
                log.warning("tensorwatch_otel: closing %s failed: %s", type(s).__name__, exc)

    # -- what the patched Trainer.__init__ calls ---------------------------------------------
    def _callback_for(self, framework: str, existing: List[Any]) -> Optional[Any]:
        """A new callback for a Trainer being built, or None (not active, or the user added one)."""
        if not self._active:
            return None
        if framework == "transformers":
            from .transformers import TensorwatchCallback
        elif framework == "lightning":
            from .lightning import TensorwatchCallback
        else:
            from .pytorch_lightning import TensorwatchCallback
        if any(isinstance(cb, TensorwatchCallback) for cb in existing):
            return None  # the user's own callback and options win
        cb = TensorwatchCallback(sinks=self._shared_sinks())  # options: TENSORWATCH_* (watch() reads them)
        self._callbacks.add(cb)
        return cb

    def _shared_sinks(self) -> List[Sink]:
        """One set of sinks for the process (a Prometheus port is bound once), made at the first
        Trainer; a sink that cannot be made is logged and left out."""
        with self._lock:
            if self._sinks is None:
                self._sinks = _make_sinks(self._tracer_provider, self._meter_provider)
                atexit.register(_flush_at_exit, self._sinks)
            return self._sinks


def _make_sinks(tracer_provider: Any, meter_provider: Any) -> List[Sink]:
    """The text report plus what watch(sinks=None) adds from the environment: Prometheus, JSON
    lines, and OpenTelemetry through the application's providers (else OTLP from OTEL_*). When
    instrument() was given providers, OpenTelemetry goes through those instead."""
    from ..sinks.text import TextReport

    sinks: List[Sink] = [TextReport()]
    try:
        if tracer_provider is None and meter_provider is None:
            from ..sinks.from_env import sinks_from_env

            sinks += sinks_from_env()
        else:
            from ..sinks.otel import OtelTelemetry

            sinks += _file_and_prometheus_sinks() + [OtelTelemetry(tracer_provider, meter_provider)]
    except Exception as exc:  # a sink we cannot make must not stop the Trainer
        log.error("tensorwatch_otel: sinks from the environment not made: %s: %s", type(exc).__name__, exc)
    return sinks


def _file_and_prometheus_sinks() -> List[Sink]:
    from ..core.env import ENV_JSONL, ENV_PROMETHEUS_ADDR, text
    from ..sinks.from_env import prometheus_port

    sinks: List[Sink] = []
    port = prometheus_port()
    if port is not None:
        from ..sinks.prometheus import PrometheusMetrics

        sinks.append(PrometheusMetrics(port=port, addr=text(os.environ, ENV_PROMETHEUS_ADDR) or "127.0.0.1"))
    path = text(os.environ, ENV_JSONL)
    if path:
        from ..sinks.jsonl import JsonlLog

        sinks.append(JsonlLog(path))
    return sinks


def _flush_at_exit(sinks: List[Sink]) -> None:
    for s in sinks:
        try:
            s.flush(2.0)
        except Exception:  # the process is ending; nothing to tell
            pass


# -- patches -------------------------------------------------------------------------------------
def _patch(module) -> None:
    """Wrap `module.Trainer.__init__` (a post-import hook; the package may be mid-import, so the
    integration module is imported only when a Trainer is built)."""
    trainer_cls = getattr(module, "Trainer", None)
    if trainer_cls is None or isinstance(trainer_cls.__dict__.get("__init__"), _PROXY) \
            or not getattr(TensorwatchInstrumentor(), "_active", False):
        return
    wrapt.wrap_function_wrapper(trainer_cls, "__init__", _INIT_WRAPPERS[_TARGETS[module.__name__]])


def _guarded(add: Callable[[Any], None]) -> Callable:
    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            add(instance)
        except Exception as exc:  # watching must never stop a Trainer from being built
            log.error("tensorwatch_otel: not watching this Trainer: %s: %s", type(exc).__name__, exc)
        return result
    return wrapper


def _add_transformers(trainer) -> None:
    cb = TensorwatchInstrumentor()._callback_for("transformers", trainer.callback_handler.callbacks)
    if cb is not None:
        from .transformers import guard_train

        trainer.add_callback(cb)
        guard_train(trainer)  # detached when train() raises, from the first train() on


def _add_lightning(framework: str) -> Callable[[Any], None]:
    def add(trainer) -> None:
        cb = TensorwatchInstrumentor()._callback_for(framework, trainer.callbacks)
        if cb is not None:
            trainer.callbacks.append(cb)
    return add


_INIT_WRAPPERS = {"transformers": _guarded(_add_transformers),
                  "lightning": _guarded(_add_lightning("lightning")),
                  "pytorch_lightning": _guarded(_add_lightning("pytorch_lightning"))}
