"""A batch's end (`BatchEnd`): the record's one read-back (with the loss scale, whose drop is a
skipped step), the batch to the sinks, its check, and the record kept in the thread's ring. The
lifecycle (core/batch/lifecycle.py) calls it when a thread's batch closes, timed as the
watcher's own work.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Optional

from ..events import BatchTraceEvent
from ..frame_stats import BatchStats
from ..rank import current_rank
from ..record import Record
from .behaviour import Behaviour
from .thread_batch import ThreadBatch

if TYPE_CHECKING:  # pragma: no cover
    from ..config import WatchConfig
    from ..frames.quiet import QuietBatches
    from ..frames.recorder import FrameRecorder
    from ..ports import SinkFanout
    from ..steps.monitor import StepMonitor
    from .detection import DetectionPipeline
    from .sampling import FixedSampling, OverheadBudget

log = logging.getLogger(__name__)

_WEIGHT_REFRESH = 32  # no-grad batches between full weight re-measurements (see BatchEnd.end)


class BatchEnd:
    """Ends the batches of one watcher (see the module docstring). `hooked()` counts the watched
    modules."""

    def __init__(self, config: WatchConfig, behaviour: Behaviour, *, recorder: FrameRecorder,
                 sampling: "FixedSampling | OverheadBudget", fanout: SinkFanout, detect: DetectionPipeline,
                 steps: StepMonitor, quiet: QuietBatches, hooked: Callable[[], int]) -> None:
        self._config = config
        self._behaviour = behaviour
        self._recorder = recorder
        self._sampling = sampling
        self._fanout = fanout
        self._detect = detect
        self._steps = steps
        self._quiet = quiet
        self._hooked = hooked
        self._said_root_alone = False  # (see _say_if_root_alone)

    def end(self, st: ThreadBatch) -> None:
        """The calling thread's batch `st` ends (back to IDLE)."""
        sampled = not st.quiet
        if st.quiet:
            self._quiet.rest()  # off until a recorded batch, or a call the sentry sees
        rec = st.close()
        b = rec.batch_number
        self._recorder.end_batch()
        if (b + 1) % _WEIGHT_REFRESH == 0:
            self._recorder.invalidate_weights()  # `.data` writes between no-grad batches
        scale_t = self._steps.scale_tensor()
        if rec.frame_count or scale_t is not None:
            # the loss scale travels in the batch's read-back; a drop is a skipped step
            scale = self._steps.batch_scale(b, rec.readback(scale_t))
            if rec.frame_count:
                try:
                    # the last step's gradient check, read in that read-back: its detection first
                    self._steps.settle()
                    self._finish(rec, scale)
                finally:  # a batch that raised NonFiniteDetected still precedes the next ring
                    st.history.keep(rec)
            if sampled and rec.frame_count and not self._said_root_alone:
                self._say_if_root_alone(rec)
        if not rec.frame_count:
            self._steps.settle()  # (a read of its own)
        cfg = self._config
        if cfg.abort_after_batch is not None and b >= cfg.abort_after_batch:
            self._detect.abort(b)

    def _say_if_root_alone(self, rec: Record) -> None:
        """A recorded batch whose frames are all the root's while the model has watched
        submodules: their hooks did not run, and the model is unwatched inside. Said once, at
        WARNING: a compiled graph that dropped them, or a wrapper calling their forward()
        directly, would otherwise leave a run that looks watched and is not."""
        if any(not rec.frame_info(fi).is_root for fi in range(rec.frame_count)):
            self._said_root_alone = True  # the submodules' hooks run: nothing to say, ever
            return
        inside = self._hooked() - 1
        if inside <= 0:
            return
        self._said_root_alone = True
        log.warning("tensorwatch_otel: batch %d recorded the model's own call only: none of its %d watched "
                    "submodules' hooks ran, so nothing inside the model is measured or checked (its output "
                    "is). A compiled graph that dropped the hooks, or code calling the submodules' forward() "
                    "directly, does this; said once", rec.batch_number, inside)

    def _finish(self, rec: Record, scale: Optional[float] = None) -> None:
        cfg = self._config
        traced = rec.batch_number in cfg.trace_batches
        rank = current_rank()
        fanout = self._fanout
        if fanout.wants_batches:
            # a Record is a _LazyFrames (materialize()): rows are made by the sink
            fanout.on_batch(BatchStats(rec.batch_number, rank, time.time(), rec,
                                       grad_scale=scale, steps_skipped=self._steps.steps_skipped,
                                       every_n_batches=self._sampling.every_n_batches,
                                       overhead=self._sampling.overhead))
        if traced:
            fanout.on_event(BatchTraceEvent(rec.batch_number, rank, rec.materialize(), time.time()))
        if cfg.check == "batch" and (self._behaviour.detect_in_traced_batches or not traced):
            self._detect.check(rec, 0)

