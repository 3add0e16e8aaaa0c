"""Module calls inside torch.func transforms (vmap, grad, jvp, functionalize, functional_call
under them) and while torch.jit.trace traces.

A transform hands the modules wrapper tensors (BatchedTensor, GradTrackingTensor, functional
tensors) that hold no storage of their own: reading one for the batch's read-back fails, and
the CPU kernel would read a null address. Their frames are taken by an `UnwrappedRecorder`: each
tensor is measured through the plain tensor it wraps (under vmap: every sample's values at
once, as in a batched call), with the transforms set aside so that the statistics are plain
tensors too; said once per watcher at INFO. An unsampled batch's output is checked through the
plain tensors it wraps in the same way. While jit.trace traces, the hooks do nothing: any op
they ran would be traced into the graph.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from ..frame_stats import NOTE_NO_DATA
from .finite import all_finite
from ..frame_draft import FrameDraft, ModuleInfo
from ..record import Record
from .recorder import FrameRecorder
from ..measure.stats import measure_host

log = logging.getLogger(__name__)

_functorch: Any = getattr(torch._C, "_functorch", None)
_sync: Callable[[torch.Tensor], None] = vars(torch)["_sync"]  # (not among torch's declared names)
# torch.func transforms running in this thread (False on a torch without them)
active: Callable[[], bool] = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
# the jit tracer's state while torch.jit.trace traces, else None
tracing: Callable[[], object] = torch._C._get_tracing_state


def _clear_stack() -> Optional[Callable[[], "contextlib.AbstractContextManager[object]"]]:
    try:
        from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    except ImportError:  # an older torch: frames inside transforms are noted, not measured
        return None
    return temporarily_clear_interpreter_stack


_CLEAR_STACK = _clear_stack()


def plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor a transform's wrapper holds (`t` itself when it is none); raises when
    it cannot be unwrapped, or when the transforms cannot be set aside (ops on it would give
    wrappers again). A functional tensor is synced first (view writes it has pending)."""
    if _CLEAR_STACK is None:
        raise RuntimeError("this torch cannot set its torch.func transforms aside")
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_functionaltensor(t):
            _sync(t)
        t = _functorch.get_unwrapped(t)
    return t


def all_finite_plain(tensors: Sequence[torch.Tensor], fused: Tuple[str, ...]) -> bool:
    """finite.all_finite of tensors made inside transforms (an unsampled batch's output): read
    through the plain tensors they wrap, the transforms set aside (one read, as outside them)."""
    with set_aside():
        return all_finite([plain(t) for t in tensors], fused)


@contextlib.contextmanager
def set_aside() -> Iterator[None]:
    """The transforms of this thread set aside (put back after): ops on the unwrapped tensors
    give plain tensors, not wrappers of the transforms' levels (`plain` refuses every tensor on
    a torch that cannot set them aside)."""
    if _CLEAR_STACK is None:
        yield
        return
    with _CLEAR_STACK():
        yield


class UnwrappedRecorder(FrameRecorder):
    """Frames of module calls inside torch.func transforms: the parameters, inputs and outputs
    measured through the plain tensors they wrap, without the caches (a transform's tensors are
    made for the call, and its parameters often lent by functional_call). Run its frames inside
    `set_aside()`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._said = False
        self._failed = False

    def say_once(self) -> None:
        if not self._said:
            self._said = True
            log.info("tensorwatch_otel: module calls inside torch.func transforms (vmap, grad, jvp, functionalize) "
                     "are measured through the tensors the transforms wrap (under vmap: every sample at once)")

    def frame(self, rec: Record, info: ModuleInfo, args: Any, kwargs: Optional[Dict[str, object]],
              output: object) -> None:
        d = FrameDraft()
        try:
            self._frame(rec, info, d, args, kwargs, output)
        except BaseException:
            self._fb.abandon()
            raise
        rec.add_frame(info, d)

    def params(self, rec: Record, info: ModuleInfo, d: FrameDraft) -> None:
        for name, p in info.params.items():
            if p is not None:
                self.tensor(rec, p, name, d)

    def param(self, rec: Record, p: torch.Tensor, name: str, d: FrameDraft) -> None:
        self.tensor(rec, p, name, d)

    def tensor(self, rec: Record, t: torch.Tensor, name: str, d: FrameDraft) -> None:
        try:
            v = plain(t)
        except Exception as exc:  # a wrapper this torch cannot open: noted, said once
            if not self._failed:
                self._failed = True
                log.warning("tensorwatch_otel: cannot read a tensor inside a torch.func transform (%s: %s); "
                            "reported without statistics", type(exc).__name__, exc)
            d.items.append((name, NOTE_NO_DATA))
            return
        if rec.targets:
            self._magnitudes.measure(rec, v, name, d)
            return
        d.add(name, measure_host(v), v.dtype)
