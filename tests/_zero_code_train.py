"""A training script that never imports tensorwatch_otel, run by the zero-code tests under
`opentelemetry-instrument`. argv: a comma-separated list of `lightning` (a clean fit) and
`transformers` (a tiny GPT-2 whose weight turns inf at step 3; the raise leaves the script), then
`app` (the script sets up its own OpenTelemetry providers exporting to $RECEIVER, as an
application would) or `env` (the distro sets them up from OTEL_* variables). $TRAINER_DEBUG is
the Trainer's `debug` argument (e.g. `underflow_overflow`).

Prints `OBSERVED {json}` lines: hooks on the model during and after training, what was raised.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

torch.set_num_threads(1)
frameworks, providers = sys.argv[1].split(","), sys.argv[2]
KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooks(model) -> int:
    n = sum(len(getattr(m, k) or ()) for m in model.modules() for k in KINDS)
    return n + sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or ()) for p in model.parameters())


def observed(**kw) -> None:
    print("OBSERVED " + json.dumps(kw), flush=True)


if providers == "app":
    from opentelemetry import metrics, trace
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    base = os.environ["RECEIVER"]
    resource = Resource.create({"service.name": "app-providers"})
    tp = TracerProvider(resource=resource)
    tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=base + "/v1/traces")))
    trace.set_tracer_provider(tp)
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=base + "/v1/metrics"),
                                           export_interval_millis=500)
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=[reader]))
    app_span = trace.get_tracer("train-script").start_as_current_span("train-script.run")
else:
    import contextlib

    app_span = contextlib.nullcontext()

with app_span:
    if "lightning" in frameworks:
        import lightning.pytorch as pl
        from torch import nn

        class Regressor(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.inp = nn.Linear(8, 8)
                self.out = nn.Linear(8, 1)

            def forward(self, x):
                return self.out(torch.relu(self.inp(x)))

            def training_step(self, batch, batch_idx):
                x, y = batch
                return nn.functional.mse_loss(self(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        during = []

        class Probe(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, *args):
                during.append(hooks(pl_module))

        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
        lit = Regressor()
        trainer = pl.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu", devices=1, callbacks=[Probe()])
        trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=4))
        observed(framework="lightning", hooks_during=during, hooks_after=hooks(lit),
                 callbacks=[type(c).__module__ + "." + type(c).__name__ for c in trainer.callbacks])

    if "transformers" in frameworks:
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                           bos_token_id=0, eos_token_id=0))
        ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(0))
        dataset = [{"input_ids": row, "labels": row} for row in ids]
        during = []

        class Poison(TrainerCallback):
            def on_step_begin(self, args, state, control, model=None, **kw):
                during.append(hooks(model))
                if state.global_step == 3:
                    with torch.no_grad():
                        model.transformer.h[1].mlp.c_fc.weight.fill_(math.inf)

        args = TrainingArguments(output_dir=os.environ.get("OUT_DIR", "out"), max_steps=6,
                                 per_device_train_batch_size=4, report_to="none", save_strategy="no",
                                 use_cpu=True, disable_tqdm=True, logging_strategy="no", seed=0,
                                 debug=os.environ.get("TRAINER_DEBUG", ""))
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[Poison()])
        try:
            trainer.train()
            observed(framework="transformers", raised=None, hooks_during=during, hooks_after=hooks(model))
        except Exception as exc:
            observed(framework="transformers", raised=type(exc).__name__, hooks_during=during,
                     hooks_after=hooks(model), is_value_error=isinstance(exc, ValueError))
            raise
