"""Where the watcher's hooks go: a forward pre-hook and hook on every included module of the
user's model (whatever wraps it: DDP, torch.compile, FSDP), parameter-gradient hooks with
`gradients=True`, the batch-capture hook on the root, and the global optimizer step hooks (with
the step guard that checks the step's gradients when `gradients=True` is off).
Paths are the user's model's; a compiled model's modules are read through its root."""

from __future__ import annotations

import fnmatch
import logging
from typing import TYPE_CHECKING

from . import naming
from .config import WatchConfig
from .optim_state import OptimizerStateReader
from .record import ModuleInfo
from .steps import StepGuard, StepTracker

if TYPE_CHECKING:  # pragma: no cover
    from .watcher import Watcher

log = logging.getLogger(__name__)


def _included(cfg: WatchConfig, path: str) -> bool:
    label = path or "(root)"
    if cfg.include and not any(fnmatch.fnmatchcase(label, p) for p in cfg.include):
        return False
    return not any(fnmatch.fnmatchcase(label, p) for p in cfg.exclude)


def place_hooks(w: "Watcher") -> None:
    cfg = w.config
    root = w.model
    inner = naming.unwrap_root(root)
    wrapped = inner is not root
    prefix = ""
    if wrapped:
        prefix = next((p for p, m in root.named_modules() if m is inner), "")
        w._compiled = any(type(m).__name__ == "OptimizedModule" for m in root.modules())
    seen = set()
    for path, module in root.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        is_root = module is root
        if is_root:
            # the wrapper is what the user calls; it stands for the user's model
            info = ModuleInfo("", module, True, _included(w.config, ""), cls=naming.module_class_name(inner),
                              params=inner._parameters)
        else:
            if wrapped and (module is inner or not path.startswith(prefix + ".")):
                continue
            if type(module).__name__ in naming.INNER_WRAPPERS:
                continue
            upath = naming.user_path(path[len(prefix) + 1:] if wrapped else path)
            if not _included(w.config, upath):
                continue
            info = ModuleInfo(upath, module, False, True)
        for pname, p in module.named_parameters(recurse=False):
            w._owners.setdefault(id(p), (info, pname))
        if is_root and w._capture is not None:
            w._handles.append(module.register_forward_pre_hook(w._capture_hook, with_kwargs=True))
        if w._compiled and not is_root:
            # compiled away: hooks inside the graph do not run; weights are read at the root
            if info.params:
                w._weight_infos.append((info, module))
            continue
        w._handles.append(module.register_forward_pre_hook(w._pre_hook))
        w._handles.append(module.register_forward_hook(
            w._make_hook(info), with_kwargs=True, always_call=True))
        if cfg.gradients and info.recorded:
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    w._handles.append(p.register_post_accumulate_grad_hook(
                        w._backward.param_hook(info, name + ".grad")))
    if w._compiled and cfg.gradients:
        for info, module in w._weight_infos:
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    w._handles.append(p.register_post_accumulate_grad_hook(
                        w._backward.param_hook(info, name + ".grad")))
    w._optim_state = OptimizerStateReader(w._owners) if cfg.optimizer_state else None
    # gradients=True localizes bad gradients in the backward: the step guard would add nothing
    w._guard = StepGuard(w._owners) if cfg.guard_steps and not cfg.gradients else None
    w._steps = StepTracker(inner, w._before_step, w._after_step)
    w._handles.extend(w._steps.handles)


def say_compiled(w: "Watcher") -> None:
    """What a watcher of a torch.compile'd module records, said once."""
    log.warning(
        "tensorwatch_otel: %s is compiled with torch.compile: module hooks do not run inside "
        "compiled graphs, so each batch records the compiled call's inputs and outputs and "
        "the weights of every module%s; an inf/nan born inside the graph is reported at the "
        "model's output. Watch the model before compiling it only to debug in eager mode.",
        naming.module_class_name(naming.unwrap_root(w.model)),
        " and their gradients" if w.config.gradients else "")
