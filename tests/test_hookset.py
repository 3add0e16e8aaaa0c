"""The watcher's hooks have one owner (core/frames/attach.py's HookSet): it places them, moves them to
what the model holds after a replacement, and removes every one of them at detach(). An
object's private state is written only by its own methods: no core module writes another
object's underscored attributes (assigned, deleted, or changed in place), the batch record's
layout included (core/record.py)."""

from __future__ import annotations

import ast
import pathlib

import torch
from torch import nn
from torch.optim import optimizer as optim_mod

from _collect import Collect
from _models import TwoLinear as Net
from tensorwatch_otel import watch

CORE = pathlib.Path(__file__).resolve().parent.parent / "tensorwatch_otel" / "core"
_MUTATORS = {"append", "extend", "clear", "update", "pop", "popitem", "insert", "remove", "add",
             "discard", "setdefault"}


def _foreign_private(node: ast.AST) -> bool:
    """`x._name` (or `x.y._name`) with x not self / cls."""
    return isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))


def _writes_of_foreign_private_state(source: str) -> list:
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if _foreign_private(sub) or (isinstance(sub, ast.Subscript) and _foreign_private(sub.value)):
                    found.append((node.lineno, ast.unparse(sub)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                and _foreign_private(node.func.value):
            found.append((node.lineno, ast.unparse(node.func)))
    return found


def test_no_core_module_writes_another_objects_private_state():
    assert _writes_of_foreign_private_state("w._compiled = True\nw._handles.extend(h)\nself._x = 1\n") == \
        [(1, "w._compiled"), (2, "w._handles.extend")]
    # the batch record's layout (core/record.py): written by its own methods only
    assert sorted(_writes_of_foreign_private_state(
        "rec._stats += pair\nrec._dtypes.append(dt)\nrec._frames.append((info, items, k))\n"
        "rec._stats[pos] = v\ndel rec._stats[m:], rec._frames[n:]\nself._stats += pair\n")) == \
        [(1, "rec._stats"), (2, "rec._dtypes.append"), (3, "rec._frames.append"), (4, "rec._stats"),
         (4, "rec._stats[pos]"), (5, "rec._frames"), (5, "rec._frames[n:]"), (5, "rec._stats"), (5, "rec._stats[m:]")]
    found = {f.name: _writes_of_foreign_private_state(f.read_text()) for f in sorted(CORE.rglob("*.py"))}
    assert {name: w for name, w in found.items() if w} == {}


def _hooks_left(modules, params) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules) + \
        sum(len(p._post_accumulate_grad_hooks or {}) for p in params)


def test_the_hook_set_follows_a_swap_and_detach_removes_every_hook():
    torch.manual_seed(0)
    step_hooks = (len(optim_mod._global_optimizer_pre_hooks), len(optim_mod._global_optimizer_post_hooks))
    model = Net()
    old_b = model.b
    w = watch(model, sinks=[Collect()], gradients=True)
    hooks = w._session.hooks
    assert (hooks.hooked, hooks.gradient_hooks) == (3, 4)  # root, a, b; a's and b's weight and bias
    assert hooks.index.scans == 1 and not hooks.compiled
    model.b = nn.Linear(16, 4)  # swapped in after watch(): hooked at the next call
    model.load_state_dict(Net().state_dict(), assign=True)  # every parameter replaced
    model(torch.randn(4, 8)).sum().backward()
    assert hooks.index.scans == 2 and (hooks.hooked, hooks.gradient_hooks) == (3, 4)
    assert _hooks_left([old_b], []) == 0  # the swapped-out module's hooks went with it
    assert _hooks_left(model.modules(), model.parameters()) > 0
    w.detach()
    assert _hooks_left(list(model.modules()) + [old_b], model.parameters()) == 0
    assert (len(optim_mod._global_optimizer_pre_hooks), len(optim_mod._global_optimizer_post_hooks)) == step_hooks
    assert hooks.index.current()
    w.detach()  # idempotent
