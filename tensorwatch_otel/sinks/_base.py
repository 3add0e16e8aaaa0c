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


def _all_ascii(obj: Any) -> bool:
    """Quick look (names are nearly always ASCII): the strings of an event and of its frames."""
    for v in getattr(obj, "__dict__", {}).values():
        if isinstance(v, str):
            if not v.isascii():
                return False
        elif isinstance(v, tuple) and v and hasattr(v[0], "tensors"):  # frames
            for fr in v:
                if not (fr.module.isascii() and fr.module_class.isascii()
                        and all(t.name.isascii() for t in fr.tensors)):
                    return False
        elif isinstance(v, (tuple, list, dict)) and v:
            return False  # anything else: let the full pass decide
    return True


def utf8_safe(obj: Any) -> Any:
    """`obj` (an event, a frame, a tuple of them) with every string through utf8_text; the same
    object when nothing needed it, so the common case allocates nothing."""
    if _all_ascii(obj) and not isinstance(obj, (str, tuple, list, dict)):
        return obj
    return _rebuild(obj)


def _rebuild(obj: Any) -> Any:
    if isinstance(obj, str):
        return utf8_text(obj)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        items = [_rebuild(x) for x in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else tuple(items)
    if isinstance(obj, list):
        items = [_rebuild(x) for x in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else items
    if isinstance(obj, dict):
        pairs = [(_rebuild(k), _rebuild(v)) for k, v in obj.items()]
        return obj if all(a is k and b is v for (a, b), (k, v) in zip(pairs, obj.items())) else dict(pairs)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for f in dataclasses.fields(obj):
            if f.init:
                v = getattr(obj, f.name)
                nv = _rebuild(v)
                if nv is not v:
                    changed[f.name] = nv
        return dataclasses.replace(obj, **changed) if changed else obj
    return obj
