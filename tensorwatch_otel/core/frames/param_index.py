"""The model's parameters and submodules as last seen, and which watched module owns each
parameter (the ParamIndex): written by the HookSet's rescan (core/frames/attach.py), read by the step
guard, the step tracker and the optimizer-state reader."""

from __future__ import annotations

import array
import weakref
from itertools import chain
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from ..frame_draft import ModuleInfo
from ..measure.cpu_kernel import KERNEL

# (module._parameters or module._modules, key, what it held)
SlotEntry = Tuple[Dict[str, Any], str, Callable[[], object]]


class ParamIndex:
    """The model's parameters and submodules as last seen, and which watched module owns each
    parameter. Read by the step guard, the step tracker and the optimizer-state reader; written
    by `rescan` through `replace`. Parameters are held by weak reference (a replaced one is freed
    as usual); an id is trusted only while its parameter is alive, so a new tensor born at a
    freed one's address is never taken for it."""

    def __init__(self) -> None:
        self.owners: Dict[int, Tuple[ModuleInfo, str]] = {}  # id(param) -> (watched module, name)
        self.generation = 0  # bumped when what the model holds changed
        self.scans = 0
        # id(param) -> the parameter, for every parameter of the model
        self._refs: Dict[int, "weakref.ref[torch.Tensor]"] = {}
        # (module._parameters or module._modules, key, what it held): compared at each check
        self._slots: List[SlotEntry] = []
        # see current(): the dicts, their keys, the ids of what they hold (a list, and as uint64s)
        self._fast: Optional[Tuple[List[Dict[str, Any]], List[str], List[int], "array.array[int]"]] = None
        self._died = False
        self._keep_cbs: List["weakref.ref[Any]"] = []

    def current(self) -> bool:
        """True when every module still holds the parameters and submodules last seen (an
        identity compare per parameter and submodule, run in C: the ids of what the dicts hold
        against those last seen, exact while every object last seen is alive, which a weakref
        callback tells), or holds plain tensors lent for one call in their place
        (`torch.func.functional_call`). Where the CPU kernel is loaded its `same_entries` walks
        the dicts in C, making no int per entry (a tenth of the time at 5,000 modules:
        docs/performance.md)."""
        if not self._died and self._fast is not None:
            dicts, keys, ids, id_words = self._fast
            same = getattr(KERNEL.loaded(), "same_entries", None)
            if same is not None:
                try:
                    if same(dicts, keys, id_words):
                        return True
                except Exception:  # (never expected: it takes these lists and words) the compare below decides
                    pass
            elif list(chain.from_iterable(dicts)) == keys and \
                    list(map(id, chain.from_iterable(map(dict.values, dicts)))) == ids:
                return True
        for d, k, ref in self._slots:
            if d.get(k) is not ref():
                return self._only_lent()
        return True

    def _died_cb(self, _ref: "weakref.ref[Any]") -> None:
        self._died = True  # an object last seen is gone: its id may be reused, compare slowly

    def _fast_check(self, slots: List[SlotEntry]) -> None:
        """The dicts of `slots` (each whole, in order), their keys and the ids of what they hold,
        for current()'s C-speed compare; weakref callbacks set _died when one of them is freed."""
        self._died = False
        self._keep_cbs = []
        dicts: List[Dict[str, Any]] = []
        seen: Set[int] = set()
        for d, _, _ in slots:
            if id(d) not in seen:
                seen.add(id(d))
                dicts.append(d)
        if sum(len(d) for d in dicts) != len(slots):
            self._fast = None  # (never expected: slots are every entry of these dicts)
            return
        cb = self._died_cb
        for d in dicts:
            for v in d.values():
                if v is not None:
                    try:
                        self._keep_cbs.append(weakref.ref(v, cb))
                    except TypeError:  # cannot be weakly referenced: compare slowly
                        self._fast = None
                        return
        ids = list(map(id, chain.from_iterable(map(dict.values, dicts))))
        self._fast = (dicts, list(chain.from_iterable(dicts)), ids, array.array("Q", ids))  # (ids are unsigned)

    def _only_lent(self) -> bool:
        for d, k, ref in self._slots:
            v = d.get(k)
            if v is not ref() and (v is None or isinstance(v, (torch.nn.Parameter, torch.nn.Module))):
                return False
        return True

    def owner(self, p: torch.Tensor) -> Optional[Tuple[ModuleInfo, str]]:
        """The watched module and name of parameter `p`, or None."""
        pid = id(p)
        ref = self._refs.get(pid)
        if ref is None or ref() is not p:
            return None
        return self.owners.get(pid)

    def holds(self, p: torch.Tensor) -> bool:
        """`p` is a parameter of the model."""
        ref = self._refs.get(id(p))
        return ref is not None and ref() is p

    def replace(self, owners: Dict[int, Tuple[ModuleInfo, str]], params: List[torch.Tensor],
                slots: List[SlotEntry]) -> bool:
        """What the model holds now; True when its parameters differ from the last seen."""
        refs = {id(p): weakref.ref(p) for p in params}
        changed = refs.keys() != self._refs.keys() or any(r() is not refs[i]() for i, r in self._refs.items()) \
            or owners != self.owners
        self.scans += 1
        self._refs = refs
        self._slots = slots
        self._fast_check(slots)
        self.owners.clear()
        self.owners.update(owners)  # one dict for every reader
        if changed:
            self.generation += 1
        return changed
