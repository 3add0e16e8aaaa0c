"""No module of the package reads another's private names: a name with a leading underscore is
used only where it is defined (a private module is shared within its own package). Read from the
source with ast, so a new reach fails here, naming the place."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parent.parent / "tensorwatch_otel"
# torch's own attributes that the package reads on tensors and modules (not ours to rename)
TORCH_ATTRIBUTES = {"_version", "_modules", "_parameters", "_buffers", "_forward_hooks",
                    "_forward_pre_hooks", "_backward_hooks", "_C"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _trees() -> Dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _our_private_attributes(trees: Dict[Path, ast.Module]) -> Set[str]:
    """Every `self._x` the package's classes assign: their private state."""
    names = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                    and n.value.id == "self" and _private(n.attr):
                names.add(n.attr)
    return names - TORCH_ATTRIBUTES


def reaches(trees: Dict[Path, ast.Module]) -> List[str]:
    ours = _our_private_attributes(trees)
    found = []
    for path, tree in trees.items():
        where = path.relative_to(PACKAGE.parent)
        modules = set()  # names this file binds to modules of the package
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.level > 0:
                for a in n.names:
                    private_module = n.module is None and (path.parent / f"{a.name}.py").exists()
                    if n.module is None:
                        modules.add(a.asname or a.name)
                    if _private(a.name) and not (private_module and n.level == 1):
                        found.append(f"{where}:{n.lineno}: from {'.' * n.level}{n.module or ''} import {a.name}")
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and _private(n.attr)):
                continue
            base = n.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Name) and base.id in modules and n.attr not in TORCH_ATTRIBUTES:
                found.append(f"{where}:{n.lineno}: {ast.unparse(n)} (a private name of another module)")
            elif n.attr in ours and not ast.unparse(base).startswith("torch"):
                found.append(f"{where}:{n.lineno}: {ast.unparse(n)} (another object's private state)")
    return found


def test_no_module_reads_another_modules_private_names():
    assert reaches(_trees()) == []


def test_the_check_sees_each_kind_of_reach():
    """The scan itself, on a made-up module added to the package's sources: a private name
    imported from a module, one read through a module, and another object's private state."""
    trees = _trees()
    fake = PACKAGE / "core" / "made_up_for_the_test.py"
    trees[fake] = ast.parse("from .stats import abs_minmax_torch_cpu, _wrapper_values\n"
                            "from . import stats\n"
                            "def f(w):\n"
                            "    return stats._wrapper_values, w._session, w.attached\n")
    found = [line.split(": ", 1)[1] for line in reaches(trees) if "made_up_for_the_test" in line]
    assert found == ["from .stats import _wrapper_values",
                     "stats._wrapper_values (a private name of another module)",
                     "w._session (another object's private state)"]
