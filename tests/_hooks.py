"""The hooks a module tree still carries: the integrations' tests check that none are left."""

from __future__ import annotations

from typing import Dict

import torch

_KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def remaining_hooks(model: torch.nn.Module) -> Dict[str, int]:
    """{"path: kind": count} for every module and parameter hook on `model` (empty: none)."""
    out: Dict[str, int] = {}
    for path, module in model.named_modules():
        for kind in _KINDS:
            n = len(getattr(module, kind, None) or ())
            if n:
                out[f"{path or '(root)'}: {kind}"] = n
        for name, p in module.named_parameters(recurse=False):
            n = len(getattr(p, "_post_accumulate_grad_hooks", None) or ()) + len(p._backward_hooks or ())
            if n:
                out[f"{path + '.' if path else ''}{name}: grad hooks"] = n
    return out
