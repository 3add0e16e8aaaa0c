"""Zero code: the `tensorwatch_otel` OpenTelemetry instrumentor. Its entry point, that importing
the package loads no framework, in-process instrument/uninstrument on real Trainers with the SDK's
in-memory exporter, and real `opentelemetry-instrument python script.py` runs (a script that never
imports tensorwatch_otel) exporting to a real OTLP receiver."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.instrumentation")

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from _hooks import remaining_hooks  # noqa: E402
from otlp_receiver import OtlpReceiver  # noqa: E402
from tensorwatch_otel import NonFiniteDetected  # noqa: E402
from tensorwatch_otel.integrations.otel_instrumentor import TensorwatchInstrumentor  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "_zero_code_train.py"
BAD = "transformer.h.1.mlp.c_fc"
EP = "tensorwatch_otel.integrations.otel_instrumentor:TensorwatchInstrumentor"


def test_entry_point_is_declared_in_pyproject():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["opentelemetry_instrumentor"] == {"tensorwatch_otel": EP}
    module, _, name = EP.partition(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert cls is TensorwatchInstrumentor and issubclass(cls, BaseInstrumentor)


def test_importing_the_package_and_instrumenting_loads_no_framework():
    code = textwrap.dedent("""
        import sys
        import tensorwatch_otel, tensorwatch_otel.integrations
        assert "opentelemetry.instrumentation" not in sys.modules
        from tensorwatch_otel.integrations.otel_instrumentor import TensorwatchInstrumentor
        TensorwatchInstrumentor().instrument()
        loaded = [m for m in ("transformers", "lightning", "pytorch_lightning", "accelerate") if m in sys.modules]
        assert not loaded, loaded
        import transformers.trainer  # the post-import hook patches the class the moment it exists
        assert type(transformers.trainer.Trainer.__dict__["__init__"]).__name__ == "FunctionWrapper"
        TensorwatchInstrumentor().uninstrument()
        assert type(transformers.trainer.Trainer.__dict__["__init__"]).__name__ == "function"
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_bad_variable_is_named_and_nothing_is_patched(monkeypatch, caplog):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TENSORWATCH_GRADIENTS", "maybe")
    inst = TensorwatchInstrumentor()
    inst.instrument()
    try:
        assert "TENSORWATCH_GRADIENTS='maybe'" in caplog.text
        assert type(transformers.Trainer.__dict__["__init__"]).__name__ == "function"
    finally:
        inst.uninstrument()


@pytest.fixture
def otel():
    spans = InMemorySpanExporter()
    tp = TracerProvider(shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    yield tp, mp, spans, reader
    tp.shutdown()
    mp.shutdown()


def test_instrumented_transformers_trainer_in_process(otel, tmp_path, monkeypatch):
    tf = pytest.importorskip("transformers")
    from _hf import Probe, tiny_gpt2, trainer_for

    from tensorwatch_otel.integrations.transformers import TensorwatchCallback

    tp, mp, spans, reader = otel
    monkeypatch.setenv("TENSORWATCH_MAX_FRAMES", "3")
    monkeypatch.setenv("TENSORWATCH_EXCLUDE", "lm_head")
    inst = TensorwatchInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=mp)
    try:
        model = tiny_gpt2()
        trainer = trainer_for(model, tmp_path, [Probe(poison_at=3)])
        [cb] = [c for c in trainer.callback_handler.callbacks if isinstance(c, TensorwatchCallback)]
        with pytest.raises(NonFiniteDetected) as info:
            trainer.train()
        assert info.value.event.module == BAD and len(info.value.event.frames) == 3
        assert remaining_hooks(model) == {} and cb.watcher is None
        [span] = [s for s in spans.get_finished_spans() if s.name == "tensorwatch.nonfinite_detected"]
        assert span.attributes["tensorwatch.module.path"] == BAD
        assert span.instrumentation_scope.name == "tensorwatch_otel"
        names = {dp.attributes["tensorwatch.module.path"]
                 for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics if m.name == "tensorwatch.tensor.abs_max" for dp in m.data.data_points}
        assert "transformer.h.0.attn.c_attn" in names and "lm_head" not in names
        # a user's own callback wins: no second one is added
        mine = TensorwatchCallback()
        other = trainer_for(tiny_gpt2(), tmp_path, [mine])
        assert [c for c in other.callback_handler.callbacks if isinstance(c, TensorwatchCallback)] == [mine]
    finally:
        inst.uninstrument()
    assert type(tf.Trainer.__dict__["__init__"]).__name__ == "function"
    later = trainer_for(tiny_gpt2(), tmp_path)
    assert not [c for c in later.callback_handler.callbacks if isinstance(c, TensorwatchCallback)]


