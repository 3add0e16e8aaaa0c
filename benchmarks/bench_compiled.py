"""The compiled step: what watching costs under torch.compile, and prototype in-graph recorders.

A stack of pre-norm transformer blocks (CPU: 4 blocks, d 256, batch 8x128, fp32; `--device cuda`:
GPT-2-medium-shaped, 24 blocks, d 1024, batch 8x512, bf16 autocast) takes fwd+bwd+AdamW steps,
forward compiled by torch.compile (default backend). Variants, paired in bracketed rounds
against the compiled unwatched step (benchmarks/_bracketed.py; a full garbage collection before
every step, untimed):

    null            a second compiled unwatched copy: copy-to-copy difference plus noise
    watched         THE PACKAGE: tensorwatch_otel.watch(model, sinks=[]) before torch.compile(model):
                    its hooks traced into the graph, as plain ops for graphs on the CPU
                    (core/measure/graph_stats.py; TENSORWATCH_GRAPH_STATS=0: custom ops that run the
                    eager hook at run time, core/frames/compiled.py, the default on a GPU): every
                    module's weights, inputs and outputs
    watched_sampled the same, with every_n_batches=10 (a copy of its own: one watcher sees
                    consecutive batches)
    wrapped         tensorwatch_otel.watch(torch.compile(model), sinks=[]): the same frames; the
                    root's hooks run outside the graph
    custom          PROTOTYPE: forward hooks registered before compile write abs min/max of each
                    module's input and output into row r of a preallocated [rows, 2] buffer
                    through a torch.library.custom_op that mutates the buffer (opaque to
                    inductor: no fusion); off switch: a host-side flag the op's body reads
    plain           PROTOTYPE: the same hooks with plain torch ops (abs, amin, amax,
                    torch.where on a 0-dim device flag, buf[r] = ...) that inductor may fuse
                    into the kernels producing the tensors
    custom_kernel   `custom` with the package's statistics in the op's body (one read of the
                    tensor: the compiled CPU kernel) instead of abs() + aminmax()
    kernel_grad     `custom_kernel` plus the gradient of every module's output: an identity
                    autograd.Function (a view) on the output whose backward calls the op on the
                    gradient, writing a second buffer (traced into the compiled backward)
    custom_sampled  `custom`'s compiled model, on every 10th step only (host flag)
    plain_sampled   `plain`'s compiled model, device flag on every 10th step only (the
                    statistics are still computed, torch.where keeps the old row)

The prototypes live in this file, not in the package: the groundwork for core/frames/compiled.py. Each
watched step ends with the per-batch read-back (one copy of the buffer to the host and an
isfinite check there). Apart from the timing, per variant: graphs compiled and graph breaks on
its first step (torch._dynamo counters), the inductor kernels and custom-op calls in its
generated code, and for the prototypes the buffer against eager hooks on the same weights (max
relative difference of each column), then whether toggling the flag recompiles, what removing
the hooks after compile does (torch._dynamo.config.skip_nnmodule_hook_guards), and which module
an inf born inside the graph is pinned on.

The hooks are registered before torch.compile. By default the benchmark sets
torch._dynamo.config.skip_nnmodule_hook_guards = False (`--hook-guards torch` keeps torch's
True): with torch's default, the graph of a hook-less copy compiled first is reused for a
hooked copy of the same classes, whose hooks then run only on the root (a separate small
graph: torch.compile(model) compiles forward, and the root's hooks apart from it).

    python benchmarks/bench_compiled.py                  # CPU, 20 rounds (compiles take minutes)
    python benchmarks/bench_compiled.py --quick          # a tiny model, 2 rounds (smoke test)
    python benchmarks/bench_compiled.py --threads 1 --clock cpu   # on a loaded machine
    python benchmarks/bench_compiled.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import statistics
import sys
import time
import weakref
from typing import Callable, Dict, List, Optional
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _bracketed import median_interval, run_bracketed  # noqa: E402
from _prenorm import Stack, mlp_stack  # noqa: E402

VARIANTS = ("null", "watched", "watched_sampled", "wrapped", "custom", "plain", "custom_sampled", "plain_sampled",
            "custom_kernel", "kernel_grad")
RECORDERS = ("custom", "plain", "custom_kernel", "kernel_grad")
SAMPLE_EVERY = 10


# --- the model (benchmarks/_prenorm.py) and its input ---------------------------------------------

def build(quick: bool, device: torch.device, shape_name: str = "prenorm"):
    """(model, input): the CPU shape, the GPT-2-medium shape on CUDA, a tiny one for --quick;
    `shape_name` "mlp" / "mlp-sequential": the blocks without attention (an MLP-block step), under
    a root of their own / an nn.Sequential."""
    if quick:
        n, d, heads, shape = 1, 32, 4, (2, 16)
    elif device.type == "cuda":
        n, d, heads, shape = 24, 1024, 16, (8, 512)
    else:
        n, d, heads, shape = 4, 256, 8, (8, 128)
    torch.manual_seed(0)
    if shape_name == "prenorm":
        model = Stack(n, d, heads)
    else:
        model = mlp_stack(n, d, sequential=shape_name == "mlp-sequential")
    model = model.to(device).train()
    x = torch.randn(*shape, d, generator=torch.Generator().manual_seed(1)).to(device)
    return model, x


# --- the prototype recorders --------------------------------------------------------------------

_OFF: set = set()  # data_ptr of every custom-op buffer switched off (host flag: read at run time)


@torch.library.custom_op("twbench::absminmax", mutates_args=("buf",))
def absminmax(buf: torch.Tensor, row: int, x: torch.Tensor) -> None:
    """buf[row] = (abs min, abs max) of x. Opaque to inductor: its body runs on every call of
    the compiled graph, so a Python flag read here switches it off without a recompile."""
    if buf.data_ptr() in _OFF:
        return
    buf[row].copy_(torch.stack(torch.aminmax(x.detach().abs())).to(buf.dtype))


@absminmax.register_fake
def _absminmax_fake(buf, row, x) -> None:
    return None


@torch.library.custom_op("twbench::absminmax_kernel", mutates_args=("buf",))
def absminmax_kernel(buf: torch.Tensor, row: int, x: torch.Tensor) -> None:
    """absminmax through the package's statistics (tensorwatch_otel.core.measure.stats.measure: one read
    of the tensor, the compiled CPU kernel on a CPU) instead of abs() + aminmax()."""
    if buf.data_ptr() in _OFF:
        return
    from tensorwatch_otel.core.measure.stats import measure

    pair = measure(x.detach())
    if not isinstance(pair, str):
        buf[row].copy_(torch.stack(pair).to(buf.dtype))


@absminmax_kernel.register_fake
def _absminmax_kernel_fake(buf, row, x) -> None:
    return None


_GRAD_BUF: List[torch.Tensor] = []  # the gradient buffer of the (one) kernel_grad recorder


class _GradTap(torch.autograd.Function):
    """Identity on a module's output (a view: no copy); its backward measures the gradient."""

    @staticmethod
    def forward(ctx, x, row: int):
        ctx.row = row
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        absminmax_kernel(_GRAD_BUF[0], ctx.row, grad)
        return grad, None


