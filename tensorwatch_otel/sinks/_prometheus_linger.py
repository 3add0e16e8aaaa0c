"""After a detection, PrometheusMetrics' wait for one more scrape (the linger), and the SIGTERM
that ends it: the application's handler chained while a detection waits to be scraped.

A detection that ends the run must still reach Prometheus, so the endpoint stays up at close
or exit until a scrape came, at most linger_s; a SIGTERM (a preemption's grace period has
begun) or Ctrl-C ends that wait.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Optional

# The sink's own logger: quieting PrometheusMetrics quiets its linger too.
log = logging.getLogger(f"{__package__}.prometheus")

# Time left for the HTTP response to reach Prometheus after the collector produced it.
_RESPONSE_GRACE_S = 0.5
# How often a linger looks whether a SIGTERM came. A Python signal handler runs on the main
# thread between bytecodes, possibly while that thread holds the sink's lock, so it cannot
# notify the waiting condition: it sets a flag, which the wait reads this often.
_SIGTERM_POLL_S = 0.2


class _SigtermNote:
    """The application's own SIGTERM handler, chained: notes the signal for a sink waiting to be
    scraped (a preemption's grace period has begun, so its linger must end), then runs the
    application's handler as before, which may raise SystemExit as it always did."""

    def __init__(self, linger: "ScrapeLinger", previous):
        self.linger = linger
        self.previous = previous

    def __call__(self, signum, frame):
        self.linger.sigterm_received()
        return self.previous(signum, frame)


class ScrapeLinger:
    """Whether a detection still waits for a scrape, the wait for it, and the SIGTERM that ends it.

    ``lock``: the sink's lock, held by the sink when it calls ``detection()`` (with the counters it
    moves) and taken here by ``scraped()`` and ``wait()``.
    ``want_sigterm``: a detection came on another thread and the handler is to be chained from the
    main thread at its next call (read by the sink once per batch; written only here).
    """

    def __init__(self, lock: threading.Lock, linger_s: float):
        self.linger_s = linger_s
        self._scraped = threading.Condition(lock)
        self._scrapes = 0
        self._unscraped_detection = False
        # SIGTERM: set by _SigtermNote, chained to the application's handler while a detection
        # waits for a scrape; no linger starts or goes on after it.
        self._sigterm = False
        self._note: Optional[_SigtermNote] = None
        self._sigterm_logged = False
        self.want_sigterm = False  # a detection waits; chain the handler from the main thread

    def detection(self) -> None:
        """A detection the next scrape is to see (the caller holds the lock)."""
        self._unscraped_detection = True

    def scraped(self) -> None:
        """A scrape began: it sees every detection so far; a wait for it ends."""
        with self._scraped:
            self._scrapes += 1
            self._unscraped_detection = False
            self._scraped.notify_all()

    def pending(self) -> bool:
        """A detection waits for a scrape, and the sink lingers for one."""
        return self._unscraped_detection and self.linger_s > 0

    @property
    def sigterm(self) -> bool:
        """A SIGTERM came through the application's handler."""
        return self._sigterm

    @property
    def chained(self) -> bool:
        """The application's SIGTERM handler is chained (a SIGTERM ends the wait)."""
        return self._note is not None

    def wait(self, timeout_s: float) -> bool:
        """Blocks until a scrape after the last detection, at most timeout_s, and no longer once
        a SIGTERM came through the application's handler; True if a scrape came."""
        deadline = time.monotonic() + timeout_s
        with self._scraped:
            while self._unscraped_detection:
                left = deadline - time.monotonic()
                if left <= 0 or self._sigterm:
                    return False
                self._scraped.wait(min(left, _SIGTERM_POLL_S))
        time.sleep(_RESPONSE_GRACE_S)
        return True

    def note_sigterm(self, serving: bool) -> None:
        """While a detection waits for a scrape, chain the application's SIGTERM handler (only a
        Python one: without it SIGTERM ends the process at once anyway, and an ignored SIGTERM
        stays ignored). Signal handlers are set from the main thread only; from another thread
        this waits for the next call from the main thread (on_batch, close, the exit hook).
        ``serving``: the sink serves /metrics (no linger without it)."""
        self.want_sigterm = False
        if self._note is not None or self.linger_s <= 0 or not serving:
            return
        if threading.current_thread() is not threading.main_thread():
            self.want_sigterm = True
            return
        try:
            previous = signal.getsignal(signal.SIGTERM)
            if not callable(previous):  # SIG_DFL, SIG_IGN, or set outside Python (None)
                return
            note = _SigtermNote(self, previous)
            signal.signal(signal.SIGTERM, note)
        except (ValueError, OSError, RuntimeError) as exc:  # no signals here (an embedded interpreter)
            log.debug("tensorwatch_otel: cannot chain the SIGTERM handler: %s", exc)
            return
        self._note = note

    def unnote_sigterm(self) -> None:
        """Gives the application its handler back, when ours is still the one installed and this
        is the main thread; otherwise ours stays, passing every SIGTERM on."""
        note = self._note
        if note is None or threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is note:
                signal.signal(signal.SIGTERM, note.previous)
                self._note = None
        except (ValueError, OSError, RuntimeError):
            pass

    def sigterm_received(self) -> None:
        """Called by the chained SIGTERM handler: a preemption's grace period has begun. A plain
        store (a signal handler must take no lock); the linger's wait reads it."""
        self._sigterm = True

    def log_sigterm(self, waited: bool, url: Optional[str]) -> None:
        """Says once that a SIGTERM ended (``waited``) or spared the wait for a scrape of ``url``."""
        if self._sigterm_logged:
            return
        self._sigterm_logged = True
        if waited:
            log.warning("tensorwatch_otel: wait for a scrape ended by SIGTERM (preemption); the detection "
                        "is in the logs and other sinks only")
        else:
            log.warning("tensorwatch_otel: SIGTERM (preemption): not waiting for Prometheus to scrape the "
                        "inf/nan detection from %s; it is in the logs and other sinks only", url)
