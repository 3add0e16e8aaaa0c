"""Where the watcher's hooks go: a forward pre-hook and hook on every included module of the
user's model (whatever wraps it: DDP, torch.compile, FSDP), parameter-gradient hooks with
`gradients=True` and the batch-capture hook on the root (the optimizer step hooks are
core/steps/tracker.py's).
Paths are the user's model's; a compiled model's modules are read through its root.

Parameters and submodules replaced after watch() (`to_empty()` from the meta device,
`load_state_dict(assign=True)`, FSDP2's `fully_shard`, `model.head = nn.Linear(...)`) are found
again: the ParamIndex remembers what each module held, a cheap identity check at each outermost
call and each optimizer step sees a change, and `rescan` moves the owners, the gradient hooks
and the forward hooks to what the model holds now.

The HookSet owns all of it: every handle placed, the module -> hooks map, the gradient hooks,
the ParamIndex. The watcher builds it with the callables the hooks run and
reads it through its methods and read-only properties only."""

from __future__ import annotations

import fnmatch
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch.utils.hooks import RemovableHandle

from . import compiled, offload, op_slots
from .. import naming
from ..config import WatchConfig
from .copies import Copies, Hook, ModuleHook
from .quiet import Places, QuietBatches
from .param_index import ParamIndex, SlotEntry
from ..frame_draft import ModuleInfo

if TYPE_CHECKING:  # pragma: no cover
    from .op_slots import EagerPreHook, SlotOwner

log = logging.getLogger(__name__)

_SAY_NEW_MODULES = 8  # swapped-in module paths named in the log line


def _NONE() -> None:  # the slot of a parameter or submodule registered as None
    return None


def _included(cfg: WatchConfig, path: str) -> bool:
    label = path or "(root)"
    if cfg.include and not any(fnmatch.fnmatchcase(label, p) for p in cfg.include):
        return False
    return not any(fnmatch.fnmatchcase(label, p) for p in cfg.exclude)


class _Hooked:
    """A module with hooks, their handles, its frame info, (not the root) where its forward
    pre-hook and hook sit: (hook dict, key) each, what an unsampled batch takes off, and the
    LentWeights placed on it when accelerate lends it its weights (core/frames/offload.py)."""

    __slots__ = ("info", "handles", "places", "lent")

    def __init__(self, info: ModuleInfo):
        self.info = info
        self.handles: List[Any] = []
        self.places: Places = []
        self.lent: Optional[offload.LentWeights] = None


_Handle = Any  # a RemovableHandle or an op_slots.SlotHandle: has .remove()
# id(param) -> (the parameter, its watched module, its gradient hook's handle)
_ParamHook = Tuple["weakref.ref[torch.Tensor]", ModuleInfo, RemovableHandle]


#: the id of the watcher's hooks in a module's hook dicts (RemovableHandle's own ids count up from
#: 0): one id for every module, so that modules sharing their code share a compiled graph (dynamo
#: guards on `hook_id in module._forward_hooks_always_called` and the like); the next one down
#: where a module holds a hook of another watcher at it already
_HOOK_ID = -(1 << 40)


def _hook_id(*dicts: Dict[int, Any]) -> int:
    i = _HOOK_ID
    while any(i in d for d in dicts):
        i -= 1
    return i


def _with_id(hook_id: int, register: Callable[[], RemovableHandle]) -> RemovableHandle:
    """`register()` (a module's register_forward_*_hook) with its handle numbered `hook_id`:
    torch numbers handles from RemovableHandle.next_id, set for this one call."""
    saved = RemovableHandle.next_id
    RemovableHandle.next_id = hook_id
    try:
        return register()
    finally:
        RemovableHandle.next_id = saved


def _register_pre(module: torch.nn.Module, hook: Any) -> RemovableHandle:
    """`module.register_forward_pre_hook(hook, with_kwargs=True)`, under the watcher's hook id.
    With kwargs: the id stays taken in the module's kwargs dict while a quiet batch has the
    hook off (core/frames/quiet.py takes it out of the hook dict alone), so a replay's probe watcher
    takes another (its removal clears its id in every dict)."""
    return _with_id(_hook_id(module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs),
                    lambda: module.register_forward_pre_hook(hook, with_kwargs=True))


def _register_post(module: torch.nn.Module, hook: Any) -> RemovableHandle:
    """`module.register_forward_hook(hook, with_kwargs=True, always_call=True)`, under the
    watcher's hook id (taken in any of the three dicts: see _register_pre)."""
    return _with_id(_hook_id(module._forward_hooks, module._forward_hooks_with_kwargs,
                             module._forward_hooks_always_called),
                    lambda: module.register_forward_hook(hook, with_kwargs=True, always_call=True))


