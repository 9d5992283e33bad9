"""The monitor thread: notice an interruption anywhere, abort, interrupt the main thread.

Every ``interval`` it (1) takes references to the live process groups (see
``_groups``), (2) checks this rank's progress against ``soft_timeout`` and records a
soft timeout, (3) reads the iteration's interruption records and the dead ranks from
the store in one round trip. On any interruption it takes the atomic
lock (so an ``atomic()`` section finishes first), calls ``abort`` once, and raises
:class:`RankShouldRestart` in the main thread (see ``_main_thread``). If the main
thread swallows it, it is raised again every interval until the main thread leaves
the function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable

from relaunch.inprocess._core._coord import CoordinationStore
from relaunch.inprocess._core._groups import GroupRefs
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess._core._main_thread import MainThreadControl
from relaunch.inprocess._core._progress import SharedProgress
from relaunch.inprocess._core._records import Interruption, InterruptionRecord
from relaunch.inprocess._core._threads import stop_thread

__all__ = ["REABORT_AFTER", "MonitorThread"]

log = get_logger(__name__)

REABORT_AFTER = 0.25
"""Seconds after an abort before the monitor thread aborts again, while the main
thread has not left the function."""


@dataclasses.dataclass(eq=False, kw_only=True)
class MonitorThread:
    """Watches one iteration of one rank (see module docstring)."""

    coord: CoordinationStore
    """The monitor thread's own store client (a client is not thread-safe)."""
    iteration: int
    initial_rank: int
    members: set[int]
    """The ranks of the iteration: the death of any of them interrupts it."""
    interval: float
    soft_timeout: float
    shared: SharedProgress
    control: MainThreadControl
    abort: Callable[[], None]
    """Called once, when the iteration is interrupted (under the atomic lock)."""
    reabort: Callable[[], None] | None = None
    """Called again every ``REABORT_AFTER`` s while the main thread stays in the function."""
    groups: GroupRefs | None = None
    """Where to take references to the live process groups every poll."""
    triggered: threading.Event = dataclasses.field(default_factory=threading.Event, init=False)
    """Set once the monitor thread interrupted the iteration."""
    stalled_at: float | None = dataclasses.field(default=None, init=False)
    """When this rank's last progress was, if the iteration ended by its soft timeout."""

    def __post_init__(self) -> None:
        self._aborted_at = 0.0
        self._stop = threading.Event()
        self._soft_recorded = False
        self._retry = min(self.interval, 0.01)
        self._deferred = False
        self._thread = threading.Thread(
            target=self._run, name=f"relaunch-inprocess-monitor-{self.iteration}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._retry if self._deferred else self.interval):
                if self.triggered.is_set():
                    with self.control.lock:  # re-deliver if swallowed or deferred
                        self._deferred = self.control.in_fn and not self.control.interrupt()
                        self._abort_again()
                    continue
                if self.groups is not None:
                    self.groups.take()  # see _groups: released after the iteration
                if self._interrupted():
                    self._trigger()
        except Exception:
            log.exception("rank %s: monitor thread failed", self.initial_rank)
            with contextlib.suppress(Exception):
                self._record(Interruption.MONITORING_PROCESS_EXCEPTION, "monitor thread failed")
            self._trigger()

    def _record(self, kind: Interruption, message: str) -> None:
        """Record an interruption of this rank in the iteration."""
        record = InterruptionRecord(
            initial_rank=self.initial_rank, interruption=kind, message=message
        )
        self.coord.record_interrupted(self.iteration, record)

    def _interrupted(self) -> bool:
        watched = self.shared.armed and not self._soft_recorded
        idle = self.shared.idle(time.monotonic()) if watched else None
        if idle is not None and idle > self.soft_timeout:
            self._soft_recorded = True
            self.stalled_at = self.shared.progress()
            log.warning("rank %s: soft timeout, no progress", self.initial_rank)
            self._record(Interruption.SOFT_TIMEOUT, f"no progress for {self.soft_timeout:.3g} s")
            return True
        records, dead = self.coord.poll(self.iteration)
        if records or dead & self.members:
            log.info(
                "rank %s: iteration %s interrupted: %s (dead: %s)",
                self.initial_rank,
                self.iteration,
                "; ".join(str(r) for r in records),
                sorted(dead & self.members),
            )
            return True
        return False

    def _abort_again(self) -> None:
        """Abort again while the main thread stays in the function (every
        ``REABORT_AFTER`` s): a group created, or a connection made, after the last
        abort (an abort that landed during ``init_process_group``) is released too."""
        if not self.control.in_fn or self.reabort is None:
            return
        now = time.monotonic()
        if now - self._aborted_at < REABORT_AFTER:
            return
        self._aborted_at = now
        log.debug(
            "rank %s: still in the function after the abort: aborting again", self.initial_rank
        )
        try:
            self.reabort()
        except Exception:
            log.exception("rank %s: abort failed", self.initial_rank)

    def _trigger(self) -> None:
        with self.control.lock:  # never inside atomic()
            if self._stop.is_set() or self.triggered.is_set():
                return
            self.triggered.set()
            self._aborted_at = time.monotonic()
            try:
                self.abort()
            finally:
                self._deferred = not self.control.interrupt() and self.control.in_fn

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop watching (the main thread has left the function). Joins the thread."""
        stop_thread(self._thread, self._stop, timeout, "monitor thread")
