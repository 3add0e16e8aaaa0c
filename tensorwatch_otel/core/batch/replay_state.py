"""What a replay of a batch must give back (core/batch/rerun.py): each module's state by identity (every
attribute, parameter, buffer and submodule rebound to the object it held, tensors' values, the
items of lists, dicts and sets it holds) and the random generators other than torch's global ones.

Taken before the replay and restored after it, so that training goes on as if the replay never
ran; runs at a detection only. A forward that rebinds what a module holds (`self.count =
self.count + 1` on a buffer, a hidden state kept as `self.h = h.detach()`) would otherwise leave
the replay's objects in place, where copying the old values into the old tensors does not reach."""

from __future__ import annotations

import collections
import random
import sys
from typing import Any, Dict, List, Set, Tuple

import torch

_MISSING = object()
# torch.nn.Module's registries, restored entry by entry (a forward may register a buffer or
# rebind one); its hook dicts are the watchers' (a replay's probe adds and takes back its own,
# and an unsampled batch's hooks may be put back during a replay): never touched here
_REGISTRIES = ("_parameters", "_buffers", "_modules")
# exactly these types (a subclass may keep state its items do not show): their items are given back
_MAPPINGS = (dict, collections.OrderedDict)
_SEQUENCES = (list, collections.deque)
_SETS = (set,)


def _hook_dicts() -> Set[str]:
    return {k for k in vars(torch.nn.Module()) if "hook" in k}


def _items(container: Any) -> Any:
    """A copy of a container's items: a dict for a mapping, a list for a sequence, a set."""
    tp = type(container)
    return dict(container) if tp in _MAPPINGS else list(container) if tp in _SEQUENCES else set(container)


def _same_items(container: Any, saved: Any) -> bool:
    if len(container) != len(saved):
        return False
    if isinstance(saved, dict):
        return all(container.get(k, _MISSING) is v for k, v in saved.items())
    if isinstance(saved, list):
        return all(a is b for a, b in zip(container, saved))
    return bool(container == saved)


def _put_back(container: Any, saved: Any) -> None:
    container.clear()
    if isinstance(saved, list):
        container.extend(saved)
    else:
        container.update(saved)


def _rebind(target: Dict[str, Any], saved: Dict[str, Any], keep: Set[str]) -> None:
    """`target` holds `saved`'s objects again (keys in `keep` left as they are)."""
    for k in [k for k in target if k not in saved and k not in keep]:
        del target[k]
    for k, v in saved.items():
        if k not in keep and target.get(k, _MISSING) is not v:
            target[k] = v


def _numpy_random() -> Any:
    """NumPy's global random module, when something imported NumPy (the core never does)."""
    np = sys.modules.get("numpy")
    return getattr(np, "random", None) if np is not None else None


