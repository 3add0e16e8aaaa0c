"""Strings read from an event log made safe to print: a control character in them (an escape
sequence in a module name) is shown as its backslash escape, never sent to the terminal."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# C0 and C1 controls and DEL (escape sequences, bell, carriage return, newline), line and
# paragraph separators, the bidirectional overrides that reorder what a terminal shows, and
# lone surrogates (not text). Everything else, any script or emoji, is printed as it is.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: "re.Match[str]") -> str:
    c = m.group()
    named = _NAMED.get(c)
    if named is not None:
        return named
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def printable(text: str) -> str:
    """`text` with every control character written as its escape (ESC as the four characters
    ``\\x1b``, a newline as ``\\n``). A backslash stays itself: this is for reading, not parsing."""
    return _UNSAFE.sub(_escape, text)


def printable_event(obj: Any) -> Any:
    """An event (or frame, tensor statistic) with every string in it made printable, dictionary
    keys included; the same object when nothing needed escaping."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, tuple):
        items = tuple(printable_event(v) for v in obj)
        return obj if all(a is b for a, b in zip(items, obj)) else items
    if isinstance(obj, dict):
        pairs = [(printable_event(k), printable_event(v)) for k, v in obj.items()]
        return obj if all(k2 is k and v2 is v for (k2, v2), (k, v) in zip(pairs, obj.items())) else dict(pairs)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for f in dataclasses.fields(obj):
            if f.init:
                old = getattr(obj, f.name)
                new = printable_event(old)
                if new is not old:
                    changed[f.name] = new
        return dataclasses.replace(obj, **changed) if changed else obj
    return obj
