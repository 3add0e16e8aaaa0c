"""What the step monitor (core/steps/monitor.py) needs of its watcher, as plain callables
(`StepHost`): a detection raised, events and phase records to the sinks, the batch a step belongs
to, and the weights measured again after a step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..events import NonFiniteEvent
from ..record import Record


class StepHost:
    """What the monitor needs of its watcher, as plain callables (no back reference)."""

    __slots__ = ("detect", "escalate", "emit", "phase_stats", "check", "last_batch", "watches", "live",
                 "weights_changed", "generation", "localize")

    def __init__(self, *, detect: Callable[..., None], escalate: Callable[..., None], emit: Callable[[Any], None],
                 phase_stats: Callable[[Record], None], check: Callable[[Record, int], None],
                 last_batch: Callable[[], int], watches: Callable[[int], bool], live: Callable[[], bool],
                 weights_changed: Callable[[], None], generation: Callable[[], int],
                 localize: Callable[[Record], Optional[NonFiniteEvent]] = lambda rec: None):
        self.detect = detect  # (record, frame index, replicated=False, force=None): a detection
        self.escalate = escalate  # (event, note, recorded=True): raise a detection on_detect="skip" made
        self.emit = emit  # an event to the sinks
        self.phase_stats = phase_stats  # a gradient / optimizer-state record to the metric sinks
        self.check = check  # (record, first frame): detect in a record already read back
        self.last_batch = last_batch  # the batch begun last (the one a step belongs to)
        self.watches = watches  # batch number -> recorded (every_n_batches, trace_batches)
        self.live = live  # attached, and not replaying a captured batch
        self.weights_changed = weights_changed  # a step wrote the weights: measure them again
        self.generation = generation  # bumped when the model's parameters were replaced
        # (bad gradients' record) -> the forward detection a replay of their unsampled batch found and
        # recorded, or None (on_detect="skip": the skip then names where the inf/nan was born)
        self.localize = localize
