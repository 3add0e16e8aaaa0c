"""Sink options, read like watch() options: argument, then TENSORWATCH_* variable (core/env.py's
parsers, the ones WatchConfig uses), then default; a bad value is a ConfigError (a ValueError)
naming the option or the variable and the valid range."""

from __future__ import annotations

import math
import os
from typing import Optional, Union

from ..core import env as _env

Number = Union[int, float]


def number_option(option: str, value, variable: Optional[str], default: Number, *, minimum: Number,
                  integer: bool = False) -> Number:
    """An integer (``integer=True``) or a finite float >= minimum."""
    if value is None:
        raw = _env.text(os.environ, variable) if variable else None
        if raw is None:
            return default
        if integer:
            return _env.parse_int(variable, raw, int(minimum))
        return _env.parse_float(variable, raw, float(minimum))
    if integer:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _env.ConfigError(f"{option}={value!r}: expected an integer >= {minimum}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum \
            or not math.isfinite(value):
        raise _env.ConfigError(f"{option}={value!r}: expected a finite number >= {minimum:g}")
    return float(value)