def test_instrumented_lightning_trainer_in_process(otel):
    pl = pytest.importorskip("lightning.pytorch")
    from _lit import Regressor, loader, trainer

    from tensorwatch_otel.integrations.lightning import TensorwatchCallback

    tp, mp, spans, reader = otel
    inst = TensorwatchInstrumentor()
    inst.instrument(tracer_provider=tp, meter_provider=mp)
    try:
        model = Regressor(overflow_at=2)
        t = trainer([])
        assert [type(c) for c in t.callbacks].count(TensorwatchCallback) == 1
        with pytest.raises(NonFiniteDetected):
            t.fit(model, loader())
        assert remaining_hooks(model) == {}
        [span] = [s for s in spans.get_finished_spans() if s.name == "tensorwatch.nonfinite_detected"]
        assert span.attributes["tensorwatch.module.path"] == "boom"
        assert span.attributes["tensorwatch.batch_number"] == 2
        ptl = pytest.importorskip("pytorch_lightning")
        from tensorwatch_otel.integrations.pytorch_lightning import TensorwatchCallback as PtlCallback

        ptl_trainer = ptl.Trainer(logger=False, enable_checkpointing=False, accelerator="cpu", devices=1)
        assert [type(c) for c in ptl_trainer.callbacks].count(PtlCallback) == 1
    finally:
        inst.uninstrument()
    assert TensorwatchCallback not in [type(c) for c in trainer([]).callbacks]
    assert type(pl.Trainer.__dict__["__init__"]).__name__ != "FunctionWrapper"


# -- real opentelemetry-instrument runs -------------------------------------------------------------
def _instrument_command():
    """`opentelemetry-instrument` of the environment the tests run in; the command it runs is
    this interpreter (so the child sees this environment's entry points)."""
    here = Path(sys.executable).parent / "opentelemetry-instrument"
    exe = str(here) if here.exists() else shutil.which("opentelemetry-instrument")
    if exe:
        return [exe]
    return [sys.executable, "-c", "import sys; sys.argv[0] = 'opentelemetry-instrument'; "
            "from opentelemetry.instrumentation.auto_instrumentation import run; run()"]


def _need_entry_point():
    eps = [e for e in entry_points(group="opentelemetry_instrumentor") if e.name == "tensorwatch_otel"]
    if not eps:
        pytest.skip("this environment's metadata lacks the entry point: pip install --no-deps -e .")
    assert eps[0].value == EP


