"""Where the watcher's hooks go: a forward pre-hook and hook on every included module of the
user's model (whatever wraps it: DDP, torch.compile, FSDP), parameter-gradient hooks with
`gradients=True`, the batch-capture hook on the root, and the global optimizer step hooks (with
the step guard that checks the step's gradients when `gradients=True` is off).
Paths are the user's model's; a compiled model's modules are read through its root.

Parameters and submodules replaced after watch() (`to_empty()` from the meta device,
`load_state_dict(assign=True)`, FSDP2's `fully_shard`, `model.head = nn.Linear(...)`) are found
again: the ParamIndex remembers what each module held, a cheap identity check at each outermost
call and each optimizer step sees a change, and `rescan` moves the owners, the gradient hooks
and the forward hooks to what the model holds now."""

from __future__ import annotations

import fnmatch
import logging
import weakref
from itertools import chain
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set, Tuple

import torch

from . import compiled, naming
from .config import WatchConfig
from .optim_state import OptimizerStateReader
from .record import ModuleInfo
from .steps import StepGuard, StepTracker

if TYPE_CHECKING:  # pragma: no cover
    from .watcher import Watcher

log = logging.getLogger(__name__)

_SAY_NEW_MODULES = 8  # swapped-in module paths named in the log line


def _NONE() -> None:  # the slot of a parameter or submodule registered as None
    return None


def _included(cfg: WatchConfig, path: str) -> bool:
    label = path or "(root)"
    if cfg.include and not any(fnmatch.fnmatchcase(label, p) for p in cfg.include):
        return False
    return not any(fnmatch.fnmatchcase(label, p) for p in cfg.exclude)


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
        self._refs: Dict[int, weakref.ref] = {}  # id(param) -> the parameter, for every parameter of the model
        # (module._parameters or module._modules, key, what it held): compared at each check
        self._slots: List[Tuple[dict, str, Callable[[], object]]] = []
        self._fast: Optional[Tuple[List[dict], List[str], List[int]]] = None  # see current()
        self._died = False
        self._keep_cbs: List[weakref.ref] = []

    def current(self) -> bool:
        """True when every module still holds the parameters and submodules last seen (an
        identity compare per parameter and submodule, run in C: the ids of what the dicts hold
        against those last seen, exact while every object last seen is alive, which a weakref
        callback tells), or holds plain tensors lent for one call in their place
        (`torch.func.functional_call`)."""
        if not self._died and self._fast is not None:
            dicts, keys, ids = self._fast
            if list(chain.from_iterable(dicts)) == keys and \
                    list(map(id, chain.from_iterable(map(dict.values, dicts)))) == ids:
                return True
        for d, k, ref in self._slots:
            if d.get(k) is not ref():
                return self._only_lent()
        return True

    def _died_cb(self, _ref) -> None:
        self._died = True  # an object last seen is gone: its id may be reused, compare slowly

    def _fast_check(self, slots: List[Tuple[dict, str, Callable[[], object]]]) -> None:
        """The dicts of `slots` (each whole, in order), their keys and the ids of what they hold,
        for current()'s C-speed compare; weakref callbacks set _died when one of them is freed."""
        self._died = False
        self._keep_cbs = []
        dicts: List[dict] = []
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
        self._fast = (dicts, list(chain.from_iterable(dicts)),
                      list(map(id, chain.from_iterable(map(dict.values, dicts)))))

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
                slots: List[Tuple[dict, str, Callable[[], object]]]) -> bool:
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


class _Hooked:
    """A module with hooks, their handles, and its frame info."""

    __slots__ = ("info", "handles")

    def __init__(self, info: ModuleInfo):
        self.info = info
        self.handles: list = []


def place_hooks(w: "Watcher") -> None:
    cfg = w.config
    inner = naming.unwrap_root(w.model)
    if inner is not w.model:
        w._compiled = any(type(m).__name__ == "OptimizedModule" for m in w.model.modules())
    compiled.hook_guards()  # before any graph sees the hooks
    w._index = ParamIndex()
    w._hooked = weakref.WeakKeyDictionary()
    w._param_hooks = {}
    rescan(w, first=True)
    # gradients=True localizes bad gradients in the backward: the step guard would add nothing
    w._steps.use(StepGuard(w._index) if cfg.guard_steps and not cfg.gradients else None,
                 OptimizerStateReader(w._index) if cfg.optimizer_state else None)
    w._step_hooks = StepTracker(w._index, w._params_current, w._steps.before_step, w._steps.after_step)
    w._handles.extend(w._step_hooks.handles)


