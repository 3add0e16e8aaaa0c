"""Names for what a module received and returned: `input[0]`, `input.mask`, `output.logits`,
`output[0][1]`. Names come from tables and caches so the hot path formats no strings."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Tuple

if TYPE_CHECKING:
    import torch

INPUT_NAMES = tuple(f"input[{i}]" for i in range(64))
OUTPUT_NAMES = tuple(f"output[{i}]" for i in range(64))
OUTPUT_NESTED = tuple(tuple(f"output[{i}][{j}]" for j in range(16)) for i in range(16))

_CHILD_CACHE_MAX = 100_000

#: How far a module call's values are looked into, wherever they are walked (a frame, a compiled
#: op's structure, the finite check of an output): values per container, containers deep.
MAX_ITEMS = 256
MAX_DEPTH = 6


# Path segments that wrappers add around the user's model: torch.compile's OptimizedModule,
# FSDP1, activation-checkpoint wrappers, DDP / DataParallel at the root.
WRAPPER_SEGMENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_offload_wrapped_module")
ROOT_WRAPPERS = ("DistributedDataParallel", "DataParallel", "OptimizedModule", "FullyShardedDataParallel")


def unwrap_root(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside the root wrappers (DDP, DataParallel, torch.compile, FSDP1)."""
    seen = 0
    while type(model).__name__ in ROOT_WRAPPERS and seen < 8:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None) \
            or getattr(model, "_fsdp_wrapped_module", None)
        if inner is None:
            break
        model, seen = inner, seen + 1
    return model


INNER_WRAPPERS = ("FullyShardedDataParallel", "CheckpointWrapper", "OffloadWrapper")


def user_path(path: str) -> str:
    """`path` (relative to the user's model) with wrapper segments dropped, so one model's
    single-GPU and multi-GPU runs share dashboards."""
    if not path or not any(seg in path for seg in WRAPPER_SEGMENTS):
        return path
    return ".".join(p for p in path.split(".") if p not in WRAPPER_SEGMENTS)


def input_name(i: int) -> str:
    return INPUT_NAMES[i] if i < 64 else f"input[{i}]"


def output_name(i: int) -> str:
    return OUTPUT_NAMES[i] if i < 64 else f"output[{i}]"


def output_nested(i: int, j: int) -> str:
    return OUTPUT_NESTED[i][j] if i < 16 and j < 16 else f"output[{i}][{j}]"


@functools.lru_cache(maxsize=_CHILD_CACHE_MAX)
def child(parent: str, key: object) -> str:
    """`parent[key]` for an int key, `parent.key` otherwise (cached)."""
    return f"{parent}[{key}]" if isinstance(key, int) else f"{parent}.{key}"


def dataclass_fields(obj: object) -> Tuple[str, ...]:
    """Field names of a dataclass instance (cached per type); () for anything else."""
    if isinstance(obj, type):
        return ()
    cls: Any = type(obj)  # (classes are hashable; typeshed does not say so of type[object])
    return _fields_of(cls)


@functools.lru_cache(maxsize=None)
def _fields_of(tp: Any) -> Tuple[str, ...]:  # a class
    return tuple(f.name for f in dataclasses.fields(tp)) if dataclasses.is_dataclass(tp) else ()


def module_class_name(module: object) -> str:
    """The class name users wrote: FSDP2's fully_shard() swaps a module's class for a generated
    `FSDP<Name>` subclass, which is skipped here (`FSDPLinear` reports as `Linear`)."""
    cls = type(module)
    if cls.__module__.startswith("torch.distributed.fsdp"):
        for base in cls.__mro__[1:]:
            if not base.__module__.startswith("torch.distributed.fsdp"):
                return base.__name__
    return cls.__name__
