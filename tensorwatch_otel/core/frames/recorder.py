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

import math
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

import torch

from .. import naming
from ..frame_stats import NOTE_NONE, NOTE_NOT_TENSOR, TensorStat
from ..frame_draft import FrameDraft, Item, ModuleInfo, Stat
from ..record import Record
from ..measure.cpu_kernel import CODES, KERNEL
from ..measure.device_path import wanted as device_path_wanted
from ..measure.device_stats import DeviceFrame, DeviceStats
from ..measure.slot_buffer import SlotStat
from ..measure.slot_words import FRESH_READS, CountLayout
from ..measure.magnitude import HISTOGRAM_EVERY, measure_counts
from ..measure.host_batch import HostBatch
from ..measure.stats import host_readable, measure_host as measure, nonfinite_kind_of
from ..measure.weights import WeightTable, takes

MAX_ITEMS = 256  # values looked at per container, so odd outputs stay bounded
MAX_DEPTH = 6
_PLAIN = (torch.nn.Parameter, torch.Tensor)  # data_ptr() is cheap and defined for these
_TENSOR = torch.Tensor
_STRIDED = torch.strided
_INPUT0 = naming.input_name(0)

# a tensor's places in its frame's draft until the frame's kernel call fills them (_batch_end,
# before the draft goes to the record: a frame that fails is dropped with them)
_UNREAD: Tuple[float, float] = (math.nan, math.nan)  # placeholders, never read

# a measurement: two 0-d device tensors, two floats on the host (the CPU kernel), or a device
# buffer's slot at both places until the batch's read-back (core/measure/slot_buffer.py)
StatPair = Union[Tuple[torch.Tensor, torch.Tensor], Tuple[float, float], Tuple[SlotStat, SlotStat], Tuple[int, int]]


def _tensor_attributes(v: object) -> Tuple[str, ...]:
    """The public attributes of a plain object (a result with `.loss`, `.logits`) that are
    tensors: looked into as dataclass fields are. Only direct tensors: an object holding lists of
    them (a key/value cache) is not walked on every call. Modules and classes are not looked into."""
    attrs = getattr(v, "__dict__", None)
    if not isinstance(attrs, dict) or isinstance(v, (torch.nn.Module, type)):
        return ()
    out = tuple(k for k, x in attrs.items() if isinstance(x, torch.Tensor) and isinstance(k, str) and k[:1] != "_")
    return out[:MAX_ITEMS]


class _FrameBatch(threading.local):
    """One thread's frame in progress: its dense tensors, measured in one kernel call when the
    frame is complete (each thread has its own: a model may be called from several). `gather`
    takes them: the CPU kernel's HostBatch, or on a device-path recorder this object, which
    gives each tensor to the fused device kernel when its device takes the device path and to
    the CPU kernel otherwise (`on_device`: which one, per tensor taken)."""

    def __init__(self, device: Optional[DeviceStats]) -> None:
        self.host = HostBatch()
        self.device: Optional[DeviceFrame] = None if device is None else device.frame()
        self.gather: Union[HostBatch, _FrameBatch] = self.host if self.device is None else self
        self.on_device: List[bool] = []
        # (stats position, tensor, True for a parameter / False / the position of its twin, version, data_ptr)
        self.pending: List[Tuple[int, torch.Tensor, Union[bool, int], int, int]] = []
        # id -> (stats position, tensor, version) gathered this frame
        self.acts: Dict[int, Tuple[int, torch.Tensor, int]] = {}
        self.on = False

    def add(self, t: torch.Tensor) -> bool:
        """(A device-path recorder's `gather`.) Take `t` for the device kernel, else for the CPU
        kernel; False when neither reads it as it is."""
        device = self.device  # (never None here: gather is self only with a device)
        if device is not None and device.add(t):
            self.on_device.append(True)
            return True
        if self.host.add(t):
            self.on_device.append(False)
            return True
        return False

    def clear(self) -> None:
        self.host.clear()
        if self.device is not None:
            self.device.clear()
        self.on_device = []

    def measure(self, pending: List[Tuple[int, torch.Tensor, Union[bool, int], int, int]],
                layout: Optional[CountLayout], key: object) -> List[Any]:
        """(A device-path recorder's frame end.) The values of the tensors taken, two places per
        tensor in the order taken: a SlotStat (at both) for the device kernel's, floats for the
        CPU kernel's (each measured alone when that kernel is not loaded). With target_dtypes
        (`layout`) only the device kernel takes tensors, and counts them too, at once; else
        they wait for a launch with other frames' (DeviceFrame.defer; `key`: the module)."""
        on_device, self.on_device = self.on_device, []
        device = self.device
        slots = (device.launch(layout) if layout is not None else device.defer(key)) \
            if device is not None and True in on_device else []
        floats = self.host.measure() if False in on_device else None
        taken = [t for _, t, twin, _, _ in pending if twin.__class__ is not int]
        values: List[Any] = []
        i = j = 0
        for t, dev in zip(taken, on_device):
            if dev:
                values += (slots[i], slots[i])
                i += 1
            elif floats is not None:
                values += floats[j:j + 2]
                j += 2
            else:
                m = measure(t)
                values += (float("nan"), float("nan")) if isinstance(m, str) else m
        return values


