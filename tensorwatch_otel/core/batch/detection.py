"""The detection pipeline: from the first inf/nan in a record read back to the event the sinks
get and the exception training sees.

One detection per record: the ring of frames that led to it (reaching back into the thread's
earlier batches), the batch's inputs written to a capture file (`capture_dir`), the batch
replayed (`rerun_on_detect`: reproduced, and on a compiled model which of eager and compiled
reproduces it), the rank that found it first (multi-rank), the event to the sinks, flushed,
and NonFiniteDetected raised here or at the ranks' common stop point. `abort_after_batch`
ends here too.

A detection in a batch `every_n_batches` did not record (its output's check, or the step
guard's read of its gradients) is localized first: the batch is replayed with every module
checked, and the forward's first inf/nan, when the replay finds one, is the event, as a
recorded batch would have given it; else the detection's own record is (core/batch/rerun.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, List, Optional, Protocol, Tuple

import torch

from .behaviour import Behaviour
from .capture import BatchCapture
from ..config import WatchConfig
from ..errors import AbortAfterBatch, NonFiniteDetected
from ..steps.on_detect import OnDetect
from ..events import AbortAfterBatchEvent, NonFiniteEvent
from ..frame_stats import Frame, TensorStat
from ..fleet import FleetStop
from ..ports import Sink, SinkFanout
from ..rank import current_rank
from ..history import History
from ..record import Record
from .rerun import Localized, host, localize, replay_would_block, rerun

log = logging.getLogger(__name__)

class DetectionHost(Protocol):
    """What the pipeline asks of the rest of its watch (the watch's session, core/session.py)."""

    def kind_of(self, rec: Record, fi: int, stat: Optional[TensorStat]) -> str:
        """The own kind of frame `fi`'s first non-finite tensor `stat`."""

    def forget_batch(self) -> None:
        """Drop what an aborted batch left behind."""

    def history(self) -> History:
        """The calling thread's finished records."""

    def forward_poisoned(self, event: NonFiniteEvent, params: List[torch.Tensor]) -> None:
        """on_detect="skip": that forward's step is to be skipped."""

    def watches(self, batch: int) -> bool:
        """Batch `batch` is recorded (a detection in another is localized by a replay)."""


#: a silent watcher on a model that checks every module as it returns (for the replay)
MakeProbe = Callable[[torch.nn.Module, Sink], Any]


class DetectionPipeline:
    def __init__(self, model: torch.nn.Module, config: WatchConfig, behaviour: Behaviour, on_detect: OnDetect,
                 fanout: SinkFanout, fleet: FleetStop, host: DetectionHost, make_probe: MakeProbe):
        self._model = model
        self._config = config
        self._behaviour = behaviour
        self._on_detect = on_detect
        self._fanout = fanout
        self._fleet = fleet
        self._host = host
        self._make_probe = make_probe
        # the batch's inputs, held by reference until the next batch (capture_dir / rerun_on_detect /
        # the replay of an unsampled batch)
        self.capture = BatchCapture(config.capture_dir or "", current_rank()) \
            if config.capture_dir or config.rerun_on_detect or config.sampling else None
        self.replaying = False  # a captured batch is being replayed: the hooks stay out of it
        self.detections = 0

    def check(self, rec: Record, first_frame: int) -> None:
        """Detect inf/nan in frames[first_frame:] of `rec` (their stats are on the host)."""
        if rec.detected:
            return
        fi = rec.first_nonfinite_frame(first_frame)
        if fi is not None:
            self.detected(rec, fi)

    def _ring(self, rec: Record, fi: int) -> Tuple[Frame, ...]:
        traced = self._config.trace_batches
        stops_at = self._behaviour.ring_stops_at
        return self._host.history().ring(rec, fi, lambda prev: stops_at(prev, traced))

    def detected(self, rec: Record, fi: int, replicated: bool = False, force: Optional[str] = None) -> None:
        """Frame `fi` of `rec` holds the first inf/nan. `replicated`: the values are the same on
        every rank (the step guard's all-reduced gradients), so every rank finds them at this
        point and may raise here. `force`: raised whatever on_detect says (on_detect="skip" that
        can skip no more), the message ending with this note."""
        rec.detected = True
        event, uncertain = self._localized(rec.batch_number)
        if event is None:  # (a recorded batch, or the replay could not name a place in the forward)
            frames = self._ring(rec, fi)
            last = frames[-1]
            first = last.first_nonfinite()
            event = NonFiniteEvent(
                batch_number=rec.batch_number, rank=current_rank(), module=last.module,
                module_class=last.module_class, tensor=first.name if first else "",
                kind=self._host.kind_of(rec, fi, first), frames=frames, time=time.time(), phase=rec.phase,
                uncertain=uncertain)
        self._publish(event, replicated, force)

    def localized(self, rec: Record) -> Optional[NonFiniteEvent]:
        """on_detect="skip": the step guard found bad gradients of `rec`'s batch; when that batch
        was not recorded and its replay finds the inf/nan in the forward, that forward detection
        is recorded (as a recorded batch's would be) and returned; else None."""
        event = self._localized(rec.batch_number).event
        if event is not None:
            rec.detected = True
            self._publish(event, False, None)
        return event

    def _localized(self, batch: int) -> Localized:
        """The forward's first inf/nan in a replay of unsampled batch `batch`, or why the event
        may not name where it was born (core/batch/rerun.py)."""
        if self._host.watches(batch) or self.capture is None or self.replaying:
            return Localized(None)
        if replay_would_block(self._model):
            return Localized(None, "not replayed: the model is sharded over several ranks")
        self.replaying = True
        try:  # the user's model, not its DDP wrapper (whose forward broadcasts buffers)
            return localize(self._model, self.capture, batch, self._make_probe)
        finally:
            self.replaying = False

    def _publish(self, event: NonFiniteEvent, replicated: bool, force: Optional[str]) -> None:
        """The rest of a detection: capture file, re-run, first rank, sinks, and the raise."""
        cfg = self._config
        capture = self.capture.write(event.batch_number) if self.capture is not None and cfg.capture_dir else None
        reproduced = verdict = uncertain = None
        if cfg.rerun_on_detect and event.phase == "forward" and self.capture is not None \
                and not replay_would_block(self._model):
            self.replaying = True
            try:  # the user's model, not its DDP wrapper (whose forward broadcasts buffers)
                reproduced, verdict, uncertain = rerun(self._model, self.capture, event.batch_number,
                                                       event.module, event.tensor, self._make_probe)
            finally:
                self.replaying = False
        event = dataclasses.replace(event, capture=capture, reproduced=reproduced,
                                    host=host() if reproduced is not None else None, verdict=verdict,
                                    uncertain=event.uncertain or uncertain)
        if self._fleet.active():
            event = self._fleet.publish(event)  # multi-rank: first_rank is whoever published first
        self.detections += 1
        self._fanout.on_event(event)

        def raise_it() -> None:
            self._fanout.flush(cfg.flush_timeout_s)
            self._host.forget_batch()  # a caught exception leaves a clean state
            self.release_inputs()
            exc = NonFiniteDetected(self._behaviour.detection_message(event) + (force or ""), event)
            if not self._fleet.defer(exc, replicated):  # multi-rank: raised at the ranks' common stop point
                raise exc

        def spoil_step() -> None:
            self._host.forward_poisoned(event, [p for p in self._model.parameters() if p.requires_grad])

        if force is not None:  # raised whatever on_detect says
            raise_it()
        else:
            self._on_detect.after_recorded(event, raise_it, spoil_step)

    def escalate(self, event: NonFiniteEvent, note: str, recorded: bool = True) -> None:
        """Raise `event` as on_detect="raise" would have (on_detect="skip" that can skip no more):
        recorded in the sinks (now, unless `recorded`), flushed, then NonFiniteDetected."""
        if not recorded:
            self.detections += 1
            self._fanout.on_event(event)
        self._fanout.flush(self._config.flush_timeout_s)
        self._host.forget_batch()
        self.release_inputs()
        raise NonFiniteDetected(self._behaviour.detection_message(event) + note, event)

    def release_inputs(self) -> None:
        """Let the held inputs go (a detection that raises, detach): a batch on the device is not
        kept alive by a watcher that is still referenced (a notebook's)."""
        if self.capture is not None:
            self.capture.release()

    def abort(self, batch: int) -> None:
        """`abort_after_batch` reached: the event, flushed, then AbortAfterBatch."""
        cfg = self._config
        assert cfg.abort_after_batch is not None
        self._fanout.on_event(AbortAfterBatchEvent(batch, current_rank(), time.time()))
        self._fanout.flush(cfg.flush_timeout_s)
        self.release_inputs()
        raise AbortAfterBatch(self._behaviour.abort_message(batch + 1, cfg.abort_after_batch))

    def durable(self, event: Any) -> None:
        """An event the sinks must hold before this returns (a fleet stop)."""
        self._fanout.on_event(event)
        self._fanout.flush(self._config.flush_timeout_s)

    def overflow_check(self, event: Any) -> None:
        """A detect_overflow() finding to the sinks (durable before returning when it found one)."""
        self._fanout.on_event(event)
        if event.kind:
            self._fanout.flush(self._config.flush_timeout_s)