class Recorder:
    """One buffer row per (module, tensor): input 0 and output of every module called in the
    forward; hooks registered before torch.compile are traced into the graph."""

    def __init__(self, model: nn.Module, kind: str):
        self.kind = kind
        mods = [(n or "<root>", m) for n, m in model.named_modules() if not isinstance(m, nn.ModuleList)]
        self.names = [f"{n}:{t}" for n, _ in mods for t in ("input", "output")]
        dev = next(model.parameters()).device
        self.buf = torch.zeros(len(self.names), 2, device=dev)
        self.host = torch.zeros(len(self.names), 2, pin_memory=dev.type == "cuda")
        self.on = torch.ones((), dtype=torch.bool, device=dev)  # the plain recorder's device flag
        self.gbuf = torch.zeros(len(mods), 2, device=dev) if kind == "kernel_grad" else None
        if self.gbuf is not None:
            _GRAD_BUF[:] = [self.gbuf]
            self.ghost = torch.zeros(len(mods), 2, pin_memory=dev.type == "cuda")
        self.handles = []
        self.attach(model, mods)

    def attach(self, model: Optional[nn.Module] = None, mods=None) -> None:
        mods = mods or [(n or "<root>", m) for n, m in model.named_modules() if not isinstance(m, nn.ModuleList)]
        hook = self._plain_hook if self.kind == "plain" else self._custom_hook
        self.handles = [m.register_forward_hook(hook(2 * i)) for i, (_, m) in enumerate(mods)]

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _custom_hook(self, row: int):
        buf, op = self.buf, absminmax if self.kind == "custom" else absminmax_kernel
        grads = self.kind == "kernel_grad"

        def hook(mod, args, out):
            if args and isinstance(args[0], torch.Tensor):
                op(buf, row, args[0])
            if isinstance(out, torch.Tensor):
                op(buf, row + 1, out)
                if grads and out.requires_grad:
                    return _GradTap.apply(out, row // 2)
            return None
        return hook

    def _plain_hook(self, row: int):
        buf, on = self.buf, self.on

        def put(r, x):
            a = x.detach().abs()
            buf[r] = torch.where(on, torch.stack((a.amin(), a.amax())).to(buf.dtype), buf[r])

        def hook(mod, args, out):
            if args and isinstance(args[0], torch.Tensor):
                put(row, args[0])
            if isinstance(out, torch.Tensor):
                put(row + 1, out)
        return hook

    def set_enabled(self, enabled: bool) -> None:
        if self.kind != "plain":
            for b in (self.buf, self.gbuf):
                if b is not None:
                    (_OFF.discard if enabled else _OFF.add)(b.data_ptr())
        else:
            self.on.fill_(enabled)

    def read_back(self) -> bool:
        """The per-batch read-back: one copy to the host; True when every value is finite."""
        self.host.copy_(self.buf)
        if self.gbuf is not None:
            self.ghost.copy_(self.gbuf)
        return bool(torch.isfinite(self.host).all())

    def born_in(self) -> List[str]:
        """Innermost modules whose output is non-finite while their input is finite."""
        finite = torch.isfinite(self.host).all(dim=1).tolist()
        mods = [self.names[i].rsplit(":", 1)[0] for i in range(0, len(self.names), 2)]
        cands = [m for i, m in enumerate(mods) if finite[2 * i] and not finite[2 * i + 1]]
        return [m for m in cands if not any(o != m and (m == "<root>" or o.startswith(m + ".")) for o in cands)]


# --- steps --------------------------------------------------------------------------------------

class CompiledTrainer:
    """A model copy, compiled, with its AdamW and optional recorder: one fwd+bwd+AdamW step."""

    def __init__(self, model, x, autocast, recorder: Optional[Recorder] = None, watch: Optional[str] = None,
                 backend: str = "inductor", every_n_batches: int = 1):
        """watch: None, "before" (watch(model), then torch.compile) or "wrapped" (watch(torch.compile(model)))."""
        import tensorwatch_otel as tw

        self.model, self.x, self.autocast, self.recorder = model, x, autocast, recorder
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.watcher = None
        if watch == "before":
            self.watcher = tw.watch(model, sinks=[], on_detect="report", every_n_batches=every_n_batches)
        self.compiled = torch.compile(model, backend=backend)
        if watch == "wrapped":
            self.watcher = tw.watch(self.compiled, sinks=[], on_detect="report")
        self.calls = 0

    def frames_recorded(self) -> int:
        """Frames in the watcher's last finished batch (0 without a watcher)."""
        if self.watcher is None:
            return 0
        records = self.watcher._session.history().records
        return records[-1].frame_count if records else 0

    #: wall time, or the process' CPU time (time.process_time, CPU only): immune to the
    #: preemption of a loaded shared machine
    clock: Callable[[], float] = time.perf_counter

    def _sync(self):
        if self.x.device.type == "cuda":
            torch.cuda.synchronize(self.x.device)

    def step(self) -> float:
        self._sync()
        t0 = CompiledTrainer.clock()
        with torch.autocast(self.x.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            out = self.compiled(self.x)
        out.float().square().mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.recorder is not None:
            self.recorder.read_back()
        self._sync()
        return CompiledTrainer.clock() - t0

    def sampled_step(self) -> float:
        """A step with the recorder on every SAMPLE_EVERY-th call only (switched untimed)."""
        self.recorder.set_enabled(self.calls % SAMPLE_EVERY == 0)
        self.calls += 1
        try:
            return self.step()
        finally:
            self.recorder.set_enabled(True)


def _graph_counts() -> Dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values())}