ActSeen = Tuple["weakref.ref[torch.Tensor]", int, StatPair, torch.dtype]


class _NoWeightTable(WeightTable):
    """The weight table of a recorder whose CPU tensors take the device path: no rows (the
    weights of a module call are read with its other tensors, by the fused kernel)."""

    def offer(self, p: torch.Tensor) -> bool:
        return False

    def state(self) -> None:
        return None


class FrameRecorder:
    """Measures tensors into a Record. Weights are measured once per batch unless they are
    known unchanged; an activation seen as one module's output and the next one's input (the
    same object at the same version) is measured once."""

    def __init__(self, model: torch.nn.Module) -> None:
        # the device path (core/measure/device_stats.py), decided when the recorder is made
        self._device = DeviceStats() if device_path_wanted() else None
        # id(param) -> (param, version, data_ptr, dtype, (mn, mx)); cleared by invalidate_weights()
        # (keyed by id: a tensor's own __hash__ is a Python call, and the entry holds the param)
        self.params_seen: Dict[int, Tuple[torch.Tensor, int, int, torch.dtype, StatPair]] = {}
        # Replaced parameters (functional_call, re-created weights) would stay alive as keys:
        # past this size the cache is dropped at a batch end and simply refilled.
        self.params_cap = 2 * sum(1 for _ in model.parameters()) + 64
        self.acts_seen: Dict[int, ActSeen] = {}  # id -> (weakref, version, (mn, mx), dtype)
        self.acts_last: Dict[int, ActSeen] = {}  # the last finished batch's, for a detection's kind
        # target_dtypes: id(abs-min entry) -> (that entry, its counts row, its histogram row):
        # the rows of a measurement the caches above reuse (core/measure/magnitude.py); on the device
        # path the entry and the counts row are the tensor's SlotStat
        self.mags_seen: Dict[int, Tuple[Union[torch.Tensor, SlotStat], Union[torch.Tensor, SlotStat, None],
                                        Optional[torch.Tensor]]] = {}
        self._fb = _FrameBatch(self._device)  # the calling thread's frame in progress
        # small dense CPU weights: one kernel call per batch for all of them (core/measure/weights.py)
        self._host: Optional[Callable[[torch.Tensor], Tuple[float, float]]] = None  # the kernel's host call...
        self._host_of: object = None  # ...as looked up for this weight-table read (_one_in_one_out)
        self.weights = _NoWeightTable() if self._device is not None and self._device.cpu else WeightTable()
        self._declined: set[int] = set()  # ids of weights that cannot be rows
        self._hist_batch = (-1, False, 0)  # (batch number, histogram batch?, watched batches seen)

    @property
    def device_stats(self) -> Optional[DeviceStats]:
        """The device path's slot buffers (None: this recorder's devices take the other routes)."""
        return self._device

    def invalidate_weights(self) -> None:
        self.params_seen.clear()
        self.mags_seen.clear()
        self.weights.invalidate()

    def weights_replaced(self) -> None:
        """The model's parameters were replaced: the weight table is made again from the frames,
        and the cache lets the replaced ones go (it held them as keys until its cap)."""
        self.weights.unknown()
        self._declined.clear()
        self.params_seen.clear()
        self.mags_seen.clear()

    def end_batch(self) -> None:
        self.weights.end_batch()
        self.acts_last, self.acts_seen = self.acts_seen, {}
        self.mags_seen.clear()
        if len(self.params_seen) > self.params_cap:
            self.params_seen.clear()

    def clear(self) -> None:
        self.weights.drop()
        self._declined.clear()
        self.params_seen.clear()
        self.acts_seen.clear()
        self.acts_last.clear()
        self.mags_seen.clear()

    # ------------------------------------------------------------------ a detection
    def kind(self, rec: Record, fi: int, stat: Optional[TensorStat]) -> str:
        """The kind of the detection's tensor `stat` (frame `fi` of `rec`): its own, not its
        frame's ("inf" for an inf weight whose output went nan). Abs min/max show NaN for a
        tensor holding NaN whether or not it also holds an infinity, so a "nan" is checked on
        the tensor itself when it is still alive (weights always; activations of the batch
        while referenced): "inf,nan" when it holds both."""
        if stat is None:
            return "nan"
        kind = stat.kind or "nan"
        if kind != "nan":
            return kind
        mn = rec.abs_min_entry(fi, stat.name)
        if mn is None:
            return kind
        t = self._measured(mn)
        if t is None:  # a weight read with the weight table (core/measure/weights.py): its module holds it
            w = rec.frame_info(fi).params.get(stat.name) if 0 <= fi < rec.frame_count else None
            t = w if isinstance(w, torch.Tensor) else None
        if t is None:
            return kind
        try:
            exact = nonfinite_kind_of(t)
        except Exception:  # reading it again must not hide the detection
            exact = None
        return exact or kind

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
    def _batch_start(self) -> None:
        """Dense float tensors of one frame go to the kernel in one call (at _batch_end): the
        CPU kernel when it is loaded, or the fused device kernel on the device path; each is
        still measured during the hook that sees it."""
        fb = self._fb
        fb.on = fb.device is not None or getattr(KERNEL.get(), "host_many", None) is not None

    def _batch_end(self, rec: Record, d: FrameDraft, info: ModuleInfo) -> None:
        """Measure the frame's gathered tensors (one kernel call) and put their values in the
        draft's places and the caches."""
        fb = self._fb
        pending = fb.pending
        fb.on = False
        if not pending:
            return
        fb.pending = []
        fb.acts.clear()
        values: Optional[Sequence[Any]]  # floats, or SlotStats (each at both its places)
        plan = rec.plan
        counted = plan is not None  # target_dtypes: each SlotStat is the tensor's counts row too
        if fb.device is not None:  # the device kernel's SlotStats, and the CPU kernel's floats
            # (a lent parameter, accelerate's offload, lives for the call only: measured at once)
            values = fb.measure(pending, plan.device_layout() if plan is not None else None,
                                None if info.lent else info)
        else:
            values = fb.host.measure()
        stats = d.stats
        params_seen, acts_seen = self.params_seen, self.acts_seen
        if values is None:  # the kernel went away meanwhile (tests): measure each as before
            for pos, t, is_param, _version, _ptr in pending:
                m = measure(t) if is_param.__class__ is not int else (stats[is_param], stats[is_param + 1])
                if isinstance(m, str):  # (never for a tensor the kernel took)
                    m = (float("nan"), float("nan"))
                stats[pos], stats[pos + 1] = m
            return
        j = 0
        for pos, t, is_param, version, ptr in pending:
            if is_param.__class__ is int:  # the same tensor as at position is_param, earlier
                stats[pos] = stats[is_param]
                stats[pos + 1] = stats[is_param + 1]
                continue
            r: StatPair = (values[j], values[j + 1])
            j += 2
            stats[pos] = r[0]
            stats[pos + 1] = r[1]
            if counted:  # (only the device kernel's SlotStats here)
                slot = cast(SlotStat, r[0])
                d.counts[pos // 2] = slot
                self.mags_seen[id(slot)] = (slot, slot, None)
            if is_param:
                params_seen[id(t)] = (t, version, ptr, t.dtype, r)
            else:
                try:
                    acts_seen[id(t)] = (weakref.ref(t), version, r, t.dtype)
                except (TypeError, RuntimeError):  # no weakref (inference tensors): no reuse
                    pass

    def frame(self, rec: Record, info: ModuleInfo, args: Tuple[object, ...], kwargs: Optional[Dict[str, object]],
              output: object) -> None:
        """The full view: parameters, every positional and keyword input, any output value."""
        if output.__class__ is _TENSOR and len(args) == 1 and not kwargs and not rec.targets \
                and args[0].__class__ is _TENSOR and (self._device_call(rec, info, args[0], output)
                                                      if self._device is not None else
                                                      self._one_in_one_out(rec, info, args[0], output)):
            return
        d = FrameDraft()
        self._batch_start()
        try:
            self._frame(rec, info, d, args, kwargs, output)
            self._batch_end(rec, d, info)
        except BaseException:
            self._abandon()
            raise
        rec.add_frame(info, d)

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
        hits: List[Tuple[str, int]] = []
        for name, p in info.params.items():  # first: a module of large weights leaves at once
            if p is None:
                continue
            i = rows.get(id(p))
            if i is None or p._version != versions[i] or p.data_ptr() != ptrs[i] or p.dtype is not dtypes[i]:
                return False
            hits.append((name, i))
        # host_readable(y), written out: a call per frame is a cost here (docs/performance.md)
        if y is x or not (y.is_cpu and y.dtype in CODES and y.layout is _STRIDED and y.is_contiguous()
                          and y.numel() and not y.is_inference()):
            return False
        acts_seen = self.acts_seen
        seen = acts_seen.get(id(x))
        # (a cached x is the live tensor of that entry: it has a version counter)
        x_cached = seen is not None and seen[0]() is x and seen[1] == x._version
        if not x_cached and not host_readable(x):
            return False
        if self._host_of is not table:  # (the kernel's host call, looked up again with each table read)
            self._host_of = table
            self._host = getattr(KERNEL.get(), "host", None)
        host = self._host
        if host is None:
            return False
        if seen is None or not x_cached:  # (None: never cached)
            seen = acts_seen[id(x)] = (weakref.ref(x), x._version, host(x), x.dtype)
        out = acts_seen.get(id(y))  # (an output passed up unchanged: measured once)
        if out is None or out[0]() is not y or out[1] != y._version:
            out = acts_seen[id(y)] = (weakref.ref(y), y._version, host(y), y.dtype)  # as at its return
        items: List[Item] = []
        stats: List[Stat] = []
        rec_dtypes: List[torch.dtype] = []
        for name, i in hits:
            stats.append(vals[2 * i])
            stats.append(vals[2 * i + 1])
            rec_dtypes.append(dtypes[i])
            items.append(name)
        stats += seen[2]
        rec_dtypes.append(seen[3])
        stats += out[2]
        rec_dtypes.append(out[3])
        items.append(_INPUT0)
        items.append("output")
        rec.add_lists(info, items, stats, rec_dtypes, None, len(stats))  # (FrameDraft's lists, without one)
        return True

    def _device_call(self, rec: Record, info: ModuleInfo, x: torch.Tensor, y: torch.Tensor) -> bool:
        """`_one_in_one_out` on the device path: a module call of one tensor in and one out whose
        tensors all take one device buffer's deferred table (SlotBuffer.take_one: a slot code
        each), taken in a few lines with the caches and record of `_frame`. False for any other
        frame, and for one whose tensors must be measured at once (a module learnt or being
        learnt, inside a compiled graph): `_frame` takes it (the tensors taken here by then are
        in the caches)."""
        device = self._device
        if device is None or y is x or info.lent:
            return False
        buf = device.one
        if buf is None:
            return False
        take = buf.take_one
        params_seen, acts_seen = self.params_seen, self.acts_seen
        items: List[Item] = []
        stats: List[Stat] = []
        dtypes: List[torch.dtype] = []
        others = 0  # cached statistics that are not slot codes (taken by `_frame` earlier)
        for name, p in info.params.items():
            if p is None:
                continue
            seen = params_seen.get(id(p))
            version = p._version
            if seen is not None and seen[1] == version and seen[2] == p.data_ptr() and seen[3] is p.dtype \
                    and (seen[4][0].__class__ is not int or seen[4][0] >> 32 > buf.epoch - FRESH_READS):
                r = seen[4]
                if r[0].__class__ is not int:
                    others += 2
                dt = seen[3]
            else:
                code = take(p, info)
                if code is None:
                    return False
                r = (code, code)
                dt = p.dtype
                params_seen[id(p)] = (p, version, p.data_ptr(), dt, r)
            stats += r
            dtypes.append(dt)
            items.append(name)
        for t, name in ((x, _INPUT0), (y, "output")):
            seen_t = acts_seen.get(id(t))
            if seen_t is not None and seen_t[0]() is t and seen_t[1] == t._version \
                    and (seen_t[2][0].__class__ is not int or seen_t[2][0] >> 32 > buf.epoch - FRESH_READS):
                r = seen_t[2]
                if r[0].__class__ is not int:
                    others += 2
                dtypes.append(seen_t[3])
            else:
                if t.is_inference():
                    return False
                code = take(t, info)
                if code is None:
                    return False
                r = (code, code)
                dt = t.dtype
                acts_seen[id(t)] = (weakref.ref(t), t._version, r, dt)
                dtypes.append(dt)
            stats += r
            items.append(name)
        rec.add_lists(info, items, stats, dtypes, buf, others)
        return True

    def _usable(self, rec: Record, r: StatPair) -> bool:
        """A cached pair `rec` can take: a value, or a slot code of a read still kept when `rec`
        reads back (SlotBuffer.decoded keeps KEPT_READS reads: check="module" reads after every
        frame), `rec` told which buffer its codes are of. A code too old is measured again."""
        code = r[0]
        if code.__class__ is not int:
            return True
        coder = self._device.coder if self._device is not None else None
        if coder is None or code >> 32 <= coder.epoch - FRESH_READS:
            return False
        rec.uses_codes(coder)
        return True

    def _abandon(self) -> None:
        """A frame that could not be taken: its draft is dropped (the record never saw it), and
        so is what this thread gathered for it."""
        fb = self._fb
        fb.pending = []
        fb.acts.clear()
        fb.gather.clear()
        fb.on = False

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
            fields = naming.dataclass_fields(v) or _tensor_attributes(v)
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
            return self._param_magnitude(rec, p, name, d)
        seen = self.params_seen.get(id(p))
        version = p._version
        ptr = p.data_ptr() if p.__class__ in _PLAIN else id(p)
        if seen is not None and seen[0] is p and seen[1] == version and seen[2] == ptr and seen[3] is p.dtype \
                and self._usable(rec, seen[4]):
            d.stats += seen[4]
            d.dtypes.append(seen[3])
            d.items.append(name)
            return
        fb = self._fb
        if fb.on and fb.gather.add(p):  # measured with the frame's others (_batch_end)
            fb.pending.append((len(d.stats), p, True, version, ptr))
            d.stats += _UNREAD
            d.dtypes.append(p.dtype)
            d.items.append(name)
            return
        r = self._uncached(rec, p, name, d)
        if r is not None:
            self.params_seen[id(p)] = (p, version, ptr, p.dtype, r)

    def _uncached(self, rec: Record, p: torch.Tensor, name: str, d: FrameDraft) -> Optional[StatPair]:
        """A weight measured as it is into the record; its pair (None: a note) for a cache."""
        if rec.targets:
            return self._measure(rec, p, name, d)
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
            return self._tensor_magnitude(rec, t, name, d)
        key = id(t)
        seen = self.acts_seen.get(key)
        if seen is not None and seen[0]() is t and seen[1] == t._version and self._usable(rec, seen[2]):
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
                d.stats += _UNREAD
                d.dtypes.append(t.dtype)
                d.items.append(name)
                return
            if fb.gather.add(t):  # measured with the frame's others (_batch_end)
                fb.acts[key] = (len(d.stats), t, version)
                fb.pending.append((len(d.stats), t, False, version, 0))
                d.stats += _UNREAD
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

    # ------------------------------------------------------------------ target_dtypes
    # param() and tensor() with a counts row per measured tensor (d.counts), read with the
    # abs min/max, and on histogram batches a histogram row (d.mags) (core/measure/magnitude.py); the
    # same caches, a cached measurement reused only with its rows. On the device path, outside
    # histogram batches, the tensors the fused kernel reads are gathered as the plain ones are
    # and counted in the frame's launch (_counted_on_device); the others, and every tensor of a
    # histogram batch, take measure_counts (torch ops or the CPU kernel) at once.
    def _histogram(self, rec: Record) -> bool:
        """Whether `rec`'s batch takes the Magnitude histograms: the first watched batch, then
        every HISTOGRAM_EVERY-th watched batch (decided once per batch number)."""
        b, hist, seen = self._hist_batch
        if b != rec.batch_number:
            hist = seen % HISTOGRAM_EVERY == 0
            self._hist_batch = (rec.batch_number, hist, seen + 1)
        rec.histogram = hist
        return hist

    def _reuse(self, rec: Record, r: StatPair, dtype: torch.dtype, name: str, d: FrameDraft) -> bool:
        m = self.mags_seen.get(id(r[0]))
        if m is None or m[0] is not r[0]:
            return False
        d.stats += r
        d.dtypes.append(dtype)
        d.counts.append(m[1])
        d.mags.append(m[2])
        d.items.append(name)
        return True

    def _measure(self, rec: Record, t: torch.Tensor, name: str,
                 d: FrameDraft) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        hist = rec.histogram
        if hist is None:
            hist = self._histogram(rec)
        plan = rec.plan
        assert plan is not None  # set whenever targets are (only then is this called)
        r = measure_counts(t, plan, hist)
        if isinstance(r, str):
            d.items.append((name, r))
            return None
        pair: Tuple[torch.Tensor, torch.Tensor] = (r[0], r[1])
        self.mags_seen[id(r[0])] = (r[0], r[2], r[3])
        d.stats += pair
        d.dtypes.append(t.dtype)
        d.counts.append(r[2])
        d.mags.append(r[3])
        d.items.append(name)
        return pair

    def _counted_on_device(self, rec: Record, t: torch.Tensor, is_param: bool, version: int, ptr: int,
                           name: str, d: FrameDraft) -> bool:
        """Gather `t` for the frame's fused launch with its counts (the plain path's gathering,
        _batch_end fills its places, its counts row and the caches); False when the device
        kernel does not take it here: no device path, no frame being gathered, a histogram
        batch (the histogram rows are torch ops), or a tensor the kernel does not read."""
        fb = self._fb
        device = fb.device
        if device is None or not fb.on:
            return False
        hist = rec.histogram
        if hist is None:
            hist = self._histogram(rec)
        if hist or not device.add(t, counted=True):
            return False
        fb.on_device.append(True)
        fb.pending.append((len(d.stats), t, is_param, version, ptr))
        d.stats += _UNREAD
        d.dtypes.append(t.dtype)
        d.counts.append(None)  # the SlotStat, at _batch_end
        d.mags.append(None)
        d.items.append(name)
        return True

    def _param_magnitude(self, rec: Record, p: torch.Tensor, name: str, d: FrameDraft) -> None:
        seen = self.params_seen.get(id(p))
        version = p._version
        ptr = p.data_ptr() if p.__class__ in _PLAIN else id(p)
        if seen is not None and seen[0] is p and seen[1] == version and seen[2] == ptr and seen[3] is p.dtype \
                and self._reuse(rec, seen[4], seen[3], name, d):
            return
        if self._counted_on_device(rec, p, True, version, ptr, name, d):
            return
        pair = self._measure(rec, p, name, d)
        if pair is not None:
            self.params_seen[id(p)] = (p, version, ptr, p.dtype, pair)

    def _tensor_magnitude(self, rec: Record, t: torch.Tensor, name: str, d: FrameDraft) -> None:
        key = id(t)
        seen = self.acts_seen.get(key)
        if seen is not None and seen[0]() is t and seen[1] == t._version \
                and self._reuse(rec, seen[2], seen[3], name, d):
            return
        if not t.is_inference() and self._counted_on_device(rec, t, False, t._version, 0, name, d):
            return
        pair = self._measure(rec, t, name, d)
        if pair is None:
            return
        try:
            self.acts_seen[key] = (weakref.ref(t), t._version, pair, t.dtype)
        except (TypeError, RuntimeError):  # no weakref / no version (inference tensors): no reuse
            pass
