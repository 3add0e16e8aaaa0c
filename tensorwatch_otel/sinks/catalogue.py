"""The metric catalogue: every series' Prometheus name, OpenTelemetry name, help text, unit and
labels, written once and read by the Prometheus sink, the OpenTelemetry sink and the deploy/ checks.

Nothing here imports an exporter; the sinks build their families and instruments from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..core.events import Place, label_for_module

__all__ = ["Series", "SERIES", "BY_KEY", "ATTRIBUTES", "WINDOW_TEXT", "prometheus_names", "otel_attributes",
           "collector_name", "SPANS", "FRAME_EVENT", "SPAN_ATTRIBUTES", "span_attribute", "place_attributes"]

#: Prometheus label -> OpenTelemetry attribute of the same value.
ATTRIBUTES: Dict[str, str] = {
    "module": "tensorwatch.module.path",
    "module_class": "tensorwatch.module.class",
    "tensor": "tensorwatch.tensor",
    "dtype": "tensorwatch.dtype",
    "target_dtype": "tensorwatch.target_dtype",
    "rank": "tensorwatch.rank",
    "first_rank": "tensorwatch.first_rank",
}

WINDOW_TEXT = "the batches of the last window (TENSORWATCH_METRICS_WINDOW_SECONDS)"

_PAIR = ("module", "module_class", "tensor")
_DETECTION = _PAIR + ("rank", "first_rank")


@dataclass(frozen=True)
class Series:
    """One series family. ``prom``: the Prometheus family name (counters without ``_total``),
    None when only OpenTelemetry exports it; ``otel``: the instrument name, None when only
    Prometheus serves it. ``labels`` are Prometheus labels; the OpenTelemetry attributes are
    their ATTRIBUTES names."""

    key: str
    kind: str  # "gauge", "counter" or "histogram"
    help: str
    labels: Tuple[str, ...]
    prom: Optional[str] = None
    otel: Optional[str] = None
    unit: str = ""  # the OpenTelemetry unit (UCUM)

    @property
    def prom_series(self) -> Optional[str]:
        """The name a query uses (counters end in ``_total``)."""
        if self.prom is None:
            return None
        return self.prom + "_total" if self.kind == "counter" else self.prom

    @property
    def attributes(self) -> Tuple[str, ...]:
        return tuple(ATTRIBUTES[label] for label in self.labels)


SERIES: Tuple[Series, ...] = (
    Series("abs_max", "gauge", f"Largest absolute value of the tensor over {WINDOW_TEXT}",
           _PAIR + ("rank",), "tensorwatch_tensor_abs_max", "tensorwatch.tensor.abs_max"),
    Series("abs_min", "gauge", f"Smallest absolute value of the tensor over {WINDOW_TEXT}",
           _PAIR + ("rank",), "tensorwatch_tensor_abs_min", "tensorwatch.tensor.abs_min"),
    Series("range_used", "gauge", "abs max divided by the largest finite value of the tensor's dtype, "
           f"largest over {WINDOW_TEXT}", _PAIR + ("dtype", "rank"),
           "tensorwatch_tensor_range_used_ratio", "tensorwatch.tensor.range_used", "1"),
    Series("underflow", "gauge", "Share of the tensor's non-zero finite values that become 0 when cast to "
           f"target_dtype (8-bit floats with per-tensor scaling), largest over {WINDOW_TEXT}",
           _PAIR + ("target_dtype", "rank"), "tensorwatch_tensor_underflow_ratio",
           "tensorwatch.tensor.underflow_ratio", "1"),
    Series("overflow", "gauge", "Share of the tensor's non-zero finite values beyond the largest finite value "
           f"of target_dtype (8-bit floats with per-tensor scaling), largest over {WINDOW_TEXT}",
           _PAIR + ("target_dtype", "rank"), "tensorwatch_tensor_overflow_ratio",
           "tensorwatch.tensor.overflow_ratio", "1"),
    Series("magnitude", "histogram", "Non-zero finite values of the tensor by power-of-two magnitude "
           "(|x| in (2^i, 2^(i+1)]; exact zeros in the zero bucket), summed over one sampled batch per collection",
           _PAIR + ("rank",), None, "tensorwatch.tensor.magnitude"),
    Series("nonfinite", "counter", "inf/nan detections, labelled with the first module and tensor where one "
           "appeared and the rank that detected first (exemplar: the detection span's trace_id)",
           _DETECTION, "tensorwatch_nonfinite_events", "tensorwatch.nonfinite.events", "{event}"),
    Series("stopped_by_rank", "counter", "Stops of this rank because first_rank detected inf/nan first "
           "(in module, tensor)", _DETECTION, "tensorwatch_stopped_by_rank_events",
           "tensorwatch.stopped_by_rank.events", "{event}"),
    Series("batches", "counter", "Watched batches", ("rank",), "tensorwatch_batches", "tensorwatch.batches",
           "{batch}"),
    Series("batch_number", "gauge", "Number of the last watched batch (0-based)", ("rank",),
           "tensorwatch_batch_number", "tensorwatch.batch_number"),
    Series("series_dropped", "gauge", "(module, tensor) pairs of the last batch left out by max_series",
           ("rank",), "tensorwatch_series_dropped"),
    Series("steps_skipped", "counter", "Optimizer steps skipped because the gradients held inf/nan", ("rank",),
           "tensorwatch_optimizer_steps_skipped", "tensorwatch.optimizer.steps_skipped", "{step}"),
    Series("grad_scale", "gauge", "The gradient scaler's loss scale", ("rank",), "tensorwatch_grad_scale",
           "tensorwatch.grad_scale"),
    Series("skip_streaks", "counter", "Times max_skipped_steps optimizer steps in a row were skipped", ("rank",),
           "tensorwatch_optimizer_skip_streaks", "tensorwatch.optimizer.skip_streaks", "{streak}"),
    Series("skip_streak", "gauge", "Consecutive skipped optimizer steps, as of the latest skip reported",
           ("rank",), "tensorwatch_optimizer_skip_streak", "tensorwatch.optimizer.skip_streak"),
    Series("skipped_nonfinite", "counter", "Optimizer steps on_detect=\"skip\" did not run because the gradients "
           "they would consume held inf/nan (or their batch's forward did)", ("rank",),
           "tensorwatch_skipped_nonfinite_steps", "tensorwatch.skipped_nonfinite_steps", "{step}"),
    Series("measure_every", "gauge", "The watcher measures one batch in this many: every_n_batches, or the "
           "interval max_overhead chose (detection runs on every batch)", ("rank",),
           "tensorwatch_measure_every_n_batches", "tensorwatch.measure_every_n_batches", "{batch}"),
    Series("overhead", "gauge", "max_overhead: the watcher's own time over the rest of the step's, over its "
           "last complete interval (a measured batch and the unmeasured ones after it)", ("rank",),
           "tensorwatch_overhead_ratio", "tensorwatch.overhead", "1"),
    # fleet mode of the Prometheus sink (detail=, docs/at-scale.md)
    Series("rank_worst", "gauge", "Largest range used of any (module, tensor) pair of this rank over the "
           "window, labelled with that pair (+Inf for an inf/nan value)", _PAIR + ("dtype", "rank"),
           "tensorwatch_rank_range_used_max_ratio"),
    Series("detail_cutoff", "gauge", "Largest range used among the pairs this rank does not serve as "
           "per-module series (TENSORWATCH_PROMETHEUS_DETAIL); 0 when it serves them all", ("rank",),
           "tensorwatch_detail_cutoff_ratio"),
    Series("detail_hidden", "gauge", "(module, tensor) pairs of the window this rank does not serve as "
           "per-module series", ("rank",), "tensorwatch_detail_hidden_pairs"),
)

BY_KEY: Dict[str, Series] = {s.key: s for s in SERIES}


def prometheus_names() -> Tuple[str, ...]:
    """Every series name a PromQL query may use (counters with ``_total``)."""
    return tuple(s.prom_series for s in SERIES if s.prom is not None)


def otel_attributes(labels: Dict[str, object]) -> Dict[str, object]:
    """Prometheus label values as OpenTelemetry attributes."""
    return {ATTRIBUTES[k]: v for k, v in labels.items()}


def collector_name(series: Series) -> Optional[str]:
    """The name the OpenTelemetry Collector's Prometheus exporter gives the instrument: dots to
    underscores, ``_ratio`` for unit ``1`` (once), ``_total`` for counters; None for histograms
    (see docs/telemetry.md for what Prometheus receives of those)."""
    if series.otel is None or series.kind == "histogram":
        return None
    name = series.otel.replace(".", "_")
    if series.unit == "1" and not name.endswith("_ratio"):
        name += "_ratio"
    return name + "_total" if series.kind == "counter" else name


# -- spans -----------------------------------------------------------------------------------------
#: event type (the JSON lines "event") -> the span OtelTelemetry makes of it, with what it is
SPANS: Dict[str, Tuple[str, str]] = {
    "nonfinite_detected": ("tensorwatch.nonfinite_detected", "the first inf/nan: status ERROR, the place, the "
                           "report, the frames that led to it as `tensorwatch.frame` span events"),
    "batch_trace": ("tensorwatch.batch_trace", "a traced batch: every frame as a `tensorwatch.frame` span event "
                    "(split over several spans, children of the first, past the SDK's event limit)"),
    "overflow_check": ("tensorwatch.overflow_check", "a `detect_overflow(var, ctx)` call (status ERROR when it "
                       "found inf/nan)"),
    "abort_after_batch": ("tensorwatch.abort_after_batch", "`abort_after_batch` was reached"),
    "stopped_by_rank": ("tensorwatch.stopped_by_rank", "this rank stopped because another rank detected first "
                        "(status ERROR, the first rank's place)"),
    "skipped_steps_streak": ("tensorwatch.skipped_steps_streak", "`max_skipped_steps` optimizer steps in a row "
                             "skipped (status ERROR)"),
    "skipped_nonfinite_step": ("tensorwatch.skipped_nonfinite_step", "a step `on_detect=\"skip\"` did not run "
                               "(not an error: training goes on)"),
}
#: the span event each frame becomes
FRAME_EVENT = "tensorwatch.frame"

#: span and span-event attributes beyond ATTRIBUTES: key -> (attribute name, what it holds)
SPAN_ATTRIBUTES: Dict[str, Tuple[str, str]] = {
    "batch_number": ("tensorwatch.batch_number", "the batch (int)"),
    "kind": ("tensorwatch.nonfinite.kind", "`inf`, `nan` or `inf,nan`"),
    "report": ("tensorwatch.report", "the text report (at most 1 MiB: the frames nearest the detection)"),
    "report_frames_omitted": ("tensorwatch.report.frames_omitted", "frames left out of the start of "
                              "`tensorwatch.report` to bound its size (the JSON lines event log holds every frame)"),
    "phase": ("tensorwatch.phase", "`forward`, `backward` or `optimizer`"),
    "capture": ("tensorwatch.capture", "the capture file (`capture_dir`)"),
    "reproduced": ("tensorwatch.reproduced", "`rerun_on_detect`: whether a replay found the same inf/nan"),
    "host": ("host.name", "`rerun_on_detect`: the host that ran the batch"),
    "verdict": ("tensorwatch.verdict", "`rerun_on_detect` on a compiled model: `model`, `compiler`, `transient`"),
    "uncertain": ("tensorwatch.uncertain", "why the place (or `reproduced`/`verdict`) may not say where the inf/nan "
                  "was born: a replay could not run the batch as it ran"),
    "frames_omitted": ("tensorwatch.frames.omitted", "frames left out of the span events: past the SDK's event "
                       "limit, or past 1 MiB of them (the report has more, the JSON lines event log all)"),
    "link": ("tensorwatch.link", "on the link to the training step's span: `training step`"),
    "ctx": ("tensorwatch.ctx", "`detect_overflow`'s ctx string"),
    "stopped_at_batch": ("tensorwatch.stopped_at_batch", "this rank's batch when it stopped"),
    "skip_streak": ("tensorwatch.optimizer.skip_streak", "skipped steps in a row, this one included"),
    "grad_scale": ("tensorwatch.grad_scale", "the GradScaler's scale, when known"),
    "trace_part": ("tensorwatch.trace.part", "a traced batch's span: its number (from 1)"),
    "trace_parts": ("tensorwatch.trace.parts", "a traced batch's spans"),
    "frame_count": ("tensorwatch.frame.count", "a traced batch's frames"),
    "frame_index": ("tensorwatch.frame.index", "a frame's place in its span's ring (from 0)"),
    "tensors": ("tensorwatch.tensors", "a frame's tensors with statistics (string[])"),
    "abs_min": ("tensorwatch.abs_min", "their abs min, parallel to `tensorwatch.tensors` (double[])"),
    "abs_max": ("tensorwatch.abs_max", "their abs max (double[])"),
    "dtypes": ("tensorwatch.dtypes", "their dtypes (string[])"),
    "notes": ("tensorwatch.notes", "tensors without statistics, `name: why` (string[])"),
    "underflow": ("tensorwatch.underflow", "`target_dtypes`: `tensorwatch.underflow.<dtype>`, shares parallel to "
                  "`tensorwatch.tensors` (double[])"),
    "overflow": ("tensorwatch.overflow", "`target_dtypes`: `tensorwatch.overflow.<dtype>` (double[])"),
}


def span_attribute(key: str) -> str:
    """The attribute name of SPAN_ATTRIBUTES' `key`, or of ATTRIBUTES' label `key`."""
    found = SPAN_ATTRIBUTES.get(key)
    return found[0] if found is not None else ATTRIBUTES[key]


def place_attributes(place: Place) -> Dict[str, str]:
    """The module path (`(root)` for the root), class and tensor of `place` as attributes."""
    return {ATTRIBUTES["module"]: label_for_module(place.module), ATTRIBUTES["module_class"]: place.module_class,
            ATTRIBUTES["tensor"]: place.tensor}
