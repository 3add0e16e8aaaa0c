"""The structure of a hooked call around its tensors, as the compiled front end carries it
through a graph (core/frames/compiled.py): at trace time a spec string written from the call's
args, kwargs and output (a constant of the graph, its tensors passed to the op beside it); at run
time the same structure rebuilt around the graph's real tensors, each a fresh alias."""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, List, Tuple

import torch

from ..naming import MAX_DEPTH, MAX_ITEMS


class _Other:
    """Stands, at run time, for a value that is not a tensor, None or a container (noted as such)."""

    __slots__ = ()


OTHER = _Other()


# ------------------------------------------------------------------------------ trace-time side
def spec_of(v: object, tensors: List[torch.Tensor], depth: int) -> str:
    """The structure of `v` as a string; its tensors appended to `tensors` in walk order. Kept
    to what dynamo folds into constants: isinstance, string concatenation, len."""
    if isinstance(v, torch.Tensor):
        tensors.append(v)
        return "T"
    if v is None:
        return "N"
    if depth >= MAX_DEPTH:
        return "X"
    if isinstance(v, (tuple, list)):
        s = "("
        for x in v[:MAX_ITEMS]:
            s = s + spec_of(x, tensors, depth + 1)
        return s + ")"
    if isinstance(v, dict):
        s = "{"
        n = 0
        for k, x in v.items():
            if n >= MAX_ITEMS:
                break
            n += 1
            key = k if isinstance(k, str) else str(k)
            s = s + str(len(key)) + ":" + key + spec_of(x, tensors, depth + 1)
        return s + "}"
    return "X"


# ------------------------------------------------------------------------------ run-time side
# One parsed value: ("T",), ("N",), ("X",), ("(", [node, ...]) or ("{", [(key, node), ...]).
_Node = Tuple[Any, ...]


def rebuild(spec: str, tensors: List[torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any], object]:
    """(args, kwargs, output) of the hooked call, the real tensors in place as fresh aliases."""
    parsed = parsed_spec(spec)
    it = iter(_fresh(tensors))
    args, kwargs, output = (_fill(p, it) for p in parsed)
    return args, kwargs, output


@functools.lru_cache(maxsize=4096)
def parsed_spec(spec: str) -> Tuple[_Node, ...]:
    """`spec`'s parsed form (one spec per call site)."""
    return _parse(spec, 0)[0]


def _fresh(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """A new alias (same storage, same values) of each distinct tensor of one op call.

    Inductor reuses a buffer whose value is dead for a later value, keeping the Python tensor
    object and writing it from its kernels without moving `_version`: the graph's tensor of one
    module call can be the very object, at the very version, of an earlier call's different
    value. The recorder's caches know a tensor by identity and version, so handed the graph's
    own objects they would serve the earlier value's statistics. An alias lives for one op call
    only: a tensor seen twice in one call (a module returning its input) is still measured once,
    and nothing is carried from one call to the next."""
    out: List[torch.Tensor] = []
    seen: Dict[int, torch.Tensor] = {}
    for t in tensors:
        a = seen.get(id(t))
        if a is None:
            a = seen[id(t)] = t.detach()
        out.append(a)
    return out


def _parse(spec: str, i: int) -> Tuple[Tuple[_Node, ...], int]:
    """Parses the three values at spec[i:]: ("T",), ("N",), ("X",), ("(", items), ("{", [(k, v)])."""
    out: List[_Node] = []
    for _ in range(3):
        v, i = _parse_one(spec, i)
        out.append(v)
    return tuple(out), i


def _parse_one(spec: str, i: int) -> Tuple[_Node, int]:
    c = spec[i]
    if c in "TNX":
        return (c,), i + 1
    if c == "(":
        i += 1
        items: List[_Node] = []
        while spec[i] != ")":
            v, i = _parse_one(spec, i)
            items.append(v)
        return ("(", items), i + 1
    if c == "{":
        i += 1
        pairs: List[Tuple[str, _Node]] = []
        while spec[i] != "}":
            colon = spec.index(":", i)
            n = int(spec[i:colon])
            key = spec[colon + 1:colon + 1 + n]
            v, i = _parse_one(spec, colon + 1 + n)
            pairs.append((key, v))
        return ("{", pairs), i + 1
    raise ValueError(f"tensorwatch_otel: bad traced structure at {i}: {spec!r}")


def _fill(p: _Node, it: Iterator[torch.Tensor]) -> Any:  # a tensor, None, OTHER, tuple or dict
    c = p[0]
    if c == "T":
        return next(it)
    if c == "N":
        return None
    if c == "X":
        return OTHER
    if c == "(":
        return tuple(_fill(x, it) for x in p[1])
    return {k: _fill(x, it) for k, x in p[1]}
