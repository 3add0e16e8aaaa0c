"""The watcher's own share of a step, timed inside that step.

On a CPU the watcher's work is synchronous: everything it adds runs inside the hooks it
registers (module pre/forward hooks, gradient hooks, the global optimizer step hooks; the batch
end and the sinks run inside them too). Timing those calls within the step, with the step's own
clock, gives a ratio that machine drift cannot move much: both parts of it come from the same
seconds. It leaves out the indirect costs (caches the statistics evict, memory), which only the
paired rounds see, so it is a companion to them, not a substitute.

Two costs lie outside the hooks' bodies and are added from their own measurement: torch's
dispatch of a hooked module call (the slower call path a module with hooks takes), measured on
an empty module with empty hooks and counted per module call of the step; and a Prometheus
scrape, which runs on the server's thread: one timed collection spread over the scrape interval.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional

import torch

from bench_step import INTERVALS, PROMETHEUS_SINKS, Trainer


class HookClock:
    """Wraps every hook the watcher registers while `patched()` is active and adds up the time
    spent in them (outermost calls only), step by step."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.total = 0.0
        self._inside = False
        self.calls = 0  # forward hooks run: module calls
        self.per_step: List[float] = []
        self.calls_per_step: List[int] = []
        self.step_s: List[float] = []

    def wrap(self, fn: Callable, counts: bool = False) -> Callable:
        clock = self.clock

        def timed(*args, **kwargs):
            if counts:
                self.calls += 1
            if self._inside:
                return fn(*args, **kwargs)
            self._inside = True
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += clock() - t0
                self._inside = False
        return timed

    @contextlib.contextmanager
    def patched(self) -> Iterator["HookClock"]:
        from tensorwatch_otel.core.frames import quiet
        from tensorwatch_otel.core.steps import tracker as steps

        wrap = self.wrap
        saved = []

        def patch(owner, name, make):
            orig = getattr(owner, name)
            saved.append((owner, name, orig))
            setattr(owner, name, make(orig))

        patch(torch.nn.Module, "register_forward_pre_hook",
              lambda orig: lambda self, hook, **kw: orig(self, wrap(hook), **kw))
        patch(torch.nn.Module, "register_forward_hook",
              lambda orig: lambda self, hook, **kw: orig(self, wrap(hook, counts=True), **kw))
        patch(torch.Tensor, "register_post_accumulate_grad_hook",
              lambda orig: lambda self, hook: orig(self, wrap(hook)))
        patch(torch.Tensor, "register_hook", lambda orig: lambda self, hook: orig(self, wrap(hook)))
        patch(quiet, "register_module_forward_pre_hook", lambda orig: lambda hook: orig(wrap(hook)))  # the sentry
        patch(steps, "register_optimizer_step_pre_hook", lambda orig: lambda hook: orig(wrap(hook)))
        patch(steps, "register_optimizer_step_post_hook", lambda orig: lambda hook: orig(wrap(hook)))
        try:
            yield self
        finally:
            for owner, name, orig in reversed(saved):
                setattr(owner, name, orig)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Entered around each step (Trainer.step_context): keeps that step's hook time."""
        before, calls = self.total, self.calls
        t0 = self.clock()
        try:
            yield
        finally:
            self.step_s.append(self.clock() - t0)
            self.per_step.append(self.total - before)
            self.calls_per_step.append(self.calls - calls)


def hook_dispatch_s(clock: Callable[[], float], calls: int = 2000, repeats: int = 7) -> float:
    """Seconds torch adds to one module call for a pre-hook and a forward hook (with_kwargs,
    always_call, as the watcher registers them) that do nothing: median of paired repeats."""
    plain, hooked = torch.nn.Identity(), torch.nn.Identity()
    hooked.register_forward_pre_hook(lambda m, a: None)
    hooked.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True, always_call=True)
    x = torch.zeros(1)
    diffs = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            plain(x)
        t1 = clock()
        for _ in range(calls):
            hooked(x)
        t2 = clock()
        diffs.append(((t2 - t1) - (t1 - t0)) / calls)
    return max(statistics.median(diffs), 0.0)


