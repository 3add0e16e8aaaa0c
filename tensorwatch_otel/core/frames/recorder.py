"""What one module call contributes to a batch record: its own parameters, its inputs and its
outputs, measured on the device. Caches keep each distinct tensor measured once per batch.

On a CPU with the compiled kernel (core/measure/cpu_kernel.py) a module call's dense float tensors are
gathered while its hook walks them and measured in one kernel call before the hook returns (so
an output a later in-place op changes is still measured as it was when its module returned);
their values are Python floats in the record at once: nothing to stack or copy at the batch's
read-back. On the device path (core/measure/device_stats.py: CUDA with Triton) the same gathered tensors
are measured by one fused kernel launch per module call into the batch's slot buffer, and the
record holds their slots until the batch's one copy. Elsewhere (odd tensors, float64 on a
device) each tensor gives two 0-d device tensors, read back with the batch."""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from .. import naming
from ..frame_stats import NOTE_NONE, NOTE_NOT_TENSOR, TensorStat
from ..frame_draft import FrameDraft, Item, ModuleInfo, Stat
from ..record import Record
from ..measure.cpu_kernel import CODES, KERNEL
from ..measure.device_path import wanted as device_path_wanted
from ..measure.device_stats import DeviceStats
from ..measure.slot_buffer import SlotStat
from ..measure.stats import host_readable, measure_host as measure
from ..measure.weights import NoWeightTable, WeightTable, takes
from .detection_kind import exact_kind
from .finite import tensor_attributes
from .device_calls import INPUT0, device_call, usable
from .frame_batch import UNREAD, ActsSeen, FrameBatch, ParamsSeen, StatPair
from .magnitude_frames import MagnitudeFrames

MAX_ITEMS, MAX_DEPTH = naming.MAX_ITEMS, naming.MAX_DEPTH  # (values per container, so odd outputs stay bounded)
_PLAIN = (torch.nn.Parameter, torch.Tensor)  # data_ptr() is cheap and defined for these
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled
_TENSOR = torch.Tensor
_STRIDED = torch.strided



