"""A copy of a watched model is not watched: what the watcher's hooks on a module become when
the module is copied (copy.deepcopy: an EMA, AveragedModel) or pickled (torch.save).

torch copies a module's hook dicts with the module, so a hook would go on running for the copy
as if the copy were the original (its calls counted as the original's batches, its values
reported as the original's), and a hook holding the watcher cannot be pickled. Every hook the
watcher places on a module is a `ModuleHook`: copied or pickled, it becomes an `Unwatched`, a
no-op, and the copy is left without them as soon as the copy or the load is complete: a token
only the copy's memo (copy.deepcopy's, the unpickler's) holds takes every Unwatched off the
copy when that memo goes, so torch.jit.script, which compiles every hook a module holds, finds
none. Where a memo outlives the copy (one the caller passes), an Unwatched's first call takes
them off instead, and a deep copy is also told to the `Copies` of the watcher, whose detach()
takes them off copies never called."""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, TypeVar

import torch
from torch.utils.hooks import RemovableHandle


class Unwatched:
    """What a copy of a watched module holds in place of each of the watcher's hooks while it is
    being copied or loaded: nothing runs, and the copy's first call takes every Unwatched off it.
    An Unwatched given to another as `token` (with the copy, `module`) takes every Unwatched off
    that copy when it goes: it is made to live only in the copy's memo. Models saved whole while
    watched refer to this class by its name: it stays importable as
    `tensorwatch_otel.core.frames.copies.Unwatched`."""

    __slots__ = ("_copies",)

    def __init__(self, module: object = None, token: object = None) -> None:
        self._copies: Optional[List["weakref.ref[torch.nn.Module]"]] = None
        if isinstance(token, Unwatched) and isinstance(module, torch.nn.Module):
            token.take_off_later(module)

    def __call__(self, module: object, *_: object) -> None:
        # while dynamo traces a copy, its hook dicts are not ours to change
        if isinstance(module, torch.nn.Module) and not torch.compiler.is_compiling():
            take_off(module)

    def take_off_later(self, module: torch.nn.Module) -> None:
        """When this token goes, every Unwatched of `module` goes (if the module is still alive)."""
        if self._copies is None:
            self._copies = []
        self._copies.append(weakref.ref(module))

    def __del__(self) -> None:
        copies = self._copies
        if not copies:
            return
        for ref in copies:
            module = ref()
            if module is not None:
                try:
                    take_off(module)
                except Exception:  # a finalizer must not raise (the first call takes them off instead)
                    pass

    def __reduce__(self) -> Any:
        return (Unwatched, ())


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
# the key of a deep copy's token in its memo (the memo's own keys are ints: no clash)
_TOKEN = "tensorwatch_otel.copies"


class ModuleHook:
    """Base of the hooks placed on a module. `place(module, copies)` says which module it is
    placed on and who hears of a deep copy; copied with it, or pickled, it is an Unwatched, and
    the copy's Unwatched go when the copy or the load is complete (see Unwatched)."""

    __slots__ = ("_module", "_copies", "__weakref__")

    def __init__(self) -> None:
        self._module: Optional["weakref.ref[torch.nn.Module]"] = None
        self._copies: Optional[Copies] = None

    def place(self: _H, module: torch.nn.Module, copies: Optional[Copies]) -> _H:
        self._module = weakref.ref(module)  # (weak: the module holds this hook)
        self._copies = copies
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # each kind of hook defines its own
        raise NotImplementedError

    def _placed_on(self) -> Optional[torch.nn.Module]:
        return self._module() if self._module is not None else None

    def __reduce__(self) -> Any:
        # The module (pickled already: its hook dicts are part of it) and a token the unpickler's
        # memo alone holds: it goes when the load ends and takes the loaded copy's Unwatched off.
        module = self._placed_on()
        if module is None:
            return (Unwatched, ())
        return (Unwatched, (module, Unwatched()))

    def __deepcopy__(self, memo: Dict[Any, Any]) -> Unwatched:
        # copy.deepcopy makes a module's twin (memo[id(module)]) before it copies its hook dicts
        module = self._placed_on()
        twin = memo.get(id(module)) if module is not None else None
        if isinstance(twin, torch.nn.Module):
            if self._copies is not None:
                self._copies.add(twin)
            token = memo.get(_TOKEN)
            if not isinstance(token, Unwatched):
                token = memo[_TOKEN] = Unwatched()  # goes with the memo, when the copy is complete
            token.take_off_later(twin)
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
