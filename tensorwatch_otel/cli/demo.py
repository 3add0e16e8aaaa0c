"""`tensorwatch-otel demo`: trains a tiny transformer in fp16 with the watcher on, optionally
injects a real fp16 overflow, and exports what the watcher saw (report, event log, metrics)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import List, Optional

from . import usage_error

HELP = "train a tiny transformer in fp16 with the watcher on (optionally with an injected overflow)"

DEFAULT_STEPS = 20
DEFAULT_JSONL = "tensorwatch-demo-events.jsonl"

DESCRIPTION = f"""\
Trains a tiny transformer language model (torch only: embeddings, 2 pre-norm attention+MLP
blocks, LM head) on synthetic tokens in fp16 mixed precision (autocast to float16 on the
CPU, fp32 master weights, loss scaling), with tensorwatch_otel watching every module.

Progress (one line per step) goes to stderr; the inf/nan report goes to stdout; every event
is written to a JSON lines log ({DEFAULT_JSONL} in the current directory unless --jsonl,
overwritten on each run). With --overflow-at-batch B the demo multiplies the weight of
blocks.1.mlp.fc1 by 1e5 in place just before batch B (as a runaway optimizer step would):
that layer's float16 output exceeds 65504 and becomes inf, the watcher stops training at
batch B and names the module. Batches are numbered from 0, one per training step.

Exit status: 0 no inf/nan, 3 inf/nan detected, 2 bad options.

examples:
  tensorwatch-otel demo
  tensorwatch-otel demo --steps 30 --overflow-at-batch 12
  tensorwatch-otel report {DEFAULT_JSONL}
  tensorwatch-otel diff {DEFAULT_JSONL}:11 {DEFAULT_JSONL}:12
  tensorwatch-otel demo --overflow-at-batch 12 --prometheus-port 9464 --serve-seconds 60
  tensorwatch-otel demo --otlp-endpoint http://127.0.0.1:4318
