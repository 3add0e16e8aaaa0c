"""Offloaded weights: accelerate's offload (`cpu_offload`, a `device_map` with modules on "cpu" or
"disk" beside an accelerator) keeps such a module's parameters as meta tensors between forwards.

Its hook (`add_hook_to_module`) replaces the module's `forward`: `pre_forward` puts real weights on
the module, the original forward runs, `post_forward` puts meta tensors back, all inside the call,
so every forward hook, ours included, sees meta. `LentWeights` takes the place of the original
forward that accelerate calls (`module._old_forward`), keeps what the module holds during it for
the forward hooks, and a last forward hook lets it go: no lent copy outlives the call.

Recognised by accelerate's marks (`_hf_hook`, `_old_forward` in the module's `__dict__`): the core
imports no accelerate."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

_DEPTH = 8  # nested SequentialHooks looked into


def _offloading(hook: object, depth: int = 0) -> bool:
    """`hook` (an accelerate ModelHook, possibly a SequentialHook of several) offloads weights."""
    if hook is None or depth > _DEPTH:
        return False
    if getattr(hook, "offload", False) is True:  # AlignDevicesHook(offload=True)
        return True
    return any(_offloading(h, depth + 1) for h in getattr(hook, "hooks", None) or ())


def lends(module: torch.nn.Module) -> bool:
    """accelerate lends `module` its weights for each call (its own hook offloads them)."""
    d = module.__dict__
    return "_old_forward" in d and _offloading(d.get("_hf_hook"))


def lends_submodules(module: torch.nn.Module) -> bool:
    """`module`'s offloading hook also lends the weights of every module below it, for the time
    of `module`'s call (accelerate's `place_submodules`, `preload_module_classes`)."""
    hook = module.__dict__.get("_hf_hook")
    hooks = [hook] + list(getattr(hook, "hooks", None) or ())
    return any(getattr(h, "place_submodules", False) is True and _offloading(h) for h in hooks)


class LentWeights:
    """Installed on one module that `lends()`: called by accelerate's forward in place of the
    original one, between the weights being put on the module and taken off it. `params` is the
    module's parameters of the call in progress (empty between calls); `remove()` puts
    accelerate's forward back as it was."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._dict = module.__dict__
        self._inner = module.__dict__["_old_forward"]
        self._src: Dict[str, Optional[torch.nn.Parameter]] = module._parameters
        self.params: Dict[str, Optional[torch.nn.Parameter]] = {}
        self._dict["_old_forward"] = self
        # last of the module's forward hooks, run even when the forward or a hook raised
        self._handle = module.register_forward_hook(self._done, always_call=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        params = self.params
        params.clear()
        params.update(self._src)  # real now: accelerate's pre_forward ran
        return self._inner(*args, **kwargs)

    def _done(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.params.clear()  # the copy accelerate lent goes with its own references

    def remove(self) -> None:
        self._handle.remove()
        self.params.clear()
        d = self._dict
        if d.get("_old_forward") is self:
            d["_old_forward"] = self._inner
        elif d.get("forward") is self:  # accelerate's remove_hook_from_module made us the forward
            d["forward"] = self._inner


def lent_params(module: torch.nn.Module) -> Dict[str, Optional[torch.nn.Parameter]]:
    """The parameters `module` holds in its call in progress: those accelerate lent it when a
    LentWeights is installed, else its own."""
    fwd = module.__dict__.get("_old_forward")
    return fwd.params if isinstance(fwd, LentWeights) and fwd.params else module._parameters