def scrape_s(sink) -> Optional[float]:
    """Median seconds of one full collection of a PrometheusMetrics sink (what a scrape costs)."""
    from prometheus_client import generate_latest

    registry = getattr(sink, "registry", None)
    if registry is None:
        return None
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        generate_latest(registry)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def steady_state(total: List[float], hooks: List[float], interval: int) -> dict:
    """A sampling variant's attributed ratio in steady state: its steps after the first quarter
    (the budget measures every batch until it knows its costs) cut into blocks of `interval`
    steps (one measured batch and the unmeasured ones after it, whatever the phase), each block's
    ratio sum(step) / sum(step - hooks); the median and range over blocks, and all those steps
    pooled."""
    skip = max(3, len(total) // 4)
    t, h = total[skip:], hooks[skip:]
    blocks = [(sum(t[i:i + interval]), sum(h[i:i + interval])) for i in range(0, len(t) - interval + 1, interval)]
    ratios = sorted(a / (a - b) for a, b in blocks) or [math.nan]
    return {"interval": interval, "steady_steps": len(t), "steady_blocks": len(blocks),
            "steady_pooled": sum(t) / (sum(t) - sum(h)) if t else math.nan,
            "steady_median": statistics.median(ratios), "steady_min": ratios[0], "steady_max": ratios[-1]}


def attribute(variants: Dict[str, Callable[[int], List[float]]], names: List[str], steps: int,
              scrape_interval: float) -> Dict[str, dict]:
    """Per watched variant: hook time per step and the attributed ratio step / (step - hooks),
    over `steps` steps (after one untimed); prints a table."""
    out: Dict[str, dict] = {}
    dispatch = hook_dispatch_s(Trainer.clock)
    for name in names:
        if name in ("unwatched", "null", "peer") or name not in variants:
            continue
        hc = HookClock(Trainer.clock)
        Trainer.step_context = hc.step
        try:
            with hc.patched():
                variants[name](steps + 1)
        finally:
            Trainer.step_context = None
        hooks = [h + c * dispatch for h, c in zip(hc.per_step[1:], hc.calls_per_step[1:])]
        total = hc.step_s[1:]
        ratios = sorted(t / (t - h) for t, h in zip(total, hooks))
        entry = {"hook_ms_median": statistics.median(hooks) * 1000, "module_calls": hc.calls_per_step[-1],
                 "dispatch_us_per_call": dispatch * 1e6,
                 "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1],
                 "ratios": ratios}
        if name == "budget":
            entry.update(steady_state(total, hooks, INTERVALS.get(name, 1)))
        if name == "prometheus" and PROMETHEUS_SINKS and scrape_interval > 0:
            one = scrape_s(PROMETHEUS_SINKS[-1])
            if one is not None:
                step = statistics.median(total)
                entry["scrape_ms"] = one * 1000
                # a scrape every scrape_interval seconds of wall time: its share of each step
                entry["ratio_median"] += one / scrape_interval
                entry["scrape_share"] = one / scrape_interval
                entry["step_ms_median"] = step * 1000
        out[name] = entry
    if out:
        print(f"\nattributed: time in the watcher's hooks, plus {dispatch * 1e6:.1f} us of torch's hook dispatch "
              f"per module call")
        print(f"{'attributed':<16} {'hooks ms/step':>13} {'ratio median':>12} {'min':>7} {'max':>7}")
        for name, e in out.items():
            extra = (f"  (+ scrape {e['scrape_ms']:.1f} ms every {scrape_interval:g} s: "
                     f"+{e['scrape_share'] * 100:.2f}%)" if "scrape_ms" in e else "")
            print(f"{name:<16} {e['hook_ms_median']:>13.1f} {e['ratio_median']:>12.3f} {e['ratio_min']:>7.3f} "
                  f"{e['ratio_max']:>7.3f}{extra}")
            if "steady_pooled" in e:
                print(f"{'':<16} steady state: one batch in {e['interval']} measured; {e['steady_steps']} steps "
                      f"in {e['steady_blocks']} blocks of {e['interval']}: median {e['steady_median']:.4f} "
                      f"(min {e['steady_min']:.4f}, max {e['steady_max']:.4f}), pooled {e['steady_pooled']:.4f}")
    return out