"""

EXIT_OK = 0
EXIT_DETECTED = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                        help=f"training steps (batches) to run (default {DEFAULT_STEPS})")
    parser.add_argument("--overflow-at-batch", type=int, default=None, metavar="B",
                        help="inject a real fp16 overflow so it appears in batch B (0 <= B < N)")
    parser.add_argument("--prometheus-port", type=int, default=None, metavar="P",
                        help="serve Prometheus metrics at http://ADDR:P/metrics (0: any free port)")
    parser.add_argument("--prometheus-addr", default="127.0.0.1", metavar="ADDR",
                        help="address the metrics endpoint listens on (default 127.0.0.1)")
    parser.add_argument("--otlp-endpoint", default=None, metavar="URL",
                        help="export spans and metrics over OTLP to URL (sets OTEL_EXPORTER_OTLP_ENDPOINT; "
                        "the other OTEL_* variables apply)")
    parser.add_argument("--jsonl", default=DEFAULT_JSONL, metavar="PATH",
                        help=f"event log to write (overwritten; default ./{DEFAULT_JSONL})")
    parser.add_argument("--serve-seconds", type=float, default=0.0, metavar="S",
                        help="keep the process and its metrics endpoint alive S seconds after training, "
                        "so Prometheus can scrape the final values")
    parser.add_argument("--trace", default=None, metavar="B1,B2,...",
                        help="batches whose every frame goes to the event log (default: the batch before "
                        "the overflow and the overflow batch, so `diff` can compare them; 'none' for none)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--threads", type=int, default=1, metavar="T",
                        help="torch intra-op threads (default 1: fastest for this tiny model)")
    parser.add_argument("--quiet", action="store_true", help="no per-step progress lines")


def _fail(msg: str) -> int:
    return usage_error("demo", msg)


def _check_options(args) -> Optional[str]:
    if args.steps < 1:
        return f"--steps {args.steps}: expected a number of steps >= 1"
    b = args.overflow_at_batch
    if b is not None and not 0 <= b < args.steps:
        return (f"--overflow-at-batch {b}: expected a batch number from 0 to {args.steps - 1} "
                f"(batches are numbered from 0; --steps is {args.steps})")
    p = args.prometheus_port
    if p is not None and not 0 <= p <= 65535:
        return f"--prometheus-port {p}: expected a port number from 0 to 65535"
    if not 0 <= args.serve_seconds < math.inf:  # time.sleep() takes no endless wait
        return f"--serve-seconds {args.serve_seconds}: expected a finite number of seconds >= 0"
    if args.threads < 1:
        return f"--threads {args.threads}: expected a number >= 1"
    if not args.jsonl:
        return "--jsonl: expected a file path"
    if os.path.isdir(args.jsonl):
        return f"--jsonl {args.jsonl}: is a directory; give a file path"
    if args.otlp_endpoint is not None and "://" not in args.otlp_endpoint:
        return f"--otlp-endpoint {args.otlp_endpoint!r}: expected a URL such as http://127.0.0.1:4318"
    return None


def _trace_batches(args) -> List[int]:
    if args.trace is None:
        b = args.overflow_at_batch
        return [] if b is None else sorted({max(b - 1, 0), b})
    if args.trace.strip().lower() in ("", "none"):
        return []
    out = []
    for part in args.trace.split(","):
        try:
            n = int(part)
        except ValueError:
            raise ValueError(f"--trace {args.trace!r}: expected batch numbers separated by commas") from None
        if n < 0:
            raise ValueError(f"--trace: {n} is not a batch number (>= 0)")
        out.append(n)
    return sorted(set(out))


def _otel_sink(endpoint: str):
    """An OtelTelemetry sink exporting to `endpoint`, or None (with the reason on stderr)."""
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    try:
        from ..sinks.otel_env import configure_from_env
        from ..sinks import OtelTelemetry
    except (ImportError, AttributeError) as exc:
        print(f"demo: OpenTelemetry export unavailable ({exc}); going on without it", file=sys.stderr)
        return None
    providers = configure_from_env(0)
    if providers is None:
        print("demo: OTEL_SDK_DISABLED=true: no OpenTelemetry export", file=sys.stderr)
        return None
    return OtelTelemetry(tracer_provider=providers[0], meter_provider=providers[1])


def run(args) -> int:
    problem = _check_options(args)
    if problem is None:
        try:
            traced = _trace_batches(args)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        return _fail(problem)
    # Sink failures (a taken port, an unreachable collector) are logged by the "tensorwatch_otel"
    # logger, never raised; without logging configured Python prints warnings and errors to stderr.

    import torch

    from .. import NonFiniteDetected, watch
    from ..sinks import JsonlLog
    from ._demo_model import DemoConfig, Trainer

    torch.set_num_threads(args.threads)
    jsonl = os.path.abspath(args.jsonl)
    try:
        os.makedirs(os.path.dirname(jsonl), exist_ok=True)
        open(jsonl, "w", encoding="utf-8").close()  # a fresh log: `report` shows this run only
    except OSError as exc:
        return _fail(f"--jsonl {args.jsonl}: cannot write: {exc}")

    sinks: list = [_detection_report(), JsonlLog(jsonl)]
    prom = None
    if args.prometheus_port is not None:
        from ..sinks import PrometheusMetrics

        prom = PrometheusMetrics(port=args.prometheus_port, addr=args.prometheus_addr)
        sinks.append(prom)
        if prom.url:
            print(f"demo: Prometheus metrics at {prom.url}", file=sys.stderr)
    if args.otlp_endpoint is not None:
        otel = _otel_sink(args.otlp_endpoint)
        if otel is not None:
            sinks.append(otel)
            print(f"demo: OTLP export to {args.otlp_endpoint}", file=sys.stderr)

    cfg = DemoConfig()
    trainer = Trainer(cfg, seed=args.seed)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    print(f"demo: training {type(trainer.model).__name__} ({n_params:,} parameters, {cfg.layers} blocks) "
          f"for {args.steps} steps in fp16 mixed precision on {cfg.batch_size}x{cfg.seq_len} synthetic "
          f"tokens; traced batches: {', '.join(map(str, traced)) or 'none'}", file=sys.stderr)

    event = None
    started = time.perf_counter()
    watcher = watch(trainer.model, sinks=sinks, trace_batches=traced)
    try:
        for step in range(args.steps):
            batch = watcher.batch_number
            note = ""
            if args.overflow_at_batch == batch:
                module = trainer.inject_overflow()
                note = f"  (overflow injected: {module}.weight scaled in place)"
            t0 = time.perf_counter()
            try:
                loss = trainer.step()
            except NonFiniteDetected as exc:
                event = exc.event
                _progress(args, f"step {step + 1:>3}/{args.steps}  batch {batch:>3}  inf/nan detected{note}")
                break
            ms = (time.perf_counter() - t0) * 1000
            _progress(args, f"step {step + 1:>3}/{args.steps}  batch {batch:>3}  loss {loss:7.4f}  "
                      f"{ms:7.1f} ms{note}")
    finally:
        watcher.detach()  # flushes every sink
    elapsed = time.perf_counter() - started

    if event is None:
        print(f"demo: {args.steps} steps in {elapsed:.1f} s, no inf/nan", file=sys.stderr)
    else:
        where = event.module or "(root)"
        print(f"demo: {event.kind} detected in {where} ({event.module_class}) {event.tensor} during "
              f"batch_number={event.batch_number}, after {elapsed:.1f} s; the report is above", file=sys.stderr)
    if event is not None or traced:
        print(f"demo: event log: {jsonl} (render it: tensorwatch-otel report {args.jsonl})", file=sys.stderr)
    else:  # this run detected and traced nothing: no event of it to render
        print(f"demo: event log: {jsonl} (nothing written by this run: no detection, no traced batch)",
              file=sys.stderr)
    if len(traced) == 2 and event is not None:
        a, b = traced
        print(f"demo: compare the traced batches: tensorwatch-otel diff {args.jsonl}:{a} {args.jsonl}:{b}",
              file=sys.stderr)

    _serve(args, prom)
    for s in sinks:
        try:
            s.close()
        except Exception as exc:  # closing must not turn a finished demo into a traceback
            print(f"demo: closing {type(s).__name__} failed: {exc}", file=sys.stderr)
    return EXIT_OK if event is None else EXIT_DETECTED


def _progress(args, line: str) -> None:
    if not args.quiet:
        print(line, file=sys.stderr, flush=True)


def _serve(args, prom) -> None:
    if args.serve_seconds <= 0:
        return
    if prom is None and args.otlp_endpoint is None:
        print("demo: --serve-seconds: nothing to serve without --prometheus-port or --otlp-endpoint",
              file=sys.stderr)
        return
    where = prom.url if prom is not None and prom.url else "the OTLP exporters"
    print(f"demo: serving {where} for {args.serve_seconds:g} s", file=sys.stderr, flush=True)
    time.sleep(args.serve_seconds)


def _detection_report():
    """A TextReport for detections only: traced batches go to the event log (see `report`)."""
    from ..core.events import BatchTraceEvent
    from ..sinks import TextReport

    class DetectionReport(TextReport):
        def on_event(self, event) -> None:
            if not isinstance(event, BatchTraceEvent):
                super().on_event(event)

    return DetectionReport()
