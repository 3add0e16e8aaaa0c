"""A real sink for tests that keeps every batch and event it is given."""

from __future__ import annotations

from tensorwatch_otel.sinks import Sink


class Collect(Sink):
    wants_batches = True

    def __init__(self):
        self.batches = []
        self.events = []

    def on_batch(self, stats):
        self.batches.append(stats)

    def on_event(self, event):
        self.events.append(event)

    def of(self, cls):
        return [e for e in self.events if isinstance(e, cls)]