def _run(frameworks, providers, tmp_path, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TENSORWATCH_"))}
    base.update(PYTHONPATH=str(ROOT), OUT_DIR=str(tmp_path / "out"), OMP_NUM_THREADS="1")
    if providers == "app":  # the application sets its providers up: no configurator (distro) may first
        base["OTEL_PYTHON_CONFIGURATOR"] = "none"
    base.update(env)
    proc = subprocess.run(_instrument_command() + [sys.executable, str(SCRIPT), frameworks, providers],
                          env=base, capture_output=True, text=True, timeout=400, cwd=str(tmp_path))
    seen = {}
    for line in proc.stdout.splitlines():
        if line.startswith("OBSERVED "):
            o = json.loads(line[len("OBSERVED "):])
            seen[o["framework"]] = o
    return proc, seen


def _detections(r):
    return [s for s in r.spans() if s["name"] == "tensorwatch.nonfinite_detected"]


@pytest.mark.slow
def test_opentelemetry_instrument_watches_both_trainers_through_the_app_providers(tmp_path):
    _need_entry_point()
    events = tmp_path / "events.jsonl"
    with OtlpReceiver() as r:
        proc, seen = _run("lightning,transformers", "app", tmp_path, RECEIVER=r.http_endpoint,
                          TENSORWATCH_MAX_FRAMES="4", TENSORWATCH_JSONL=str(events))
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "NonFiniteDetected" in proc.stderr
        lit, hf = seen["lightning"], seen["transformers"]
        assert all(n > 0 for n in lit["hooks_during"]) and lit["hooks_after"] == 0
        assert "tensorwatch_otel.integrations.lightning.TensorwatchCallback" in lit["callbacks"]
        assert hf["raised"] == "NonFiniteDetected" and hf["is_value_error"]
        assert hf["hooks_during"][0] > 0 and hf["hooks_after"] == 0
        [span] = r.wait_for(_detections)
        a = span["attributes"]
        assert (a["tensorwatch.module.path"], a["tensorwatch.module.class"], a["tensorwatch.tensor"]) == \
            (BAD, "Conv1D", "weight")
        # batches 0-3 of the GPT-2 (Lightning's watcher was its own: numbering starts again)
        assert a["tensorwatch.batch_number"] == 3
        assert len([e for e in span["events"] if e["name"] == "tensorwatch.frame"]) == 4  # TENSORWATCH_MAX_FRAMES
        assert span["scope"][0] == "tensorwatch_otel"
        assert span["resource"]["service.name"] == "app-providers"  # the application's providers
        [app] = [s for s in r.spans() if s["name"] == "train-script.run"]
        assert span["trace_id"] == app["trace_id"] and span["parent_span_id"] == app["span_id"]
        gauges = r.wait_for(lambda rr: [m for m in rr.metrics() if m["name"] == "tensorwatch.tensor.abs_max"])
        assert {g["attributes"]["tensorwatch.module.path"] for g in gauges} & {"inp", "transformer.h.0.attn.c_attn"}
        # TENSORWATCH_JSONL: the detection was written durably before the raise
        lines = [json.loads(x) for x in events.read_text().splitlines()]
        assert [x["module"] for x in lines if x["event"] == "nonfinite_detected"] == [BAD]


@pytest.mark.slow
def test_opentelemetry_instrument_serves_the_trainers_debug_flag_alone(tmp_path):
    _need_entry_point()
    with OtlpReceiver() as r:
        # TrainingArguments(debug="underflow_overflow"): transformers would run its own checker too
        proc, seen = _run("transformers", "app", tmp_path, RECEIVER=r.http_endpoint,
                          TRAINER_DEBUG="underflow_overflow")
        assert proc.returncode == 1, proc.stderr[-3000:]
        hf = seen["transformers"]
        assert hf["raised"] == "NonFiniteDetected", proc.stderr[-3000:]
        assert hf["hooks_after"] == 0  # transformers' hooks (never removed by it) are gone too
        assert (proc.stdout + proc.stderr).count("Detected inf/nan during batch_number=") == 1
        assert "always_call" not in proc.stderr
        [span] = r.wait_for(_detections)
        a = span["attributes"]
        assert (a["tensorwatch.module.path"], a["tensorwatch.tensor"], a["tensorwatch.batch_number"]) == \
            (BAD, "weight", 3)


@pytest.mark.slow
def test_opentelemetry_instrument_with_the_distro_needs_no_code_at_all(tmp_path):
    _need_entry_point()
    pytest.importorskip("opentelemetry.distro")
    with OtlpReceiver() as r:
        proc, seen = _run("transformers", "env", tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=r.http_endpoint,
                          OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", OTEL_TRACES_EXPORTER="otlp_proto_http",
                          OTEL_METRICS_EXPORTER="otlp_proto_http", OTEL_LOGS_EXPORTER="none",
                          OTEL_SERVICE_NAME="zero-code", OTEL_METRIC_EXPORT_INTERVAL="500")
        assert proc.returncode == 1 and seen["transformers"]["raised"] == "NonFiniteDetected", proc.stderr[-3000:]
        assert seen["transformers"]["hooks_after"] == 0
        [span] = r.wait_for(_detections)  # once: the distro's providers, no second pipeline of ours
        assert span["attributes"]["tensorwatch.module.path"] == BAD
        assert span["resource"]["service.name"] == "zero-code"


@pytest.mark.slow
def test_disabled_instrumentations_turn_it_off(tmp_path):
    _need_entry_point()
    with OtlpReceiver() as r:
        proc, seen = _run("transformers", "app", tmp_path, RECEIVER=r.http_endpoint,
                          OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="tensorwatch_otel")
        assert proc.returncode == 0, proc.stderr[-3000:]
        hf = seen["transformers"]
        assert hf["raised"] is None and set(hf["hooks_during"]) == {0}
        r.wait_for(lambda rr: [s for s in rr.spans() if s["name"] == "train-script.run"])
        assert not [s for s in r.spans() if s["name"].startswith("tensorwatch.")]
