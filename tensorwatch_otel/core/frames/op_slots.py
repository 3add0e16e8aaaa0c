"""Which hooks an op call site of a compiled graph runs: a slot number per hooked module of a
watcher (core/frames/attach.py takes one per module), a constant of the graphs that trace it. The
slots are the process's (graphs outlive any one watcher): a number names its module for good, so
a graph traced for a watcher since detached reaches the new watcher of the same module. Hooks
and watchers are held weakly."""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch

if TYPE_CHECKING:
    from typing import Protocol

    class SlotOwner(Protocol):
        """What the ops read of a watcher (core/watcher.py's Watcher)."""

        @property
        def attached(self) -> bool: ...

# The watcher's eager hooks, as the ops call them: the module is None once it was freed.
EagerPreHook = Callable[[Optional[torch.nn.Module], Tuple[Any, ...]], object]
EagerPostHook = Callable[[Optional[torch.nn.Module], Tuple[Any, ...], Dict[str, Any], Any], object]
_F = TypeVar("_F", bound=Callable[..., object])


def _nothing() -> None:
    return None


def _weak(fn: Optional[_F]) -> Callable[[], Optional[_F]]:
    """A weak reference to a hook (held by its module while registered): the global slot table
    must not keep a watcher, its model and its sinks alive."""
    if fn is None:
        return _nothing
    return weakref.WeakMethod(fn) if hasattr(fn, "__self__") else weakref.ref(fn)


class Slot:
    """What one op call site runs: the watcher's eager pre-hook and hook for one module, each
    held weakly (`s.pre()` is the pre-hook, or None once it is gone)."""

    __slots__ = ("watcher", "module", "pre", "post")

    def __init__(self, watcher: SlotOwner, module: torch.nn.Module, pre: EagerPreHook, post: Optional[EagerPostHook]):
        self.watcher = weakref.ref(watcher)
        self.module = weakref.ref(module)
        self.pre = _weak(pre)
        self.post = _weak(post)


class SlotTable:
    """Slot number -> its Slot, for every watcher of the process. A number taken by a graph
    stays meaningful after its slot is released: it still names its module, so a graph traced
    for a watcher since detached, and reused for a new watcher of the same module, reaches the
    new watcher's slot."""

    def __init__(self) -> None:
        self._slots: Dict[int, Slot] = {}
        self._module_of: Dict[int, "weakref.ref[torch.nn.Module]"] = {}
        self._by_module: "weakref.WeakKeyDictionary[torch.nn.Module, List[int]]" = weakref.WeakKeyDictionary()
        self._ids = itertools.count(1)

    def new(self, watcher: SlotOwner, module: torch.nn.Module, pre: EagerPreHook, post: Optional[EagerPostHook]) -> int:
        slot = next(self._ids)
        if slot % 1024 == 0:
            self._forget_freed()
        self._slots[slot] = Slot(watcher, module, pre, post)
        self._module_of[slot] = weakref.ref(module)
        self._by_module.setdefault(module, []).append(slot)
        return slot

    def _forget_freed(self) -> None:
        """Drops the slots of modules freed since (a model dropped without detach(): its slots
        would keep its watcher and sinks alive)."""
        for k in [k for k, ref in self._module_of.items() if ref() is None]:
            del self._module_of[k]
            self._slots.pop(k, None)

    def release(self, slot: int) -> None:
        s = self._slots.pop(slot, None)
        if s is not None:
            m = s.module()
            live = self._by_module.get(m) if m is not None else None
            if live is not None and slot in live:
                live.remove(slot)

    def set_post(self, slot: int, post: EagerPostHook) -> None:
        self._slots[slot].post = _weak(post)

    def of_watcher(self, watcher: object) -> List[Slot]:
        """The live slots whose hooks are `watcher`'s (benchmarks time them)."""
        return [s for s in self._slots.values() if s.watcher() is watcher]

    def live(self, slot: int) -> List[Slot]:
        """The slots an op of number `slot` runs: its own, or, released, its module's live ones."""
        s = self._slots.get(slot)
        if s is not None:
            return [s]
        ref = self._module_of.get(slot)
        m = ref() if ref is not None else None
        if m is None:
            return []
        return [self._slots[i] for i in self._by_module.get(m, ()) if i in self._slots]


SLOTS = SlotTable()


class SlotHandle:
    """Releases a slot when the watcher removes its hooks (a RemovableHandle's shape)."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def remove(self) -> None:
        SLOTS.release(self.slot)


def new_slot(watcher: SlotOwner, module: torch.nn.Module, pre: EagerPreHook,
             post: Optional[EagerPostHook] = None) -> int:
    return SLOTS.new(watcher, module, pre, post)


def set_post(slot: int, post: EagerPostHook) -> None:
    SLOTS.set_post(slot, post)
