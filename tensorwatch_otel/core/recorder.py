"""What one module call contributes to a batch record: its own parameters, its inputs and its
outputs, measured on the device. Caches keep each distinct tensor measured once per batch."""

from __future__ import annotations

import weakref
from typing import Dict

import torch

from . import naming
from .events import NOTE_NONE, NOTE_NOT_TENSOR
from .record import ModuleInfo, Record
from .stats import measure

MAX_ITEMS = 256  # values looked at per container, so odd outputs stay bounded
MAX_DEPTH = 6
_PLAIN = (torch.nn.Parameter, torch.Tensor)  # data_ptr() is cheap and defined for these


class FrameRecorder:
    """Measures tensors into a Record. Weights are measured once per batch unless they are
    known unchanged; an activation seen as one module's output and the next one's input (the
    same object at the same version) is measured once."""

    def __init__(self, model: torch.nn.Module):
        # param -> (version, data_ptr, dtype, (mn, mx)); cleared by invalidate_weights()
        self.params_seen: Dict[torch.Tensor, tuple] = {}
        # Replaced parameters (functional_call, re-created weights) would stay alive as keys:
        # past this size the cache is dropped at a batch end and simply refilled.
        self.params_cap = 2 * sum(1 for _ in model.parameters()) + 64
        self.acts_seen: Dict[int, tuple] = {}  # id -> (weakref, version, (mn, mx), dtype)

    def invalidate_weights(self) -> None:
        self.params_seen.clear()

    def end_batch(self) -> None:
        self.acts_seen.clear()
        if len(self.params_seen) > self.params_cap:
            self.params_seen.clear()

    def clear(self) -> None:
        self.params_seen.clear()
        self.acts_seen.clear()

    # ------------------------------------------------------------------ a module call
    def frame(self, rec: Record, info: ModuleInfo, args, kwargs, output) -> None:
        """The full view: parameters, every positional and keyword input, any output value."""
        items: list = []
        start = len(rec.dtypes)
        self.params(rec, info, items)
        value = self.value
        for i, a in enumerate(args):
            value(rec, a, naming.input_name(i), items, 0)
        if kwargs:
            kw_names = info.kw_names
            for k, v in kwargs.items():
                name = kw_names.get(k)
                if name is None:
                    name = kw_names[k] = f"input.{k}"
                value(rec, v, name, items, 0)
        value(rec, output, "output", items, 0)
        rec.frames.append((info, items, start))

    def weights_frame(self, rec: Record, info: ModuleInfo) -> None:
        """A frame of a module's own weights only (a module whose call cannot be hooked)."""
        items: list = []
        start = len(rec.dtypes)
        self.params(rec, info, items)
        rec.frames.append((info, items, start))

    def params(self, rec: Record, info: ModuleInfo, items: list) -> None:
        for name, p in info.params.items():
            if p is not None:
                self.param(rec, p, name, items)

    def value(self, rec: Record, v, name: str, items: list, depth: int) -> None:
        """Any input/output value: tensors are measured, containers walked, others noted."""
        if isinstance(v, torch.Tensor):
            self.tensor(rec, v, name, items)
        elif v is None:
            items.append((name, NOTE_NONE))
        elif depth >= MAX_DEPTH:
            items.append((name, NOTE_NOT_TENSOR))
        elif isinstance(v, (tuple, list)):
            child = naming.child
            for i, x in enumerate(v[:MAX_ITEMS]):
                self.value(rec, x, child(name, i), items, depth + 1)
        elif isinstance(v, dict):  # includes transformers' ModelOutput
            child = naming.child
            for n, (k, x) in enumerate(v.items()):
                if n >= MAX_ITEMS:
                    break
                self.value(rec, x, child(name, k if isinstance(k, str) else str(k)), items, depth + 1)
        else:
            fields = naming.dataclass_fields(v)
            if fields:
                child = naming.child
                for f in fields[:MAX_ITEMS]:
                    self.value(rec, getattr(v, f, None), child(name, f), items, depth + 1)
            else:
                items.append((name, NOTE_NOT_TENSOR))

    def param(self, rec: Record, p: torch.Tensor, name: str, items: list) -> None:
        # A weight is reused while nothing wrote it: the cache is dropped at every optimizer
        # step, and the key holds version, storage and dtype (`.half()`, `.to()`, `.data =`).
        seen = self.params_seen.get(p)
        version = p._version
        ptr = p.data_ptr() if p.__class__ in _PLAIN else id(p)
        if seen is not None and seen[0] == version and seen[1] == ptr and seen[2] is p.dtype:
            rec.stats += seen[3]
            rec.dtypes.append(seen[2])
            items.append(name)
            return
        r = measure(p)
        if r.__class__ is str:
            items.append((name, r))
            return
        self.params_seen[p] = (version, ptr, p.dtype, r)
        rec.stats += r
        rec.dtypes.append(p.dtype)
        items.append(name)

    def tensor(self, rec: Record, t: torch.Tensor, name: str, items: list) -> None:
        # The weak reference guards against id() reuse after a tensor is freed.
        key = id(t)
        seen = self.acts_seen.get(key)
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            rec.stats += seen[2]
            rec.dtypes.append(seen[3])
            items.append(name)
            return
        r = measure(t)
        if r.__class__ is str:
            items.append((name, r))
            return
        try:
            self.acts_seen[key] = (weakref.ref(t), t._version, r, t.dtype)
        except (TypeError, RuntimeError):  # no weakref / no version (inference tensors): no reuse
            pass
        rec.stats += r
        rec.dtypes.append(t.dtype)
        items.append(name)
