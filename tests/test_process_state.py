"""The core keeps no module-level mutable state outside the documented registry
(tensorwatch_otel/core/process.py): a module-level name rebound with `global`, or a
module-level object written in place (items, attributes, mutating methods), or made as an
empty container, lock, counter or thread-local at import, must be listed in PROCESS_WIDE
with why it is the process's; every listed name must exist."""

from __future__ import annotations

import ast
import os
from typing import Dict, Set

from tensorwatch_otel.core.process import PROCESS_WIDE

CORE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tensorwatch_otel", "core")
_MUTATING = {"append", "add", "update", "pop", "setdefault", "clear", "extend", "remove", "discard", "popitem",
             "insert", "__setitem__", "appendleft"}
_MADE_MUTABLE = {"set", "dict", "list", "local", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "count",
                 "Lock", "RLock", "defaultdict", "deque", "Event"}


def _module_names(tree: ast.Module) -> Dict[str, ast.expr]:
    names: Dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names[t.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            names[node.target.id] = node.value
    return names


def _made_mutable(value: ast.expr) -> bool:
    """An empty container, or a thread-local, weak set/dict, counter, lock or event: made to be
    written later. (A table written out in full and never written after is a constant.)"""
    if isinstance(value, ast.Dict):
        return not value.keys
    if isinstance(value, (ast.List, ast.Set)):
        return not value.elts
    if isinstance(value, ast.Call):
        f = value.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("set", "dict", "list"):
            return not value.args and not value.keywords
        return name in _MADE_MUTABLE
    return False


def _written(tree: ast.Module) -> Set[str]:
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out.update(node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.attr in _MUTATING:
            out.add(node.func.value.id)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete, ast.AnnAssign)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, (ast.Subscript, ast.Attribute)) and isinstance(sub.value, ast.Name):
                        out.add(sub.value.id)
    return out


def _trees() -> Dict[str, ast.Module]:
    """module (dotted, from core: "measure.stats") -> its parsed source, for every core module but
    process.py."""
    out: Dict[str, ast.Module] = {}
    for folder, _dirs, files in os.walk(CORE):
        room = os.path.relpath(folder, CORE)
        for fn in sorted(files):
            if fn.endswith(".py") and fn != "__init__.py" and (room, fn) != (".", "process.py"):
                name = fn[:-3] if room == "." else f"{room.replace(os.sep, '.')}.{fn[:-3]}"
                with open(os.path.join(folder, fn), encoding="utf-8") as fh:
                    out[name] = ast.parse(fh.read())
    return out


def _state_of_core() -> Dict[str, str]:
    """module.NAME -> why it counts as state, for every core module but process.py."""
    found: Dict[str, str] = {}
    for module, tree in _trees().items():
        names = _module_names(tree)
        written = _written(tree)
        for name, value in names.items():
            if name in written:
                found[f"{module}.{name}"] = "written after import"
            elif _made_mutable(value):
                found[f"{module}.{name}"] = f"made mutable at import: {ast.unparse(value)[:60]}"
    return found


def test_the_core_keeps_no_module_level_state_outside_the_registry() -> None:
    unlisted = {k: v for k, v in _state_of_core().items() if k not in PROCESS_WIDE}
    assert not unlisted, ("module-level mutable state in tensorwatch_otel/core not listed in "
                          f"core/process.py's PROCESS_WIDE (make it instance state, or list it with why): {unlisted}")


def test_every_listed_name_exists_and_says_why() -> None:
    trees = _trees()
    for name, why in PROCESS_WIDE.items():
        module, _, attr = name.rpartition(".")
        assert module in trees and attr in _module_names(trees[module]), \
            f"PROCESS_WIDE lists {name}, which the core no longer has: remove it"
        assert len(why) > 20, f"{name}: say why it is the process's"


def test_the_checker_sees_each_kind_of_state(tmp_path: "os.PathLike[str]") -> None:
    tree = ast.parse("import threading\nA = {}\nB = threading.local()\nC = 0\nD = (1, 2)\nE = []\n"
                     "F = {1: 2}\nG = set()\nH = weakref.WeakSet()\n"
                     "def f():\n    global C\n    C = 1\n    A['x'] = 1\n    F.update({})\n    x.y = 1\n")
    names, written = _module_names(tree), _written(tree)
    assert written == {"A", "C", "F", "x"}
    assert all(_made_mutable(names[n]) for n in "ABEGH") and not any(_made_mutable(names[n]) for n in "CDF")