class HookSet:
    """The watcher's hooks on one model, and what they are placed from.

    Built with what the hooks run: `slot_owner` (handed to core/frames/compiled.py's op slots only:
    their hooks run while it is attached), `quiet` (the switch an unsampled batch takes the
    hooks off with, shared with the batch lifecycle), `pre_hook` (every module's forward pre-hook),
    `make_hook(info, slot)` (a module's forward hook), `capture_hook` (the root's input capture,
    or None), `param_hook(info, name)` (a parameter's gradient hook, with `gradients=True`),
    `params_current` (the model's parameters checked against the index), and `batch_number`
    (for log lines). `place()` hooks the model, `rescan()` moves the hooks to what it holds
    now, `current()` says whether it still holds what was last seen, `remove()` takes every
    hook off."""

    def __init__(self, model: torch.nn.Module, config: WatchConfig, *, slot_owner: "SlotOwner", quiet: QuietBatches,
                 pre_hook: "EagerPreHook", make_hook: Callable[[ModuleInfo, int], ModuleHook],
                 capture_hook: Optional[Callable[..., Any]],
                 param_hook: Callable[[ModuleInfo, str], Callable[[torch.Tensor], None]],
                 params_current: Callable[[], None], batch_number: Callable[[], int]) -> None:
        self._model = model
        self._config = config
        self._slot_owner = slot_owner
        self._pre_hook = pre_hook
        self._make_hook = make_hook
        self._capture_hook = capture_hook
        self._param_hook = param_hook
        self._params_current = params_current
        self._batch_number = batch_number
        self._index = ParamIndex()
        # the index's own check, not a method of ours: one call per outermost call, as before
        self.current: Callable[[], bool] = self._index.current
        self._hooked: "weakref.WeakKeyDictionary[torch.nn.Module, _Hooked]" = weakref.WeakKeyDictionary()
        self._param_hooks: Dict[int, _ParamHook] = {}
        self._handles: List[_Handle] = []
        self._compiled = False
        self._said_params_replaced = False
        self._quiet = quiet
        self._copies = Copies()  # deep copies of the model's modules: their hooks are no-ops (core/frames/copies.py)

    @property
    def index(self) -> ParamIndex:
        """The model's parameters and their owners, as last seen."""
        return self._index

    @property
    def compiled(self) -> bool:
        """The model holds a torch.compile'd module (an OptimizedModule) under a wrapper."""
        return self._compiled

    @property
    def quiet(self) -> QuietBatches:
        """The hooks an unsampled batch takes off (core/frames/quiet.py)."""
        return self._quiet

    @property
    def hooked(self) -> int:
        """Modules with hooks."""
        return len(self._hooked)

    @property
    def gradient_hooks(self) -> int:
        """Parameters with a gradient hook."""
        return len(self._param_hooks)

    def place(self) -> None:
        """Hooks on every included module, and the gradient hooks."""
        inner = naming.unwrap_root(self._model)
        if inner is not self._model:
            self._compiled = any(type(m).__name__ == "OptimizedModule" for m in self._model.modules())
        compiled.hook_guards()  # before any graph sees the hooks
        if self._compiled:
            self._quiet.turn_off("the model runs compiled")
        self.rescan(first=True)

    def remove(self) -> None:
        """Every hook placed, removed, and the no-ops copies of the model's modules hold. Idempotent."""
        self._quiet.put_back()
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        self._copies.take_off()

    def rescan(self, first: bool = False) -> None:
        """Walk the model as it is now: hooks on modules not hooked yet (all of them at watch()),
        gradient hooks moved to the parameters the modules hold now, hooks of modules no longer
        in the model removed, and the ParamIndex told."""
        self._quiet.put_back()  # (a batch that took them off goes on with the hooks on)
        cfg = self._config
        root = self._model
        inner = naming.unwrap_root(root)
        wrapped = inner is not root
        prefix = next((p for p, m in root.named_modules() if m is inner), "") if wrapped else ""
        hooked = self._hooked
        old_param_hooks = self._param_hooks
        param_hooks: Dict[int, _ParamHook] = {}
        owners: Dict[int, Tuple[ModuleInfo, str]] = {}
        params: List[torch.Tensor] = []
        slots: List[SlotEntry] = []
        found: Set[int] = set()
        new_paths: List[str] = []
        seen: Set[int] = set()
        # modules whose parameters accelerate's offload lends for each call (core/frames/offload.py):
        # new tensors every call, so they are neither the model's parameters as last seen (a
        # rescan per batch) nor owned (the step guard, gradient hooks) by anything lasting
        lent_below: Set[int] = set()
        upath = ""
        for path, module in root.named_modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            lends = offload.lends(module)
            if lends and offload.lends_submodules(module):
                lent_below.update(id(m) for m in module.modules())
            lent = lends or id(module) in lent_below
            for k, p in () if lent else module._parameters.items():
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
                self._hook_module(h, module, is_root)
                if not first:
                    new_paths.append(f"{info.path or '(root)'} ({info.cls})")
            if lent:
                self._lend(h, module, lends)
                continue
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
                        handle = p.register_post_accumulate_grad_hook(self._param_hook(info, name + ".grad"))
                        param_hooks[id(p)] = (weakref.ref(p), info, handle)
                        self._handles.append(handle)
        for pid, kept in old_param_hooks.items():
            if param_hooks.get(pid) is not kept:
                kept[2].remove()  # a parameter the model no longer holds: its gradients are not ours
        for module in [m for m in hooked.keys() if id(m) not in found]:
            for handle in hooked.pop(module).handles:
                handle.remove()  # swapped out of the model: calling it is no batch of ours
        self._param_hooks = param_hooks
        self._quiet.set_places([(m, h.places) for m, h in self._hooked.items() if h.places])
        changed = self._index.replace(owners, params, slots)
        if first:
            return
        batch = self._batch_number()
        if new_paths:
            log.info("tensorwatch_otel: modules were replaced or added after watch(): %s%s; watched from batch %d on",
                     ", ".join(new_paths[:_SAY_NEW_MODULES]),
                     f" and {len(new_paths) - _SAY_NEW_MODULES} more" if len(new_paths) > _SAY_NEW_MODULES else "",
                     batch)
        elif changed and not self._said_params_replaced:
            self._said_params_replaced = True
            log.info("tensorwatch_otel: the model's parameters were replaced after watch() (to_empty(), "
                     "load_state_dict(assign=True), fully_shard, ...): found again at batch %d%s", batch,
                     "; their gradients are watched" if cfg.gradients else "")

    def _lend(self, h: _Hooked, module: torch.nn.Module, own_hook: bool) -> None:
        """The module's weights are lent per call: by its own offloading hook (a LentWeights keeps
        them for our forward hook), or by an ancestor's for the ancestor's whole call (the module
        holds them while its own hooks run)."""
        if own_hook and h.lent is None:
            h.lent = offload.LentWeights(module)
            h.handles.append(h.lent)
            self._handles.append(h.lent)
        h.info.lend(h.lent.params if h.lent is not None else None)

    def _hook_module(self, h: _Hooked, module: torch.nn.Module, is_root: bool) -> None:
        info = h.info
        copies = self._copies
        if is_root and self._capture_hook is not None:
            capture = Hook(self._capture_hook).place(module, copies)
            h.handles.append(module.register_forward_pre_hook(capture, with_kwargs=True))
        # traced into a compiled graph, each hook becomes an op that runs it at run time (core/frames/compiled.py)
        slot = op_slots.new_slot(self._slot_owner, module, self._pre_hook)
        hook = self._make_hook(info, slot).place(module, copies)
        op_slots.set_post(slot, hook)
        pre_hook = compiled.PreHook(slot, self._pre_hook, is_root, getattr(hook, "row_id", None)).place(module, copies)
        if hasattr(hook, "pair"):
            hook.pair(pre_hook)  # (core/batch/forward_hook.py's ForwardHook: its row id moves with its module)
        pre = _register_pre(module, pre_hook)
        post = _register_post(module, hook)
        h.handles += [pre, post, op_slots.SlotHandle(slot)]
        if not is_root:
            h.places = [(module._forward_pre_hooks, pre.id), (module._forward_hooks, post.id)]
        self._handles.extend(h.handles)

    def say_if_compiled(self) -> None:
        """What a watcher of a torch.compile'd module records, said once at INFO (when it is one,
        or was compiled in place by model.compile())."""
        if not self._compiled and getattr(self._model, "_compiled_call_impl", None) is None:
            return
        log.info(
            "tensorwatch_otel: %s runs under torch.compile: the watcher's hooks are traced into its "
            "graph (one op per hook, run between the compiled kernels), so every module is recorded "
            "as in eager mode%s",
            naming.module_class_name(naming.unwrap_root(self._model)),
            ("; gradients: the parameters'"
             + (" and the compiled call's inputs' and output's" if self._compiled else "")
             + ", not the activations' inside the graph") if self._config.gradients else "")
