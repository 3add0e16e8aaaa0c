"""Strings read from an event log made safe to print: a control character in them (an escape
sequence in a module name) is shown as its backslash escape, never sent to the terminal."""

from __future__ import annotations

import re
from typing import Any

from ..core.events import map_strings

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
    return map_strings(obj, printable)
