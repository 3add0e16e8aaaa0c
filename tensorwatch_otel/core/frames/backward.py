"""The backward pass as the watcher sees it (`gradients=True`): parameter gradients after
accumulation, and activation gradients at each module's outputs and inputs, measured at the
tensors (tensor hooks registered in the forward, no module backward hooks: in-place ops and
views on hooked outputs stay legal). Frames come in backward order, so the first non-finite
one names the module whose backward produced it."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

import torch

from .. import naming
from ..frame_draft import FrameDraft, ModuleInfo
from ..record import Record
from ..measure.stats import Pair, measure

log = logging.getLogger(__name__)

MAX_OUTPUTS = 16  # tensors hooked per module output (a tuple / ModelOutput)


class BackwardHost(Protocol):
    """What the backward recorder asks of the rest of its watch (the watch's session,
    core/session.py)."""

    def last_batch(self) -> int:
        """The batch a backward belongs to: the one begun last."""

    def backward_watched(self) -> bool:
        """The watcher is attached and records the batch of the backward running now."""

    def backward_done(self, rec: Record, owners: List[Optional[torch.Tensor]], gids: List[int]) -> None:
        """A backward's record, when the autograd engine finishes (owners[i] is the parameter of
        frame i, None for activations; gids[i] the id of its gradient tensor)."""

    def failed(self, info: ModuleInfo, exc: Exception) -> None:
        """A hook that could not record: counted, the first said."""


class BackwardRecorder:
    """Builds one backward Record per backward pass and hands it to `host.backward_done` when
    the autograd engine finishes."""

    def __init__(self, host: BackwardHost) -> None:
        self._batch = host.last_batch
        self._watches = host.backward_watched
        self._on_end = host.backward_done
        self._failed = host.failed
        self._rec: Optional[Record] = None
        self._owners: List[Optional[torch.Tensor]] = []
        self._gids: List[int] = []  # id of the gradient tensor behind each frame
        # id(grad) -> (weakref, stats, dtype): one tensor, one measurement
        self._seen: Dict[int, Tuple[weakref.ref[torch.Tensor], Pair, torch.dtype]] = {}

    def _record(self) -> Record:
        rec = self._rec
        if rec is None:
            rec = self._rec = Record(self._batch(), phase="backward")
            self._owners = []
            self._gids = []
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        return rec

    def _frame(self, info: ModuleInfo, name: str, g: torch.Tensor, owner: Optional[torch.Tensor]) -> None:
        rec = self._record()
        d = FrameDraft()
        seen = self._seen.get(id(g))
        if seen is not None and seen[0]() is g:
            d.add(name, seen[1], seen[2])
        else:
            r = measure(g)
            d.add(name, r, g.dtype)
            if not isinstance(r, str):  # a pair, kept for the same gradient seen again
                try:
                    self._seen[id(g)] = (weakref.ref(g), r, g.dtype)
                except TypeError:
                    pass
        rec.add_frame(info, d)
        self._owners.append(owner)
        self._gids.append(id(g))

    # ------------------------------------------------------------------ parameter gradients
    def param_hook(self, info: ModuleInfo, name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self._watches():
                return
            g = p.grad
            if g is None:
                return
            try:
                with torch.no_grad():
                    self._frame(info, name, g, p)
            except Exception as exc:
                self._failed(info, exc)
        return hook

    # ------------------------------------------------------------------ activation gradients
    def hook_activations(self, info: ModuleInfo, args: Tuple[Any, ...], output: Any) -> None:
        """In a module's forward hook: hook the gradients of its outputs and inputs."""
        for name, t in _tensors(output, "output"):
            self._hook_tensor(info, name + ".grad", t)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                self._hook_tensor(info, naming.input_name(i) + ".grad", a)

    def _hook_tensor(self, info: ModuleInfo, name: str, t: torch.Tensor) -> None:
        if not t.requires_grad:
            return

        def hook(g: Optional[torch.Tensor]) -> None:
            if g is not None:
                try:
                    with torch.no_grad():
                        self._frame(info, name, g, None)
                except Exception as exc:
                    self._failed(info, exc)

        try:
            t.register_hook(hook)
        except RuntimeError as exc:  # e.g. a tensor that cannot hold hooks
            self._failed(info, exc)

    def _end(self) -> None:
        rec, self._rec = self._rec, None
        owners, self._owners = self._owners, []
        gids, self._gids = self._gids, []
        self._seen.clear()
        if rec is not None and rec.frame_count:
            self._on_end(rec, owners, gids)


def producer_frame(rec: Record, fi: int, gids: List[int]) -> int:
    """The frame that names who made the gradient of frame `fi`: a gradient seen first as
    module A's `output.grad` is the same tensor as its consumer B's `input[i].grad`, and it was
    B's backward that produced it."""
    items = rec.frame_items(fi)
    name = items[0] if items and items[0].__class__ is str else ""
    if not name.startswith("output"):
        return fi
    for j in range(fi + 1, rec.frame_count):
        if gids[j] == gids[fi]:
            later = rec.frame_items(j)
            item = later[0] if later else ""
            if item.__class__ is str and item.startswith("input"):
                return j
    return fi


def _tensors(v: Any, name: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """Top-level tensors of an output value: a tensor, a tuple/list, a dict or ModelOutput."""
    if isinstance(v, torch.Tensor):
        yield name, v
    elif isinstance(v, (tuple, list)):
        for i, x in enumerate(v[:MAX_OUTPUTS]):
            if isinstance(x, torch.Tensor):
                yield naming.child(name, i), x
    elif isinstance(v, dict):
        for n, (k, x) in enumerate(v.items()):
            if n >= MAX_OUTPUTS:
                break
            if isinstance(x, torch.Tensor):
                yield naming.child(name, str(k)), x