class FrameRecorder:
    """Measures tensors into a Record. Weights are measured once per batch unless they are
    known unchanged; an activation seen as one module's output and the next one's input (the
    same object at the same version) is measured once."""

    def __init__(self, model: torch.nn.Module) -> None:
        # the device path (core/measure/device_stats.py), decided when the recorder is made
        self._device = DeviceStats() if device_path_wanted() else None
        # id(param) -> (param, version, data_ptr, dtype, (mn, mx)); cleared by invalidate_weights()
        # (keyed by id: a tensor's own __hash__ is a Python call, and the entry holds the param)
        self.params_seen: ParamsSeen = {}
        # Replaced parameters (functional_call, re-created weights) would stay alive as keys:
        # past this size the cache is dropped at a batch end and simply refilled.
        self.params_cap = 2 * sum(1 for _ in model.parameters()) + 64
        self.acts_seen: ActsSeen = {}  # id -> (weakref, version, (mn, mx), dtype)
        self.acts_last: ActsSeen = {}  # the last finished batch's, for a detection's kind
        self._magnitudes = MagnitudeFrames()  # target_dtypes: the counts rows (core/frames/magnitude_frames.py)
        self._fb = FrameBatch(self._device)  # the calling thread's frame in progress
        # small dense CPU weights: one kernel call per batch for all of them (core/measure/weights.py)
        self._host: Optional[Callable[[torch.Tensor], Tuple[float, float]]] = None  # the kernel's host call...
        self._host_of: object = None  # ...as looked up for this weight-table read (_one_in_one_out),
        self._host_call: Optional[Callable[[int, int, int], Tuple[float, float]]] = None  # its call on an address
        self._parallel_min = 0  # elements from which the kernel's host() splits a tensor over threads
        self.weights = NoWeightTable() if self._device is not None and self._device.cpu else WeightTable()
        self._declined: set[int] = set()  # ids of weights that cannot be rows
        # id(module info) -> the items list of its last frame: a frame with the same items holds
        # that list, not one of its own (a recorded batch keeps a frame per call until its end:
        # one object fewer each for the garbage collector to track and to promote). Keyed by id,
        # holding no module info (nor, through it, a replaced module's parameters): only the
        # list's contents matter, and a list equal to a frame's is that frame's list.
        self._items_of: Dict[int, List[Item]] = {}

    @property
    def device_stats(self) -> Optional[DeviceStats]:
        """The device path's slot buffers (None: this recorder's devices take the other routes)."""
        return self._device

    def invalidate_weights(self) -> None:
        self.params_seen.clear()
        self._magnitudes.clear()
        self.weights.invalidate()

    def weights_replaced(self) -> None:
        """The model's parameters were replaced: the weight table is made again from the frames,
        and the cache lets the replaced ones go (it held them as keys until its cap)."""
        self.weights.unknown()
        self._declined.clear()
        self.params_seen.clear()
        self._magnitudes.clear()

    def end_batch(self) -> None:
        self.weights.end_batch()
        self.acts_last, self.acts_seen = self.acts_seen, {}
        self._magnitudes.clear()
        if len(self.params_seen) > self.params_cap:
            self.params_seen.clear()
        if len(self._items_of) > self.params_cap:  # (ids of module infos gone since)
            self._items_of.clear()

    def clear(self) -> None:
        self.weights.drop()
        self._items_of.clear()
        self._declined.clear()
        self.params_seen.clear()
        self.acts_seen.clear()
        self.acts_last.clear()
        self._magnitudes.clear()

    # ------------------------------------------------------------------ a detection
    def kind(self, rec: Record, fi: int, stat: Optional[TensorStat]) -> str:
        """The kind of the detection's tensor `stat` (frame `fi` of `rec`), its own
        (core/frames/detection_kind.py)."""
        return exact_kind(rec, fi, stat, self._measured)

    def _measured(self, mn: Union[torch.Tensor, float, SlotStat]) -> Optional[torch.Tensor]:
        """The tensor whose measurement gave `mn`, when it is still alive."""
        for seen in self.params_seen.values():
            if seen[4][0] is mn:
                return seen[0]
        for acts in (self.acts_seen, self.acts_last):
            for ref, _, r, _ in acts.values():
                if r[0] is mn:
                    return ref()
        return None

    # ------------------------------------------------------------------ a module call
    def frame(self, rec: Record, info: ModuleInfo, args: Tuple[object, ...], kwargs: Optional[Dict[str, object]],
              output: object) -> None:
        """The full view: parameters, every positional and keyword input, any output value.
        Autograd is off while it measures (a caller need not turn it off), except on the C
        kernel's one-in-one-out route, which runs no torch op (two calls a frame saved there)."""
        simple = output.__class__ is _TENSOR and len(args) == 1 and not kwargs and not rec.targets \
            and args[0].__class__ is _TENSOR
        device = self._device
        if simple and device is None and self._one_in_one_out(rec, info, args[0], output):  # type: ignore[arg-type]
            return
        grad = _grad_enabled()
        _set_grad(False)  # (torch.no_grad() without its three Python calls)
        try:
            if simple and device is not None and device_call(device, self.params_seen, self.acts_seen, rec, info,
                                                             args[0], output):  # type: ignore[arg-type]
                return
            d = FrameDraft()
            fb = self._fb
            fb.start()
            try:
                self._frame(rec, info, d, args, kwargs, output)
                fb.finish(rec, d, info, self.params_seen, self.acts_seen, self._magnitudes.counted)
            except BaseException:
                fb.abandon()
                raise
            d.items = self._shared(info, d.items)
            rec.add_frame(info, d)
        finally:
            _set_grad(grad)

    def _shared(self, info: ModuleInfo, items: List[Item]) -> List[Item]:
        """`items`, or the equal list that module `info`'s last frame holds (a record's items
        lists are read, never written: see Record)."""
        last = self._items_of.get(id(info))
        if last == items:
            return last
        self._items_of[id(info)] = items
        return items

    def _one_in_one_out(self, rec: Record, info: ModuleInfo, x: torch.Tensor, y: torch.Tensor) -> bool:
        """The commonest frame (a module of small CPU weights, one tensor in, one out) taken in a
        few lines: the same record and caches as `_frame`, when its weights are all rows of this
        batch's weight-table read and its input and output are tensors the kernel reads as they
        are (each measured here unless measured earlier in the batch and unchanged since: an
        output passed on as the next module's input is read once). False, with nothing written,
        for any other frame (`_frame` takes it)."""
        table = self.weights.state()
        if table is None:
            return False
        rows, vals, versions, ptrs, dtypes = table
        items: List[Item] = []
        stats: List[Stat] = []
        rec_dtypes: List[torch.dtype] = []
        for name, p in info.params.items():  # first: a module of large weights leaves at once
            if p is None:
                continue
            i = rows.get(id(p))
            if i is None or p._version != versions[i] or p.data_ptr() != ptrs[i] or p.dtype is not dtypes[i]:
                return False  # (the lists are this call's own: nothing written)
            stats.append(vals[2 * i])
            stats.append(vals[2 * i + 1])
            rec_dtypes.append(dtypes[i])
            items.append(name)
        # host_readable(y), written out: a call per frame is a cost here (docs/performance.md)
        code = CODES.get(y.dtype)
        if y is x or code is None or not (y.is_cpu and y.layout is _STRIDED and y.is_contiguous()
                                           and not y.is_inference()):
            return False
        n = y.numel()
        if not n:
            return False
        acts_seen = self.acts_seen
        seen = acts_seen.get(id(x))
        # (a cached x is the live tensor of that entry: it has a version counter)
        x_cached = seen is not None and seen[0]() is x and seen[1] == x._version
        if not x_cached and not host_readable(x):
            return False
        if self._host_of is not table:  # (the kernel's calls, looked up again with each table read)
            self._host_of = table
            kernel = KERNEL.get()
            self._host = getattr(kernel, "host", None)
            self._host_call = getattr(kernel, "host_call", None)
            self._parallel_min = getattr(kernel, "parallel_min", 0)  # (below it: one thread, host_call)
        host = self._host
        if host is None:
            return False
        if not x_cached:
            seen = acts_seen[id(x)] = (weakref.ref(x), x._version, host(x), x.dtype)
        out = acts_seen.get(id(y))  # (an output passed up unchanged: measured once)
        if out is None or out[0]() is not y or out[1] != y._version:
            call = self._host_call  # (a small y: the kernel's call on (address, elements, code) at once)
            pair = call(y.data_ptr(), n, code) if call is not None and n < self._parallel_min else host(y)
            out = acts_seen[id(y)] = (weakref.ref(y), y._version, pair, y.dtype)  # as at its return
        assert seen is not None
        stats += seen[2]
        rec_dtypes.append(seen[3])
        stats += out[2]
        rec_dtypes.append(out[3])
        items.append(INPUT0)
        items.append("output")
        rec.add_lists(info, self._shared(info, items), stats, rec_dtypes, None, len(stats))  # (a draft's lists)
        return True

    def _frame(self, rec: Record, info: ModuleInfo, d: FrameDraft, args: Tuple[object, ...],
               kwargs: Optional[Dict[str, object]], output: object) -> None:
        """Fill `d` with the frame (the caller hands it to the record)."""
        self.params(rec, info, d)
        value = self.value
        for i, a in enumerate(args):
            value(rec, a, naming.input_name(i), d, 0)
        if kwargs:
            kw_names = info.kw_names
            for k, v in kwargs.items():
                name = kw_names.get(k)
                if name is None:
                    name = kw_names[k] = f"input.{k}"
                value(rec, v, name, d, 0)
        value(rec, output, "output", d, 0)

    def params(self, rec: Record, info: ModuleInfo, d: FrameDraft) -> None:
        if info.lent:  # new tensors each call (core/frames/offload.py): no cache or table row would hit
            for name, p in info.params.items():
                if p is not None:
                    self._uncached(rec, p, name, d)
            return
        table = None if rec.targets else self.weights.state()
        if table is None:  # no kernel (or target_dtypes: counts per weight): one by one
            for name, p in info.params.items():
                if p is not None:
                    self.param(rec, p, name, d)
            return
        # this batch's one read of the small CPU weights (core/measure/weights.py): a weight still the
        # row's tensor at the row's version, address and dtype takes its values from the row
        rows, vals, versions, ptrs, dtypes = table
        items, stats, rec_dtypes = d.items, d.stats, d.dtypes
        for name, p in info.params.items():
            if p is None:
                continue
            i = rows.get(id(p))  # (the row rule: the same test as in _one_in_one_out)
            if i is not None:
                if p._version == versions[i] and p.data_ptr() == ptrs[i] and p.dtype is dtypes[i]:
                    stats.append(vals[2 * i])
                    stats.append(vals[2 * i + 1])
                    rec_dtypes.append(dtypes[i])
                    items.append(name)
                    continue
            elif id(p) not in self._declined and not (takes(p) and self.weights.offer(p)):  # a row next read
                self._declined.add(id(p))  # not one, ever (an id reused later only means the slower path)
            self.param(rec, p, name, d)

    def value(self, rec: Record, v: object, name: str, d: FrameDraft, depth: int) -> None:
        """Any input/output value: tensors are measured, containers walked, others noted."""
        if isinstance(v, torch.Tensor):
            self.tensor(rec, v, name, d)
        elif v is None:
            d.items.append((name, NOTE_NONE))
        elif depth >= MAX_DEPTH:
            d.items.append((name, NOTE_NOT_TENSOR))
        elif isinstance(v, (tuple, list)):
            child = naming.child
            for i, x in enumerate(v[:MAX_ITEMS]):
                self.value(rec, x, child(name, i), d, depth + 1)
        elif isinstance(v, dict):  # includes transformers' ModelOutput
            child = naming.child
            for n, (k, x) in enumerate(v.items()):
                if n >= MAX_ITEMS:
                    break
                self.value(rec, x, child(name, k if isinstance(k, str) else str(k)), d, depth + 1)
        else:
            fields = naming.dataclass_fields(v) or tensor_attributes(v)
            if fields:
                child = naming.child
                for f in fields[:MAX_ITEMS]:
                    self.value(rec, getattr(v, f, None), child(name, f), d, depth + 1)
            else:
                d.items.append((name, NOTE_NOT_TENSOR))

    def param(self, rec: Record, p: torch.Tensor, name: str, d: FrameDraft) -> None:
        # A weight is reused while nothing wrote it: the cache is dropped at every optimizer
        # step, and the key holds version, storage and dtype (`.half()`, `.to()`, `.data =`).
        if p.is_inference():  # made under inference_mode: no version to cache it by
            self._uncached(rec, p, name, d)
            return
        if rec.targets:
            return self._magnitudes.param(rec, p, name, d, self.params_seen, self._fb)
        seen = self.params_seen.get(id(p))
        version = p._version
        ptr = p.data_ptr() if p.__class__ in _PLAIN else id(p)
        if seen is not None and seen[0] is p and seen[1] == version and seen[2] == ptr and seen[3] is p.dtype \
                and usable(self._device, rec, seen[4]):
            d.stats += seen[4]
            d.dtypes.append(seen[3])
            d.items.append(name)
            return
        fb = self._fb
        if fb.on and fb.gather.add(p):  # measured with the frame's others (FrameBatch.finish)
            fb.pending.append((len(d.stats), p, True, version, ptr))
            d.stats += UNREAD
            d.dtypes.append(p.dtype)
            d.items.append(name)
            return
        r = self._uncached(rec, p, name, d)
        if r is not None:
            self.params_seen[id(p)] = (p, version, ptr, p.dtype, r)

    def _uncached(self, rec: Record, p: torch.Tensor, name: str, d: FrameDraft) -> Optional[StatPair]:
        """A weight measured as it is into the record; its pair (None: a note) for a cache."""
        if rec.targets:
            return self._magnitudes.measure(rec, p, name, d)
        r = measure(p)
        if isinstance(r, str):
            d.items.append((name, r))  # a note
            return None
        d.stats += r
        d.dtypes.append(p.dtype)
        d.items.append(name)
        return r

    def tensor(self, rec: Record, t: torch.Tensor, name: str, d: FrameDraft) -> None:
        # The weak reference guards against id() reuse after a tensor is freed.
        if rec.targets:
            return self._magnitudes.tensor(rec, t, name, d, self.acts_seen, self._fb)
        key = id(t)
        seen = self.acts_seen.get(key)
        if seen is not None and seen[0]() is t and seen[1] == t._version and usable(self._device, rec, seen[2]):
            d.stats += seen[2]
            d.dtypes.append(seen[3])
            d.items.append(name)
            return
        fb = self._fb
        if fb.on and not t.is_inference():  # (an inference tensor has no version: measured alone)
            version = t._version
            twin = fb.acts.get(key)  # gathered already in this frame, unchanged since
            if twin is not None and twin[1] is t and twin[2] == version:
                fb.pending.append((len(d.stats), t, twin[0], version, 0))
                d.stats += UNREAD
                d.dtypes.append(t.dtype)
                d.items.append(name)
                return
            if fb.gather.add(t):  # measured with the frame's others (FrameBatch.finish)
                fb.acts[key] = (len(d.stats), t, version)
                fb.pending.append((len(d.stats), t, False, version, 0))
                d.stats += UNREAD
                d.dtypes.append(t.dtype)
                d.items.append(name)
                return
        r = measure(t)
        if isinstance(r, str):
            d.items.append((name, r))
            return
        try:
            self.acts_seen[key] = (weakref.ref(t), t._version, r, t.dtype)
        except (TypeError, RuntimeError):  # no weakref / no version (inference tensors): no reuse
            pass
        d.stats += r
        d.dtypes.append(t.dtype)
        d.items.append(name)
