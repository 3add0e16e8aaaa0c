"""The sink port, as the sinks see it: defined in the core (core/ports.py), which never
imports a sink; and what every exporter needs of the names it writes: that they encode."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.ports import Sink, SinkFanout

__all__ = ["Sink", "SinkFanout", "utf8_text", "utf8_safe"]


def utf8_text(text: str) -> str:
    """`text`, with what UTF-8 cannot encode (a lone surrogate, from a module added as
    ``add_module('\\ud800', ...)`` or a dict key) written as its backslash escape (the six
    characters ``\\ud800``): one unencodable label must not fail a whole scrape or export."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def utf8_safe(obj: Any) -> Any:
    """`obj` (an event, a frame, a tuple of them) with every string through utf8_text; the same
    object when nothing needed it, so the common case allocates nothing."""
    if isinstance(obj, str):
        return utf8_text(obj)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        items = [utf8_safe(x) for x in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else tuple(items)
    if isinstance(obj, list):
        items = [utf8_safe(x) for x in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else items
    if isinstance(obj, dict):
        pairs = [(utf8_safe(k), utf8_safe(v)) for k, v in obj.items()]
        return obj if all(a is k and b is v for (a, b), (k, v) in zip(pairs, obj.items())) else dict(pairs)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for f in dataclasses.fields(obj):
            if f.init:
                v = getattr(obj, f.name)
                nv = utf8_safe(v)
                if nv is not v:
                    changed[f.name] = nv
        return dataclasses.replace(obj, **changed) if changed else obj
    return obj