def rescan(w: "Watcher", first: bool = False) -> None:
    """Walk the model as it is now: hooks on modules not hooked yet (all of them at watch()),
    gradient hooks moved to the parameters the modules hold now, hooks of modules no longer in
    the model removed, and the ParamIndex told."""
    cfg = w.config
    root = w.model
    inner = naming.unwrap_root(root)
    wrapped = inner is not root
    prefix = next((p for p, m in root.named_modules() if m is inner), "") if wrapped else ""
    hooked: "weakref.WeakKeyDictionary[torch.nn.Module, _Hooked]" = w._hooked
    old_param_hooks: Dict[int, tuple] = w._param_hooks
    param_hooks: Dict[int, tuple] = {}
    owners: Dict[int, Tuple[ModuleInfo, str]] = {}
    params: List[torch.Tensor] = []
    slots: List[Tuple[dict, str, Callable[[], object]]] = []
    weight_infos: List[Tuple[ModuleInfo, torch.nn.Module]] = []
    found: Set[int] = set()
    new_paths: List[str] = []
    seen = set()
    for path, module in root.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        for k, p in module._parameters.items():
            if p is not None:
                params.append(p)
            slots.append((module._parameters, k, _NONE if p is None else weakref.ref(p)))
        for k, c in module._modules.items():
            slots.append((module._modules, k, _NONE if c is None else weakref.ref(c)))
        is_root = module is root
        if not is_root:
            if wrapped and (module is inner or not path.startswith(prefix + ".")):
                continue
            if type(module).__name__ in naming.INNER_WRAPPERS:
                continue
            upath = naming.user_path(path[len(prefix) + 1:] if wrapped else path)
            if not _included(cfg, upath):
                continue
        found.add(id(module))
        h = hooked.get(module)
        if h is None:
            if is_root:
                # the wrapper is what the user calls; it stands for the user's model
                info = ModuleInfo("", module, True, _included(cfg, ""), cls=naming.module_class_name(inner),
                                  params=inner._parameters)
            else:
                info = ModuleInfo(upath, module, False, True)
            h = hooked[module] = _Hooked(info)
            _hook_module(w, h, module, is_root)
            if not first:
                new_paths.append(f"{info.path or '(root)'} ({info.cls})")
        info = h.info
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (info, pname))
        if cfg.gradients and info.recorded:
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in param_hooks:
                    kept = old_param_hooks.get(id(p))
                    if kept is not None and kept[0]() is p and kept[1] is info:
                        param_hooks[id(p)] = kept
                        continue
                    handle = p.register_post_accumulate_grad_hook(w._backward.param_hook(info, name + ".grad"))
                    param_hooks[id(p)] = (weakref.ref(p), info, handle)
                    w._handles.append(handle)
    for pid, kept in old_param_hooks.items():
        if param_hooks.get(pid) is not kept:
            kept[2].remove()  # a parameter the model no longer holds: its gradients are not ours
    for module in [m for m in hooked.keys() if id(m) not in found]:
        for handle in hooked.pop(module).handles:
            handle.remove()  # swapped out of the model: calling it is no batch of ours
    w._param_hooks = param_hooks
    w._weight_infos = weight_infos
    changed = w._index.replace(owners, params, slots)
    if first:
        return
    batch = w.batch_number
    if new_paths:
        log.info("tensorwatch_otel: modules were replaced or added after watch(): %s%s; watched from batch %d on",
                 ", ".join(new_paths[:_SAY_NEW_MODULES]),
                 f" and {len(new_paths) - _SAY_NEW_MODULES} more" if len(new_paths) > _SAY_NEW_MODULES else "", batch)
    elif changed and not w._said_params_replaced:
        w._said_params_replaced = True
        log.info("tensorwatch_otel: the model's parameters were replaced after watch() (to_empty(), "
                 "load_state_dict(assign=True), fully_shard, ...): found again at batch %d%s", batch,
                 "; their gradients are watched" if cfg.gradients else "")


def _hook_module(w: "Watcher", h: _Hooked, module: torch.nn.Module, is_root: bool) -> None:
    info = h.info
    if is_root and w._capture is not None:
        h.handles.append(module.register_forward_pre_hook(w._capture_hook, with_kwargs=True))
    # traced into a compiled graph, each hook becomes an op that runs it at run time (core/compiled.py)
    slot = compiled.new_slot(w, module, w._pre_hook)
    hook = w._make_hook(info, slot)
    compiled.set_post(slot, hook)
    h.handles.append(module.register_forward_pre_hook(compiled.pre_hook(slot, w._pre_hook, is_root)))
    h.handles.append(module.register_forward_hook(hook, with_kwargs=True, always_call=True))
    h.handles.append(compiled.SlotHandle(slot))
    w._handles.extend(h.handles)


def say_compiled(w: "Watcher") -> None:
    """What a watcher of a torch.compile'd module records, said once at INFO."""
    log.info(
        "tensorwatch_otel: %s runs under torch.compile: the watcher's hooks are traced into its "
        "graph (one op per hook, run between the compiled kernels), so every module is recorded "
        "as in eager mode%s",
        naming.module_class_name(naming.unwrap_root(w.model)),
        ("; gradients: the parameters'" + (" and the compiled call's inputs' and output's" if w._compiled else "")
         + ", not the activations' inside the graph") if w.config.gradients else "")