def first_step(trainer: CompiledTrainer, code_dir: Optional[str] = None, name: str = "") -> dict:
    """The first (compiling) step: graphs compiled, graph breaks, the kernels inductor
    generated and the custom-op calls in that code (written to code_dir when given)."""
    codes: List[str] = []
    from torch._inductor.graph import GraphLowering

    before = _graph_counts()
    t0 = time.perf_counter()
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        trainer.step()
    after = _graph_counts()
    if code_dir:
        os.makedirs(code_dir, exist_ok=True)
        for i, code in enumerate(codes):
            with open(os.path.join(code_dir, f"{name}_{i}.py"), "w") as f:
                f.write(code)
    kernels = [len(re.findall(r"^\w+ = async_compile\.", code, re.M)) for code in codes]
    return {"graphs": after["graphs"] - before["graphs"], "graph_breaks": after["breaks"] - before["breaks"],
            "compile_s": time.perf_counter() - t0, "kernels": sum(kernels), "kernels_per_graph": kernels,
            "custom_op_calls": sum(len(re.findall(r"torch\.ops\.(?:twbench|tensorwatch)\.\w+\.default\(", c))
                                   for c in codes)}


def eager_reference(model, x, autocast, recorder: Recorder):
    """The buffers eager hooks fill on the same weights and input (before any step): forward,
    and for kernel_grad the gradients of a backward (the weights' gradients dropped)."""
    grads = recorder.gbuf is not None
    with torch.set_grad_enabled(grads), torch.autocast(x.device.type, dtype=autocast,
                                                       enabled=autocast is not None):
        out = model(x)
    gref = None
    if grads:
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        gref = recorder.gbuf.clone()
        recorder.gbuf.zero_()
    ref = recorder.buf.clone()
    recorder.buf.zero_()
    return ref, gref


