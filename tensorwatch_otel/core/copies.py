"""A copy of a watched model is not watched: what the watcher's hooks on a module become when
the module is copied (copy.deepcopy: an EMA, AveragedModel) or pickled (torch.save).

torch copies a module's hook dicts with the module, so a hook would go on running for the copy
as if the copy were the original (its calls counted as the original's batches, its values
reported as the original's), and a hook holding the watcher cannot be pickled. Every hook the
watcher places on a module is a `ModuleHook`: copied or pickled, it becomes an `Unwatched`, a
no-op whose first call takes every Unwatched off the copy (which then runs without hooks). A
deep copy is also told to the `Copies` of the watcher, whose detach() takes them off copies
never called."""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, TypeVar

import torch
from torch.utils.hooks import RemovableHandle


class Unwatched:
    """What a copy of a watched module holds in place of each of the watcher's hooks: nothing
    runs, and the copy's first call takes every Unwatched off it. Models saved whole while
    watched refer to this class by its name: it stays importable as
    `tensorwatch_otel.core.copies.Unwatched`."""

    __slots__ = ()

    def __call__(self, module: object, *_: object) -> None:
        # while dynamo traces a copy, its hook dicts are not ours to change
        if isinstance(module, torch.nn.Module) and not torch.compiler.is_compiling():
            take_off(module)


def take_off(module: torch.nn.Module) -> None:
    """Every Unwatched of `module`'s forward hook dicts removed, with their flags (torch's own
    RemovableHandle removes an entry from the hook dict and the flag dicts beside it)."""
    for hooks, flags in (("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
                         ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"))):
        d = getattr(module, hooks, None)
        if not d:
            continue
        extra = [f for f in (getattr(module, name, None) for name in flags) if f is not None]
        for key in [k for k, h in d.items() if type(h) is Unwatched]:
            handle = RemovableHandle(d, extra_dict=extra)
            handle.id = key
            handle.remove()


class Copies:
    """The deep copies of a watcher's modules (told by their hooks as they are copied), held
    weakly: `take_off()` leaves none of them an Unwatched."""

    def __init__(self) -> None:
        self._modules: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

    def add(self, module: torch.nn.Module) -> None:
        self._modules.add(module)

    def take_off(self) -> None:
        modules = list(self._modules)
        self._modules.clear()
        for m in modules:
            take_off(m)


_H = TypeVar("_H", bound="ModuleHook")


class ModuleHook:
    """Base of the hooks placed on a module. `place(module, copies)` says which module it is
    placed on and who hears of a deep copy; copied with it, or pickled, it is an Unwatched."""

    __slots__ = ("_module_id", "_copies", "__weakref__")

    def __init__(self) -> None:
        self._module_id = 0
        self._copies: Optional[Copies] = None

    def place(self: _H, module: torch.nn.Module, copies: Optional[Copies]) -> _H:
        self._module_id = id(module)
        self._copies = copies
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # each kind of hook defines its own
        raise NotImplementedError

    def __reduce__(self) -> Any:
        return (Unwatched, ())

    def __deepcopy__(self, memo: Dict[int, Any]) -> Unwatched:
        # copy.deepcopy makes a module's twin (memo[id(module)]) before it copies its hook dicts
        twin = memo.get(self._module_id)
        if isinstance(twin, torch.nn.Module) and self._copies is not None:
            self._copies.add(twin)
        return Unwatched()


class Hook(ModuleHook):
    """A ModuleHook that calls `fn` (a hook run once per call of the root, or only while some
    batches are traced: one call more is nothing there)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self._fn = fn

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)