class ReplayState:
    """The model's state before a replay. `problems` names what could not be taken (then the
    batch must not be replayed); `drew()` the generators the replay drew from whose state at the
    batch's start is not held; `restore()` puts everything back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.problems: List[str] = []
        self._hooks = _hook_dicts()
        self._dicts: List[Tuple[Dict[str, Any], Dict[str, Any]]] = []  # (a __dict__ or registry, its copy)
        self._items: List[Tuple[Any, Any]] = []  # (a list, dict, set or deque a module holds, its items)
        self._tensors: List[Tuple[torch.Tensor, torch.Tensor, int]] = []  # (a tensor a module holds, values, version)
        self._params: List[Tuple[str, torch.Tensor, int]] = []  # (where, parameter, version)
        self._generators: List[Tuple[str, torch.Generator, torch.Tensor]] = []
        self._seen: Set[int] = set()
        self._python = random.getstate()
        np_random = _numpy_random()
        self._numpy = np_random.get_state() if np_random is not None else None
        for path, m in model.named_modules(remove_duplicate=True):
            d = m.__dict__
            self._dicts.append((d, dict(d)))
            for name in _REGISTRIES:
                registry = d.get(name)
                if type(registry) is dict:
                    self._dicts.append((registry, dict(registry)))
            where = f"{path}." if path else ""
            for name, p in m._parameters.items():
                if p is not None and id(p) not in self._seen:
                    self._seen.add(id(p))
                    self._params.append((where + name, p, _version(p)))
            for name, b in m._buffers.items():
                self._hold(b, where + name)
            for name, v in d.items():
                if name not in self._hooks and name not in _REGISTRIES:
                    self._hold(v, where + name, containers=True)

    def _hold(self, v: Any, where: str, containers: bool = False) -> None:
        if id(v) in self._seen:
            return
        if isinstance(v, torch.Tensor):
            self._seen.add(id(v))
            if isinstance(v, torch.nn.Parameter):
                self._params.append((where, v, _version(v)))
                return
            try:
                self._tensors.append((v, v.detach().clone(), _version(v)))
            except Exception as exc:  # (a tensor subclass that cannot be copied)
                self.problems.append(f"{where}: {type(v).__name__} ({type(exc).__name__}: {exc})")
        elif isinstance(v, torch.Generator):
            self._seen.add(id(v))
            self._generators.append((where, v, v.get_state()))
        elif containers and type(v) is tuple:  # (an LSTM's (h, c) kept on the module)
            for i, x in enumerate(v):
                self._hold(x, f"{where}[{i}]")
        elif containers and type(v) in _MAPPINGS + _SEQUENCES + _SETS:
            self._seen.add(id(v))
            items = _items(v)
            self._items.append((v, items))
            for i, x in (items.items() if isinstance(items, dict) else enumerate(items)):
                self._hold(x, f"{where}[{i!r}]")

    def drew(self) -> List[str]:
        """The generators the replay drew from whose state at the batch's start is not held
        (those a module holds, Python's `random`, NumPy's global one): its random numbers are not
        the batch's."""
        moved = [f"the generator {where}" for where, g, state in self._generators
                 if not torch.equal(g.get_state(), state)]
        if random.getstate() != self._python:
            moved.append("Python's random")
        np_random = _numpy_random()
        if self._numpy is not None and np_random is not None and not _same_numpy(np_random.get_state(), self._numpy):
            moved.append("NumPy's random")
        return moved

    def restore(self) -> List[str]:
        """Put back every object, value, version and generator state as taken. Returns what could
        not be given back: parameters the replay changed in place (a copy of every parameter
        would double the model's memory), versions torch cannot set."""
        left = [f"{where} (a parameter, changed in place)" for where, p, version in self._params
                if version != -1 and _version(p) != version]
        hooks = self._hooks
        for target, saved in self._dicts:
            _rebind(target, saved, hooks)
        for container, items in self._items:
            if not _same_items(container, items):
                _put_back(container, items)
        moved: List[Tuple[torch.Tensor, int]] = []
        for t, values, version in self._tensors:
            # through .data: the values the forward left, without a new version (a tensor the
            # forward saved for its backward is still the one it saved; a copy_ would fail that
            # backward as "modified by an inplace operation")
            with torch.inference_mode() if t.is_inference() else torch.no_grad():
                t.data.copy_(values)
            if version != -1 and _version(t) != version:
                moved.append((t, version))  # the replay wrote it in place
        if moved and not _set_versions(moved):
            left += ["the version of a tensor the replay wrote in place (torch cannot set it back)"]
        for _, g, state in self._generators:
            g.set_state(state)
        random.setstate(self._python)
        np_random = _numpy_random()
        if self._numpy is not None and np_random is not None:
            np_random.set_state(self._numpy)
        return left


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _set_versions(tensors: List[Tuple[torch.Tensor, int]]) -> bool:
    """Set each tensor's version counter back (autograd then sees no in-place write); False when
    this torch cannot."""
    set_version = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if set_version is None:
        return False
    try:
        set_version(tuple(t for t, _ in tensors), tuple(v for _, v in tensors))
    except TypeError:  # older torch: one tensor a call
        try:
            for t, v in tensors:
                set_version(t, v)
        except Exception:
            return False
    except Exception:
        return False
    return True


def _same_numpy(a: Any, b: Any) -> bool:
    """Two `numpy.random.get_state()` tuples: the same state."""
    try:
        return bool(a[0] == b[0] and (a[1] == b[1]).all() and tuple(a[2:]) == tuple(b[2:]))
    except Exception:  # (a state of another shape: taken as moved)
        return False
