"""Unsampled batches without hooks: the forward hooks of every hooked module but the root are
taken off for a batch `every_n_batches` does not record, so its inner calls take torch's fast
call path. A module with a forward hook goes through torch's slow path (a closure, the hook
loops) even when the hook returns at once; with thousands of small modules that alone is a
large share of the forward (measured: docs/performance.md).

The hooks stay off from one unsampled batch to the next, and come back when a recorded batch
begins. Between two batches a *sentry* (a global forward pre-hook, one dict entry) sees every
module call in the process: a call of one of the modules whose hooks are off (a submodule called
directly, a checkpoint recomputation, another thread) puts every hook back first and runs that
module's pre-hook itself (torch has already picked the hooks it runs for that call), so the call
is seen exactly as with the hooks on. A call of the root, or of the module whose call began the
last batch, takes the sentry off: both keep their hooks, and their pre-hook decides for the
batch the call begins. Taking 10,000 hooks off or putting them back touches 10,000 dicts no
longer in cache (its cost: docs/performance.md, "Figures behind the code"); the sentry keeps
that to once per recorded batch, not twice per batch.

Only hooks alone in their dict are taken off (a module's pre-hook and hook both, or neither), so
one put back at the end of its dict is where it was; a module with other hooks (FSDP's, the
user's) keeps ours. Whenever dynamo starts compiling (a compile-start callback, placed again
after a `torch._dynamo.reset()` clears it) every hook goes back before it traces: a graph must
see them all. Off for good once a compiled graph holding a watcher's hooks has run (graphs
guard on the hook dicts: taking hooks off and on would recompile them), once another model
runs between two unsampled batches (FOREIGN_CALLS calls of modules not the watcher's there: a
teacher, a reference model, a second watched model; a loss module's call or a few do not count
as one: with the sentry up each such call takes torch's slow path and calls the sentry, a cost
that falls on that model; with the hooks on it falls on the watched model alone), once a
second thread begins a batch (its first call could reach a submodule without hooks during one
of our batches, where no sentry is), with a torch that has no compile-start callbacks, or
after a failure."""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict, deque
from itertools import repeat
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from . import compiled

log = logging.getLogger(__name__)

_pop = OrderedDict.pop
_put = OrderedDict.__setitem__

# a module's forward pre-hook's and hook's places: (its hook dict, the hook's key) each
Places = List[Tuple[Any, int]]


_instances: "weakref.WeakSet[QuietBatches]" = weakref.WeakSet()

#: Calls of modules not the watcher's between two unsampled batches that turn quiet batches off
#: (another model runs there). Fewer (a loss module, a metric) leave them on: each such call
#: costs a few microseconds with the sentry up.
FOREIGN_CALLS = 64


def _compile_starts(_args: object) -> None:
    """dynamo starts compiling a frame (before it traces): every hook back, so that the graph
    sees them all. (If the frame holds our hooks, its graph's first run turns quiet batches off
    for good: compiled.ran.)"""
    for q in list(_instances):
        q.put_back()


def _listening() -> bool:
    """_compile_starts is among dynamo's compile-start callbacks (placed again after a
    `torch._dynamo.reset()`, which clears them); False when this torch has none."""
    try:
        from torch._dynamo.callback import callback_handler

        if _compile_starts not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_compile_starts)
        return True
    except Exception as exc:  # a torch without them: hooks are never taken off
        log.debug("tensorwatch_otel: no compile-start callback in this torch (%s: %s)", type(exc).__name__, exc)
        return False


def _place_sentry(q: "QuietBatches") -> RemovableHandle:
    """The global pre-hook for `q`, placed; it holds `q` by weak reference, so a watcher and
    model dropped without detach() are freed as before (the hook then takes itself off)."""
    ref = weakref.ref(q)
    own: List[RemovableHandle] = []

    def sentry(module: torch.nn.Module, args: Tuple[Any, ...]) -> None:
        live = ref()
        if live is not None:
            live._at_call(module, args)
        elif own:
            own.pop().remove()
    own.append(register_module_forward_pre_hook(sentry))
    return own[0]