def eager_frames(base, x, autocast) -> int:
    """The frames one eager forward of a copy records under tensorwatch_otel.watch()."""
    import tensorwatch_otel as tw

    model = copy.deepcopy(base)
    with tw.watch(model, sinks=[], on_detect="report") as w, torch.no_grad(), \
            torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
        model(x)
        return w._session.history().records[-1].frame_count


def rel_diff(a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None) -> float:
    """max |a - b| / |scale| (scale: b). An abs min is the value nearest zero of a tensor: its
    relative difference is the rounding of that one value; against the row's abs max it is not."""
    return float(((a - b).abs() / (b if scale is None else scale).abs().clamp_min(1e-30)).max())


def attribute(trainer: CompiledTrainer, steps: int, op_calls: int) -> dict:
    """The watcher's share of the watched step, timed inside it (a companion to the paired
    ratio that machine drift moves less): the time in the ops' Python bodies (the eager hooks
    they run, and rebuilding the hooked values) plus the optimizer step hooks, over the step.
    Leaves out the custom ops' dispatch (measured apart: an op call with an empty body, times
    `op_calls`, the op calls in the step's generated code) and indirect costs."""
    from tensorwatch_otel.core.frames import compiled as front, op_slots

    spent = [0.0]
    clock = CompiledTrainer.clock

    def timed(fn):
        def run(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += clock() - t0
        return run

    w = trainer.watcher
    slots = op_slots.SLOTS.of_watcher(w)
    saved = [(s, s.pre, s.post) for s in slots]
    real_rebuild = front.rebuild
    keep = []  # the slots hold their hooks weakly
    for s in slots:
        pre, post = timed(s.pre()), timed(s.post())
        keep += [pre, post]
        s.pre, s.post = weakref.ref(pre), weakref.ref(post)
    front.rebuild = timed(real_rebuild)
    shares = []
    try:
        for _ in range(steps):
            spent[0] = 0.0
            total = trainer.step()
            shares.append(spent[0] / total)
    finally:
        front.rebuild = real_rebuild
        for s, pre, post in saved:
            s.pre, s.post = pre, post
    calls = op_calls

    @torch.library.custom_op("twbench::empty", mutates_args=("token",))
    def empty(token: torch.Tensor, x: torch.Tensor) -> None:
        return None

    token, x = torch.zeros(1), torch.zeros(4)
    t0 = clock()
    for _ in range(2000):
        empty(token, x)
    dispatch = (clock() - t0) / 2000
    step_s = statistics.median(trainer.step() for _ in range(3))
    return {"share_median": statistics.median(shares), "share_min": min(shares), "share_max": max(shares),
            "op_calls_per_step": calls, "op_dispatch_us": dispatch * 1e6,
            "dispatch_share": calls * dispatch / step_s}


def probe_switches(trainer: CompiledTrainer) -> dict:
    """Off/on through the flag, then hooks removed and added again after compile: for each, the
    graphs compiled and whether the buffer was written (a sentinel -1 left there or not)."""
    rec = trainer.recorder
    out = {}

    def run(label, action):
        action()
        rec.buf.fill_(-1.0)
        before = _graph_counts()["graphs"]
        trainer.step()
        out[label] = {"recompiles": _graph_counts()["graphs"] - before,
                      "buffer_written": bool((rec.buf != -1).any())}

    run("flag_off", lambda: rec.set_enabled(False))
    run("flag_on", lambda: rec.set_enabled(True))
    run("hooks_removed", rec.detach)
    run("hooks_removed_again", lambda: None)
    run("hooks_added", lambda: rec.attach(trainer.model))
    run("hooks_removed_2", rec.detach)
    run("hooks_added_2", lambda: rec.attach(trainer.model))
    return out


def probe_detection(trainer: CompiledTrainer) -> dict:
    """An inf born inside the graph: one weight of the last block's mlp.fc1 set to 1e38 (finite
    input, infinite output); which module the buffer pins it on."""
    rec = trainer.recorder
    fc1 = trainer.model.blocks[-1].mlp.fc1
    with torch.no_grad():
        fc1.weight.fill_(1e38)
    with torch.autocast(trainer.x.device.type, dtype=trainer.autocast, enabled=trainer.autocast is not None):
        trainer.compiled(trainer.x)
    finite = rec.read_back()
    return {"all_finite": finite, "born_in": rec.born_in(),
            "expected": f"blocks.{len(trainer.model.blocks) - 1}.mlp.fc1"}


# --- main ---------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds (smoke test)")
    p.add_argument("--rounds", type=int, default=20, help="bracketed rounds (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per copy after its first (default 2)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {','.join(VARIANTS)}")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--shape", choices=("prenorm", "mlp", "mlp-sequential"), default="prenorm",
                   help="prenorm (default): the pre-norm transformer blocks; mlp: the same blocks without "
                   "attention (an MLP-block step); mlp-sequential: those under an nn.Sequential root")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--hook-guards", choices=("on", "torch"), default="on",
                   help="on (default): torch._dynamo.config.skip_nnmodule_hook_guards = False, so "
                        "compiled graphs guard on the modules' hooks; torch: torch's default (True: "
                        "hooks added or removed after a compile, or on a second copy of the same "
                        "classes, can be ignored)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time (default), or the process' CPU time (CPU only): immune to "
                        "preemption on a shared machine, blind to time spent waiting")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--code-dir", metavar="DIR", help="write the code inductor generated per variant there")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup = min(args.rounds, 2), 1
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {','.join(unknown)} (choose from {','.join(VARIANTS)})")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.clock == "cpu":
        if device.type != "cpu":
            p.error("--clock cpu: CPU only")
        CompiledTrainer.clock = time.process_time
    autocast = torch.bfloat16 if device.type == "cuda" else None
    # every copy and every attach/detach compiles the same code object again: room for all
    torch._dynamo.config.recompile_limit = 64
    if args.hook_guards == "on":  # guard the hook dicts: attach/detach after compile is seen
        torch._dynamo.config.skip_nnmodule_hook_guards = False
    base, x = build(args.quick, device, args.shape)
    blocks = sum(1 for m in base.modules() if type(m).__name__ in ("Block", "MlpBlock"))
    print(f"model: {args.shape}, {blocks} blocks, {sum(1 for _ in base.modules())} modules, input "
          f"{tuple(x.shape)}, device {device}, autocast {autocast}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.clock} clock, skip_nnmodule_hook_guards "
          f"{torch._dynamo.config.skip_nnmodule_hook_guards}", file=sys.stderr)
    result: dict = {"device": str(device), "threads": torch.get_num_threads(), "rounds": args.rounds,
                    "backend": args.backend, "clock": args.clock,
                    "input": list(x.shape), "shape": args.shape, "blocks": blocks, "torch": torch.__version__,
                    "skip_nnmodule_hook_guards": torch._dynamo.config.skip_nnmodule_hook_guards}
    trainers: Dict[str, CompiledTrainer] = {}
    first: Dict[str, dict] = {}
    match: Dict[str, dict] = {}
    # the prototypes compile first: under torch's default skip_nnmodule_hook_guards=True a
    # hooked copy compiled after a hook-less copy of the same classes keeps only its root's hooks
    for name in [n for n in RECORDERS if n in names] + ["unwatched"] + [
            n for n in ("null", "watched", "watched_sampled", "wrapped") if n in names]:
        model = copy.deepcopy(base)
        rec = Recorder(model, name) if name in RECORDERS else None
        ref, gref = eager_reference(model, x, autocast, rec) if rec is not None else (None, None)
        how = {"watched": "before", "watched_sampled": "before", "wrapped": "wrapped"}.get(name)
        trainers[name] = CompiledTrainer(model, x, autocast, rec, watch=how, backend=args.backend,
                                         every_n_batches=SAMPLE_EVERY if name == "watched_sampled" else 1)
        first[name] = first_step(trainers[name], args.code_dir, name)
        if how is not None:
            first[name]["frames"] = trainers[name].frames_recorded()
        if rec is not None:  # the first step's forward ran on the reference's weights
            match[name] = {"rel_diff_abs_max": rel_diff(rec.buf[:, 1], ref[:, 1]),
                           "rel_diff_abs_min": rel_diff(rec.buf[:, 0], ref[:, 0]),
                           "abs_min_diff_over_abs_max": rel_diff(rec.buf[:, 0], ref[:, 0], ref[:, 1]),
                           "rows": len(rec.names)}
            if gref is not None:
                match[name]["grad_rows"] = len(gref)
                match[name]["grad_rel_diff_abs_max"] = rel_diff(rec.gbuf[:, 1], gref[:, 1])
                match[name]["grad_rows_written"] = int((rec.gbuf != 0).any(dim=1).sum())
        print(f"{name}: first step {first[name]}" + (f", vs eager {match[name]}" if name in match else ""),
              file=sys.stderr)
    result["first_step"], result["eager_match"] = first, match
    result["eager_frames"] = eager_frames(base, x, autocast)
    steps: Dict[str, Callable[[], float]] = {n: t.step for n, t in trainers.items()}
    for name in ("custom_sampled", "plain_sampled"):
        if name in names:
            own = name.split("_")[0]
            if own not in trainers:
                p.error(f"--variants: {name} needs {own}")
            steps[name] = trainers[own].sampled_step
    for trainer in trainers.values():
        for _ in range(args.warmup):
            trainer.step()
    before = _graph_counts()
    # a full collection before every step keeps one step's garbage off the next one's time; a
    # --quick run times nothing worth it, and each collection walks dynamo's and inductor's heap
    variants = run_bracketed(steps, args.rounds, settle=None if args.quick else gc.collect)
    after = _graph_counts()
    result["recompiles_while_timed"] = after["graphs"] - before["graphs"]
    for entry in variants.values():
        entry["median_interval_90"] = list(median_interval(entry["ratios"]))
        entry["ratio_mean"] = statistics.fmean(entry["ratios"])
    result["variants"] = variants
    if "watched" in trainers:
        result["watched_attributed"] = attribute(trainers["watched"], max(args.rounds, 5),
                                                 first["watched"]["custom_op_calls"])
    result["switches"] = {n: probe_switches(trainers[n]) for n in RECORDERS if n in trainers}
    result["detection"] = {n: probe_detection(trainers[n]) for n in RECORDERS if n in trainers}
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def report(result: dict) -> None:
    print(f"\n{'variant':<15} {'median':>7} {'90% interval':>15} {'min':>7} {'max':>7} {'mean':>7} "
          f"{'graphs':>6} {'breaks':>6} {'kernels':>7} {'op calls':>8}")
    for name, v in result["variants"].items():
        f = result["first_step"].get(name) or result["first_step"].get(name[:-len("_sampled")], {})
        lo, hi = v["median_interval_90"]
        print(f"{name:<15} {v['ratio_median']:>7.3f} {lo:>7.3f}..{hi:<7.3f} {v['ratio_min']:>7.3f} "
              f"{v['ratio_max']:>7.3f} {v['ratio_mean']:>7.3f} {f.get('graphs', 0):>6} "
              f"{f.get('graph_breaks', 0):>6} {f.get('kernels', 0):>7} {f.get('custom_op_calls', 0):>8}")
    print(f"recompiles while timed: {result['recompiles_while_timed']}")
    for name in ("watched", "watched_sampled", "wrapped"):
        if name in result["first_step"]:
            print(f"{name}: {result['first_step'][name]['frames']} frames in its first batch (eager watching: "
                  f"{result['eager_frames']})")
    for name, m in result["eager_match"].items():
        print(f"{name} vs eager hooks ({m['rows']} rows): max rel diff abs max {m['rel_diff_abs_max']:.2e}, "
              f"abs min {m['rel_diff_abs_min']:.2e} (over the row's abs max {m['abs_min_diff_over_abs_max']:.2e})"
              + (f"; output gradients: {m['grad_rows_written']} of {m['grad_rows']} rows written, max rel diff "
                 f"abs max {m['grad_rel_diff_abs_max']:.2e}" if "grad_rows" in m else ""))
    a = result.get("watched_attributed")
    if a:
        print(f"watched, attributed (time in the ops' bodies over the step): median {a['share_median']:.1%} "
              f"(min {a['share_min']:.1%}, max {a['share_max']:.1%}); plus op dispatch {a['op_calls_per_step']} x "
              f"{a['op_dispatch_us']:.1f} us = {a['dispatch_share']:.1%}")
    for name, s in result["switches"].items():
        print(f"{name} switches: " + ", ".join(
            f"{k} {v['recompiles']} recompile(s) {'written' if v['buffer_written'] else 'not written'}"
            for k, v in s.items()))
    for name, d in result["detection"].items():
        print(f"{name} detection: inf born in {d['born_in']} (expected {d['expected']})")


if __name__ == "__main__":
    sys.exit(main())
