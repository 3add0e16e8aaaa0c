"""on_detect="skip": how an optimizer step is made not to happen. torch's step pre-hooks can
change a step's arguments but not cancel it, so there are two ways, both decided in the pre-hook.

The gate: the first time an optimizer steps the model, `optimizer.step` gets a thin wrapper (an
instance attribute, given back at detach). A step the watcher skips raises SkipStep inside the
gate (from the pre-hook, or from the closure once it has run), and the gate returns without the
optimizer having run: no hook after it, no state, no step counter touched, whatever the optimizer.

The stand-in: a call that does not come through the gate (the optimizer's very first step, which
is where the gate gets put on; a library that swapped `optimizer.step` for its own wrapper) has
its step run on a stand-in for the optimizer: an instance of its class (so `super()` in a subclass
works) that reads the optimizer's attributes but has no parameter groups, so the step's loop over
them does nothing. An optimizer that reads its groups before running its closure (LBFGS) cannot be
skipped that way; `drop()` says so and the watcher raises instead.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

log = logging.getLogger(__name__)

StepArgs = Tuple[Tuple[Any, ...], Dict[str, Any]]


class SkipStep(Exception):
    """Raised inside a gated step that must not run; its gate returns `loss` (the closure's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, loss: Any = None) -> None:
        super().__init__("tensorwatch_otel: optimizer step skipped (non-finite gradients)")
        self.optimizer = optimizer
        self.loss = loss


class _Gate:
    """`optimizer.step` while a skipping watcher holds the optimizer. Holds the optimizer weakly
    (no reference cycle keeps a dropped optimizer's state alive). `__func__` is there because
    torch's LR schedulers wrap `optimizer.step.__func__` when they are made after the gate."""

    def __init__(self, optimizer: torch.optim.Optimizer, previous: Any) -> None:
        self._ref = weakref.ref(optimizer)
        self.previous = previous  # what optimizer.__dict__["step"] held; None: the class's step
        self.inside = 0  # calls of the step running through this gate now
        if getattr(previous, "_wrapped_by_lr_sched", False):
            # an LR scheduler's wrapper is inside: its "step() was overridden" check stays quiet
            self._wrapped_by_lr_sched = True
        gate = self

        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return gate.run(optimizer, args, kwargs)

        self.__func__ = step

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = self._ref()
        if optimizer is None:  # pragma: no cover - only reachable through the optimizer itself
            raise ReferenceError("the optimizer this step belonged to is gone")
        return self.run(optimizer, args, kwargs)

    def run(self, optimizer: torch.optim.Optimizer, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        self.inside += 1
        try:
            if self.previous is None:
                return type(optimizer).step(optimizer, *args, **kwargs)
            return self.previous(*args, **kwargs)
        except SkipStep as skip:
            if skip.optimizer is not optimizer:  # another optimizer's skip (a step inside a step)
                raise
            return skip.loss
        finally:
            self.inside -= 1


_OWN = frozenset(("param_groups", "drop", "_tw_optimizer", "_tw_dropped", "_tw_handed", "_tw_scratch",
                  "__class__", "__dict__"))


def _get(self: Any, name: str) -> Any:
    if name in _OWN:
        return object.__getattribute__(self, name)
    scratch = object.__getattribute__(self, "_tw_scratch")
    if name in scratch:
        return scratch[name]
    real = object.__getattribute__(self, "_tw_optimizer")
    own = object.__getattribute__(real, "__dict__")
    if name in own:
        return own[name]
    return object.__getattribute__(self, name)  # the class's: methods bound to the stand-in


def _set(self: Any, name: str, value: Any) -> None:
    if object.__getattribute__(self, "_tw_dropped"):  # the skipped step writes nothing on the optimizer
        object.__getattribute__(self, "_tw_scratch")[name] = value
    else:
        setattr(object.__getattribute__(self, "_tw_optimizer"), name, value)


def _groups(self: Any) -> List[Dict[str, Any]]:
    if object.__getattribute__(self, "_tw_dropped"):
        return []
    object.__setattr__(self, "_tw_handed", True)
    groups: List[Dict[str, Any]] = object.__getattribute__(self, "_tw_optimizer").param_groups
    return groups


def _drop(self: Any) -> bool:
    """From now on the step sees no parameter group; False when it already read them (too late)."""
    if object.__getattribute__(self, "_tw_handed"):
        return False
    object.__setattr__(self, "_tw_dropped", True)
    return True


_CLASSES: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def stand_in(optimizer: torch.optim.Optimizer, dropped: bool) -> Optional[Any]:
    """A stand-in for `optimizer` in its step's arguments: dropped (no groups) now, or after the
    closure when `dropped` is False (until then it is the optimizer to its step). None when its
    class cannot be stood in for."""
    cls = type(optimizer)
    try:
        sub = _CLASSES.get(cls)
        if sub is None:
            sub = type(f"SkippedStep{cls.__name__}", (cls,), {
                "__module__": __name__, "__getattribute__": _get, "__setattr__": _set,
                "param_groups": property(_groups), "drop": _drop, "_tw_stand_in": True})
            _CLASSES[cls] = sub
        inst: Any = object.__new__(sub)
    except Exception as exc:  # an optimizer class that takes no subclass: the step cannot be skipped so
        log.warning("tensorwatch_otel: cannot stand in for %s to skip its step (%s: %s)", cls.__name__,
                    type(exc).__name__, exc)
        return None
    object.__setattr__(inst, "_tw_optimizer", optimizer)
    object.__setattr__(inst, "_tw_dropped", dropped)
    object.__setattr__(inst, "_tw_handed", False)
    object.__setattr__(inst, "_tw_scratch", {})
    return inst


def is_stand_in(optimizer: object) -> bool:
    """`optimizer` is a stand-in: the step hooks a subclass's super().step() runs again on it
    (torch hooks every optimizer class's step) must leave it alone."""
    return getattr(type(optimizer), "_tw_stand_in", False) is True


class StepSkipper:
    """The gates one watcher put on optimizers, and the way to cancel a step of each."""

    def __init__(self) -> None:
        self._gates: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Gate]" = weakref.WeakKeyDictionary()

    def gate(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the gate on `optimizer.step`, once: from its next step on, a skip runs nothing. A
        library that puts its own step back later takes the gate off; then the stand-in serves."""
        if optimizer in self._gates:
            return
        previous = optimizer.__dict__.get("step")
        gate = _Gate(optimizer, previous)
        try:
            self._gates[optimizer] = gate
            vars(optimizer)["step"] = gate  # the instance's own step, in front of its class's
        except Exception as exc:  # an optimizer that takes no attribute: the stand-in serves
            self._gates.pop(optimizer, None)
            log.debug("tensorwatch_otel: no step gate on %s: %s", type(optimizer).__name__, exc)

    def inside(self, optimizer: torch.optim.Optimizer) -> bool:
        """This step of `optimizer` runs through the gate (a SkipStep is caught by it)."""
        gate = self._gates.get(optimizer)
        return gate is not None and gate.inside > 0

    def remove(self) -> None:
        """Give every optimizer its step back; a gate someone wrapped since stays, passing through."""
        for optimizer, gate in list(self._gates.items()):
            if optimizer.__dict__.get("step") is gate:
                if gate.previous is None:
                    del optimizer.step
                else:
                    vars(optimizer)["step"] = gate.previous
        self._gates = weakref.WeakKeyDictionary()


def with_stand_in(args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]], inst: Any,
                  closure: Optional[Callable[..., Any]] = None) -> StepArgs:
    """A step's (args, kwargs) with the stand-in in the optimizer's place (args[0]) and, when
    given, `closure` in the closure's."""
    kw = dict(kwargs or {})
    rest = tuple(args[1:])
    if closure is not None:
        if rest:
            rest = (closure,) + rest[1:]
        else:
            kw["closure"] = closure
    return (inst if inst is not None else args[0],) + rest, kw