class QuietBatches:
    """The hooks an unsampled batch takes off, for one watched model (the root keeps its own,
    and so does the module whose call began the batch).

    `set_places` says where the hooks sit (after each walk of the model, with every hook on),
    `take_off(entry)` takes them off for a batch begun by a call of `entry` (True when they are),
    `rest()` leaves them off after that batch with the sentry placed, `put_back()` puts every
    hook back (idempotent), `turn_off(why)` puts them back for good."""

    def __init__(self, root: torch.nn.Module) -> None:
        self._root = root
        self._dicts: List["OrderedDict[int, Any]"] = []  # pre, post, pre, post...: two per module
        self._keys: List[int] = []
        self._pre_at: Dict[int, int] = {}  # id(module) -> its pre-hook's place
        self._taken: Optional[List[Any]] = None  # while off: what each place held (None: kept on)
        self._sentry: Optional[RemovableHandle] = None
        self._off = not _listening()
        self._ran = compiled.ran.calls  # compiled graphs' pre ops run before this model was watched
        self._lock = threading.Lock()
        self._foreign = 0  # calls of other models' modules since the sentry was placed
        _instances.add(self)

    @property
    def off(self) -> bool:
        """Hooks are off now (between or inside unsampled batches)."""
        return self._taken is not None

    def set_places(self, modules: List[Tuple[torch.nn.Module, Places]]) -> None:
        """Where the hooks of these modules (every hooked one but the root) sit."""
        self.put_back()
        dicts: List["OrderedDict[int, Any]"] = []
        keys: List[int] = []
        pre_at: Dict[int, int] = {}
        for module, places in modules:
            if len(places) == 2 and all(type(d) is OrderedDict for d, _ in places):
                pre_at[id(module)] = len(dicts)
                for d, k in places:
                    dicts.append(d)
                    keys.append(k)
        self._dicts, self._keys, self._pre_at = dicts, keys, pre_at

    def take_off(self, entry: Optional[torch.nn.Module]) -> bool:
        """The hooks off for an unsampled batch begun by a call of `entry` (which keeps its
        own, as the root does): True when they are."""
        self._drop_sentry()
        if self._taken is not None:
            return True  # still off since the last unsampled batch (entry's are on: they ran)
        if self._off or not self._dicts:
            return False
        if compiled.ran.calls != self._ran or getattr(self._root, "_compiled_call_impl", None) is not None \
                or not _listening():
            self.turn_off("the model runs compiled, or dynamo cannot say when it compiles")
            return False
        with self._lock:
            if self._off:
                return False
            try:
                if set(map(len, self._dicts)) == {1}:  # every hook alone in its dict: all of them, in C
                    self._taken = list(map(_pop, self._dicts, self._keys, repeat(None)))
                else:
                    self._taken = self._take_alone()
                i = self._pre_at.get(id(entry))
                if i is not None and self._taken[i] is not None:  # the call running now: its hooks stay
                    _put(self._dicts[i], self._keys[i], self._taken[i])
                    _put(self._dicts[i + 1], self._keys[i + 1], self._taken[i + 1])
                    self._taken[i] = self._taken[i + 1] = None
            except Exception as exc:  # (never expected) a dict that is not torch's OrderedDict
                self._taken = None
                self._off = True
                log.warning("tensorwatch_otel: could not take the hooks off for an unsampled batch "
                            "(%s: %s); they stay on", type(exc).__name__, exc)
                return False
        return True

    def _take_alone(self) -> List[Any]:
        d, k = self._dicts, self._keys
        taken: List[Any] = [None] * len(d)
        for i in range(0, len(d), 2):  # a module's pre-hook and hook: both or neither
            if len(d[i]) == 1 and len(d[i + 1]) == 1 and k[i] in d[i] and k[i + 1] in d[i + 1]:
                taken[i] = _pop(d[i], k[i])
                taken[i + 1] = _pop(d[i + 1], k[i + 1])
        return taken

    def rest(self) -> None:
        """An unsampled batch ended with the hooks off: they stay off, the sentry watches."""
        if self._taken is None or self._sentry is not None:
            return
        if not _listening():  # (a reset since the batch began)
            self.turn_off("dynamo cannot say when it compiles")
            return
        try:
            self._foreign = 0
            self._sentry = _place_sentry(self)
        except Exception as exc:  # (never expected): the hooks go back
            self.turn_off(f"the sentry could not be placed ({type(exc).__name__}: {exc})")

    def put_back(self) -> None:
        """Every hook taken off, back in its place; the sentry gone. Idempotent."""
        self._drop_sentry()
        if self._taken is None:
            return
        with self._lock:
            taken, self._taken = self._taken, None
            if taken is None:
                return
            if None not in taken:
                deque(map(_put, self._dicts, self._keys, taken), 0)
            else:
                for d, k, fn in zip(self._dicts, self._keys, taken):
                    if fn is not None:
                        d[k] = fn

    def turn_off(self, why: str) -> None:
        """No batch takes hooks off from now on (those off now go back)."""
        if self._off:
            return
        self._off = True
        was_off = self._taken is not None
        self.put_back()
        log.debug("tensorwatch_otel: unsampled batches keep every hook on from now on (%s)%s", why,
                  "; the hooks taken off are back" if was_off else "")

    def _drop_sentry(self) -> None:
        sentry, self._sentry = self._sentry, None
        if sentry is not None:
            sentry.remove()

    def _at_call(self, module: torch.nn.Module, args: Tuple[Any, ...]) -> None:
        """The sentry: a module called between two unsampled batches."""
        i = self._pre_at.get(id(module))
        if i is None:
            if module is self._root:
                self._drop_sentry()  # the root keeps its hooks: its pre-hook decides
            else:  # another model's module (a loss module, a second model) between our batches
                self._foreign += 1
                if self._foreign >= FOREIGN_CALLS:  # another model runs here: it would pay for the sentry
                    self.turn_off(f"{FOREIGN_CALLS} calls of other modules between two unsampled batches (while "
                                  "the sentry is up, every module call in the process takes torch's slower "
                                  "hooked path)")
            return
        taken = self._taken
        if taken is None or self._dicts[i] is not module._forward_pre_hooks:
            return  # (another module at a freed one's address)
        pre = taken[i]
        if pre is None:
            self._drop_sentry()  # its hooks are on (the last batch's entry): its pre-hook decides
            return
        try:
            self.put_back()
        except Exception as exc:  # (never expected)
            log.warning("tensorwatch_otel: could not put the hooks back (%s: %s)", type(exc).__name__, exc)
            return
        pre(module, args)  # torch picked this call's hooks before we put its pre-hook back
