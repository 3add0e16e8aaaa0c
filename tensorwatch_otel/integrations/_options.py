"""What the framework integrations share: watch() options checked when a callback is built,
so a wrong option fails at construction rather than at train begin."""

from __future__ import annotations

import inspect
from typing import Any, Dict

from .._watch import watch
from ..core.config import WatchConfig

_WATCH_PARAMS = tuple(inspect.signature(watch).parameters)[1:]  # all but `model`
_CONFIG_PARAMS = frozenset(inspect.signature(WatchConfig.build).parameters)


def check_watch_options(owner: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """Fail early, when the callback is built, on an option watch() does not take or a value it
    rejects (the same ConfigError naming the option that watch() would raise at train begin)."""
    unknown = sorted(set(options) - set(_WATCH_PARAMS))
    if unknown:
        raise TypeError(f"{owner}: unknown watch() option(s) {', '.join(unknown)}; "
                        f"valid: {', '.join(_WATCH_PARAMS)}")
    WatchConfig.build(**{k: v for k, v in options.items() if k in _CONFIG_PARAMS})
    return dict(options)

