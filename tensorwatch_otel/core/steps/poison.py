"""on_detect="skip": which gradients a non-finite forward spoilt. Its verdict belongs to the
gradients its backward writes, and goes with them.

A training forward that went non-finite cannot be undone, but the optimizer step that consumes
its gradients can be skipped, even when they look finite (an inf masked out before the loss).
The verdict is *armed* when the forward is detected. It *holds* once a backward takes that
forward: the backward passes through the forward's output (an autograd node hook, where the
output has one), or, where it has none (a compiled graph's output reaches the hook without its
node), the next backward writes the model's gradients. It *goes*:
- when a batch begins, or a step runs, before any backward took the forward (the loop dropped the
  batch: `continue` on a non-finite loss, a validation forward run with grad enabled, Lightning's
  `training_step` returning None);
- when the gradients it holds are zeroed or replaced: a gradient set to None or to another tensor,
  or written in place between two accumulations (`zero_grad(set_to_none=False)`; an accumulation
  adds exactly one to a gradient's version);
- when a step in a later batch than the one it skipped runs (the skip consumed it).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..events import NonFiniteEvent
from ..frames.finite import graph_tensors

class ForwardPoison:
    """The verdict of one non-finite training forward (see the module's docstring)."""

    def __init__(self, event: NonFiniteEvent, params: List[torch.Tensor]) -> None:
        self.event = event
        self.held = False  # a backward took the forward: the gradients hold its values
        self.gone = False
        self.bound = False  # its forward's output was looked at (bind)
        self._by_node = False  # held when a backward reaches the output's node (else: any accumulation)
        self.skipped_in: Optional[int] = None  # the batch in which it skipped a step
        # id(parameter) -> (its gradient, the gradient's version after the last accumulation)
        self._marks: Dict[int, Tuple["weakref.ref[torch.Tensor]", "weakref.ref[torch.Tensor]", int]] = {}
        self._handles: List[Any] = []
        for p in params:
            try:
                self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
            except RuntimeError:  # not a leaf (a view of a flat parameter): its gradient is not followed
                continue

    def bind(self, output: Any) -> None:
        """The forward's output, as its outermost call returned it: the verdict holds once a
        backward passes through one of its autograd nodes. An output without any (a compiled
        graph's, seen from inside the graph) leaves the verdict to the next accumulation."""
        self.bound = True
        nodes = [t.grad_fn for t in graph_tensors(output) if t.grad_fn is not None]
        for node in nodes[:8]:
            try:
                self._handles.append(node.register_prehook(self._reached))
                self._by_node = True
            except RuntimeError:
                continue

    def _reached(self, grad_outputs: Any) -> None:
        self.held = True

    def _accumulated(self, p: torch.Tensor) -> None:
        """A parameter's gradient was just accumulated (a backward wrote it)."""
        if self.gone:
            return
        if not self._by_node:
            self.held = True
        if not self.held:
            return  # another graph's backward, before this forward's
        g = p.grad
        if g is None:
            return
        mark = self._marks.get(id(p))
        if mark is not None and (mark[1]() is not g or g._version != mark[2] + 1):
            self._lose()  # the gradient this forward spoilt was zeroed or replaced since
            return
        self._marks[id(p)] = (weakref.ref(p), weakref.ref(g), g._version)

    def spoils_step(self) -> bool:
        """The step about to run consumes gradients this forward spoilt. False (and the verdict
        goes) when no backward took the forward, or its gradients were set to None or replaced."""
        if self.gone:
            return False
        if not self.held:
            self._lose()
            return False
        for pref, gref, _ in self._marks.values():
            p = pref()
            if p is None or p.grad is None or p.grad is not gref():
                self._lose()
                return False
        return True

    def batch_begins(self) -> None:
        """A new batch begins: a forward no backward took by now was dropped by the loop."""
        if not self.held:
            self._lose()

    def _lose(self) -> None:
        self.gone = True
        self.remove()

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
