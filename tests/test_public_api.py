"""The public import surface (README, docs/) is pinned here: names, signatures, py.typed, and an
`import tensorwatch_otel` that loads no exporter library."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import tensorwatch_otel
import tensorwatch_otel.sinks

CONTRACT_NAMES = {"watch", "Watcher", "NonFiniteDetected", "DebugUnderflowOverflow", "detect_overflow", "load_capture"}
CONTRACT_SINKS = {"TextReport", "JsonlLog", "PrometheusMetrics", "OtelTelemetry"}


def test_top_level_all():
    names = set(tensorwatch_otel.__all__)
    assert CONTRACT_NAMES <= names
    assert len(tensorwatch_otel.__all__) == len(names)  # no duplicates
    for n in names:
        assert hasattr(tensorwatch_otel, n), n
    assert not [n for n in names if n.startswith("_") and n != "__version__"]
    assert isinstance(tensorwatch_otel.__version__, str) and tensorwatch_otel.__version__


def test_sinks_all_names_resolve_lazily():
    assert CONTRACT_SINKS <= set(tensorwatch_otel.sinks.__all__)
    for n in ("TextReport", "JsonlLog"):
        assert isinstance(getattr(tensorwatch_otel.sinks, n), type)
    assert issubclass(tensorwatch_otel.sinks.JsonlLog, tensorwatch_otel.sinks.Sink)
    assert issubclass(tensorwatch_otel.sinks.TextReport, tensorwatch_otel.sinks.Sink)


def test_exceptions_are_value_errors():
    assert issubclass(tensorwatch_otel.NonFiniteDetected, ValueError)
    assert issubclass(tensorwatch_otel.AbortAfterBatch, ValueError)


def test_watch_signature_matches_contract():
    # The contract's defaults (max_frames=21, trace_batches=(), every_n_batches=1,
    # gradients=False, on_detect="raise") are the effective defaults; in the signature an option
    # that has a TENSORWATCH_* variable defaults to None, meaning "from the environment, else the
    # default" (pinned deliberately: a literal default there would shadow the variable).
    from tensorwatch_otel.core.config import WatchConfig

    sig = inspect.signature(tensorwatch_otel.watch)
    params = sig.parameters
    assert list(params)[0] == "model"
    want = {"sinks": None, "max_frames": None, "trace_batches": None, "abort_after_batch": None,
            "every_n_batches": None, "gradients": None, "include": None, "exclude": None, "on_detect": None}
    for name, default in want.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default is default, name
    effective = WatchConfig.build(environ={})
    assert (effective.max_frames, effective.trace_batches, effective.abort_after_batch, effective.every_n_batches,
            effective.gradients, effective.include, effective.exclude, effective.on_detect) == \
        (21, frozenset(), None, 1, False, (), (), "raise")


def test_dropin_signatures_match_the_peer():
    sig = inspect.signature(tensorwatch_otel.DebugUnderflowOverflow)
    assert [(p.name, p.default) for p in sig.parameters.values()] == [
        ("model", inspect.Parameter.empty), ("max_frames_to_save", 21), ("trace_batch_nums", None),
        ("abort_after_batch_num", None)]
    assert list(inspect.signature(tensorwatch_otel.detect_overflow).parameters) == ["var", "ctx"]


def test_watcher_surface():
    import torch

    w = tensorwatch_otel.watch(torch.nn.Linear(2, 2), sinks=[])
    assert w.batch_number == 0
    assert hasattr(w, "__enter__") and hasattr(w, "__exit__")
    w.detach()
    w.detach()


def test_py_typed_shipped():
    pkg = os.path.dirname(tensorwatch_otel.__file__)
    assert os.path.isfile(os.path.join(pkg, "py.typed"))


def test_import_loads_no_exporter_library():
    code = textwrap.dedent("""
        import sys
        import tensorwatch_otel
        import tensorwatch_otel.sinks
        from tensorwatch_otel import watch, DebugUnderflowOverflow, detect_overflow
        from tensorwatch_otel.sinks import TextReport, JsonlLog
        bad = sorted(m for m in sys.modules
                     if m.split(".")[0] in ("opentelemetry", "prometheus_client"))
        print("LOADED:" + ",".join(bad))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED:\n" in proc.stdout, proc.stdout


def test_import_loads_neither_dynamo_nor_triton():
    """`import tensorwatch_otel` loads torch only: dynamo (about a second) loads at the first
    watch(), and Triton is left for the caller to import (a test suite chooses its interpreter
    with TRITON_INTERPRET before Triton's first import)."""
    code = textwrap.dedent("""
        import sys
        import tensorwatch_otel
        from tensorwatch_otel import watch
        print("LOADED:" + ",".join(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules)))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED:\n" in proc.stdout, proc.stdout
