"""The ``tensorwatch.tensor.magnitude`` exponential histogram: pre-bucketed counts (scale 0,
zeros counted) that no SDK instrument can record (a Histogram takes one value per call).

The points are added to what each reader of the SDK meter provider collects: the provider hands
every reader its collect callback (``MetricReader._set_collect_callback``), and a hook around
that callback appends this sink's metric to the collected ``MetricsData`` in the package's
instrumentation scope. Readers, exporters and views are left as they are; a provider that is
not the SDK's (no readers to reach) gets no histogram, said once in the log.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable, List, Optional

from opentelemetry.sdk.metrics.export import (AggregationTemporality, Buckets, ExponentialHistogram,
                                              ExponentialHistogramDataPoint, Metric, MetricsData, ResourceMetrics,
                                              ScopeMetrics)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from .catalogue import ATTRIBUTES, BY_KEY

log = logging.getLogger(__name__)

SERIES = BY_KEY["magnitude"]
_EMPTY = Buckets(offset=0, bucket_counts=[])
_told: set = set()


class _CollectHook:
    """Wraps a reader's collect callback; adds the points of every attached source."""

    def __init__(self, inner: Callable, resource: Any, scope: InstrumentationScope):
        self.inner = inner
        self.resource = resource
        self.scope = scope
        self.sources: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._failed = False

    def __call__(self, reader: Any, timeout_millis: float = 10_000) -> Optional[MetricsData]:
        data = self.inner(reader, timeout_millis=timeout_millis)
        try:
            return self._add(data)
        except Exception as exc:  # never cost the application its other metrics
            if not self._failed:
                self._failed = True
                log.warning("tensorwatch_otel: adding %s to the export failed: %s: %s", SERIES.otel,
                            type(exc).__name__, exc)
            return data

    def _add(self, data: Optional[MetricsData]) -> Optional[MetricsData]:
        points: List[ExponentialHistogramDataPoint] = []
        for source in list(self.sources):
            points += source.magnitude_points()
        if not points:
            return data
        metric = Metric(name=SERIES.otel, description=SERIES.help, unit=SERIES.unit,
                        data=ExponentialHistogram(data_points=points,
                                                  aggregation_temporality=AggregationTemporality.CUMULATIVE))
        if data is None or not data.resource_metrics:
            return MetricsData([ResourceMetrics(self.resource, [ScopeMetrics(self.scope, [metric], "")], "")])
        first, rest = data.resource_metrics[0], list(data.resource_metrics[1:])
        scopes = list(first.scope_metrics)
        for i, sm in enumerate(scopes):
            if sm.scope.name == self.scope.name:
                scopes[i] = ScopeMetrics(sm.scope, list(sm.metrics) + [metric], sm.schema_url)
                break
        else:
            scopes.append(ScopeMetrics(self.scope, [metric], ""))
        return MetricsData([ResourceMetrics(first.resource, scopes, first.schema_url)] + rest)


def attach(provider: Any, source: Any, scope: InstrumentationScope) -> List[_CollectHook]:
    """Hooks `source` (``source.magnitude_points()`` returns data points; held weakly) into every
    reader of an SDK meter provider."""
    config = getattr(provider, "_sdk_config", None)
    readers = getattr(provider, "_metric_readers", None)  # SDK 1.4x
    if readers is None:
        readers = getattr(config, "metric_readers", None)  # SDK 1.35 (the declared minimum)
    hooks = []
    for reader in readers or ():
        inner = getattr(reader, "_collect", None)
        setter = getattr(reader, "_set_collect_callback", None)
        if inner is None or not callable(setter):
            continue
        hook = inner if isinstance(inner, _CollectHook) else \
            _CollectHook(inner, getattr(config, "resource", None), scope)
        if hook is not inner:
            setter(hook)
        hook.sources.add(source)
        hooks.append(hook)
    if not hooks:
        kind = type(provider).__name__
        if kind not in _told:
            _told.add(kind)
            log.info("tensorwatch_otel: the meter provider (%s) has no SDK metric readers to reach; %s is not "
                     "exported through it (the gauges are)", kind, SERIES.otel)
    return hooks


def detach(hooks: List[_CollectHook], source: Any) -> None:
    for hook in hooks:
        hook.sources.discard(source)


def data_points(rows: list, rank: int, encode: Callable[[str], str]) -> List[ExponentialHistogramDataPoint]:
    """Window.magnitude_rows() as data points (cumulative since each pair was first seen)."""
    now = time.time_ns()
    out = []
    for module, cls, tensor, zeros, offset, counts, start in rows:
        attrs = {ATTRIBUTES["module"]: encode(module), ATTRIBUTES["module_class"]: encode(cls),
                 ATTRIBUTES["tensor"]: encode(tensor), ATTRIBUTES["rank"]: rank}
        positive = Buckets(offset=offset, bucket_counts=list(counts)) if counts else _EMPTY
        # sum, min and max are unknown (only the buckets are counted): left unset in OTLP
        out.append(ExponentialHistogramDataPoint(
            attributes=attrs, start_time_unix_nano=start, time_unix_nano=now, count=zeros + sum(counts),
            sum=None, scale=0, zero_count=zeros, positive=positive, negative=_EMPTY, flags=0, min=None, max=None))
    return out
