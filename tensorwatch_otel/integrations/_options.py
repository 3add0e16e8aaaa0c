"""What the framework integrations share: watch() options checked when a callback is built,
so a wrong option fails at construction rather than at train begin."""

from __future__ import annotations

import inspect
from typing import Any, Dict

from .._watch import watch
from ..core.config import WatchConfig, check_keywords

_WATCH_PARAMS = tuple(n for n, p in inspect.signature(watch).parameters.items()
                      if p.kind is p.KEYWORD_ONLY)  # all but `model` (and no **unknown)
_CONFIG_PARAMS = frozenset(inspect.signature(WatchConfig.build).parameters)


def check_watch_options(owner: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """Fail early, when the callback is built, on an option watch() does not take or a value it
    rejects (the same ConfigError naming the option that watch() would raise at train begin)."""
    check_keywords(owner, options, _WATCH_PARAMS)
    WatchConfig.build(**{k: v for k, v in options.items() if k in _CONFIG_PARAMS})
    return dict(options)

