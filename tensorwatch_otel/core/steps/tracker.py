"""Optimizer steps as the watcher sees them, through torch's global optimizer step hooks (any
optimizer, fused or not): which steps concern the watched model, run at every step, compiled
steps included. Each watcher keeps the handles and removes them on detach."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..measure.graph_stats import constant_result
from ..process import said_once
from .skip import StepArgs, is_stand_in

if TYPE_CHECKING:
    from ..frames.param_index import ParamIndex

log = logging.getLogger(__name__)


_compiling = torch.compiler.is_compiling


def _may_break() -> bool:
    """At trace time: the step being compiled may be split around a hook (False under
    `fullgraph=True` or `error_on_graph_break`, where a split would fail the user's compile;
    said once, loudly, since the step guard and on_detect="skip" then cannot act)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx: Any = InstructionTranslator.current_tx()
        may = not (getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception as exc:  # an internal of torch's that moved: no split, and say so
        log.debug("tensorwatch_otel: cannot tell whether a compiled step may break: %s", exc)
        may = False
    if not may and said_once("compiled step in one graph"):
        log.error("tensorwatch_otel: an optimizer step is compiled into one graph (fullgraph=True): the "
                  "watcher's step hooks cannot run inside it, so this step's gradients are not checked "
                  "(guard_steps) and on_detect=\"skip\" cannot skip it; compile the step with "
                  "fullgraph=False (torch's own optimizers need it) to keep them; said once")
    return may


# called at trace time, its answer a constant of the graph being traced (marked for dynamo at
# the first watch(), with graph_stats' others: loading dynamo at import would cost a second, and
# import Triton before a test suite's device tests choose its interpreter)
_graph_may_break: Callable[[], bool] = constant_result(_may_break)


def outside_graphs(fn: Callable[..., Any], otherwise: Optional[Callable[..., Any]] = None) -> Callable[..., Any]:
    """`fn` (a global optimizer step hook, or a step's closure with its check) run at every
    step, compiled steps included.

    Dynamo would trace it into a compiled step (`torch.compile(lambda: opt.step())`): it would
    run once, at trace time, and never again, so a bad gradient would reach the weights
    unchecked. Disabled for dynamo, it splits the compiled step around it (torch's own optimizers
    split there anyway, around the update) and runs eagerly at every step. Where the step must be
    one graph, `otherwise` runs instead (None: nothing), said once (_graph_may_break)."""
    eager = torch._dynamo.disable(fn)

    def call(*args: Any, **kwargs: Any) -> Any:
        if _compiling() and not _graph_may_break():
            return otherwise(*args, **kwargs) if otherwise is not None else None
        return eager(*args, **kwargs)

    return call


class StepTracker:
    """Registers the global step hooks and tells the watcher which steps concern its model: an
    optimizer whose parameters include one the model holds (`index`, see core/frames/attach.py).
    `refresh()` runs first at every step, so parameters replaced since the last batch are found
    before the step is judged (a replaced parameter's id is never trusted)."""

    def __init__(self, index: ParamIndex, refresh: Callable[[], None], on_pre_step: Callable[..., Any],
                 on_post_step: Callable[[torch.optim.Optimizer], None]):
        self._index = index
        self._refresh = refresh
        # optimizer -> (its group sizes, the index generation, concerns the model)
        self._mine: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Tuple[Tuple[int, ...], int, bool]]" = \
            weakref.WeakKeyDictionary()
        self._on_pre = on_pre_step
        self._on_post = on_post_step
        self.steps = 0
        self.handles = [register_optimizer_step_pre_hook(outside_graphs(self._pre)),
                        register_optimizer_step_post_hook(outside_graphs(self._post))]

    def _concerns(self, optimizer: torch.optim.Optimizer) -> bool:
        groups = optimizer.param_groups
        key = tuple(len(g["params"]) for g in groups)
        generation = self._index.generation
        seen = self._mine.get(optimizer)
        if seen is not None and seen[0] == key and seen[1] == generation:
            return seen[2]
        holds = self._index.holds
        mine = any(holds(p) for g in groups for p in g["params"])
        try:
            self._mine[optimizer] = (key, generation, mine)
        except TypeError:
            pass
        return mine

    def _pre(self, optimizer: torch.optim.Optimizer, args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Optional[StepArgs]:
        if is_stand_in(optimizer):  # a skipped step's own super().step(): not a step of its own
            return None
        self._refresh()
        if self._concerns(optimizer):
            closure = args[1] if len(args) > 1 else kwargs.get("closure")  # (args[0] is the optimizer)
            # with a closure the step computes its gradients itself: they are checked after it;
            # new (args, kwargs) come back for that, or to skip the step (on_detect="skip")
            result: Optional[StepArgs] = self._on_pre(optimizer, closure if callable(closure) else None, args, kwargs)
            return result
        return None

    def _post(self, optimizer: torch.optim.Optimizer, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if not is_stand_in(optimizer) and self._concerns(optimizer):
            self.steps += 1
            self._on_post(optimizer)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
