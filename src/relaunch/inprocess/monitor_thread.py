"""The monitor thread: notice an interruption anywhere, abort, interrupt the main thread.

Every ``interval`` it (1) takes references to the live process groups (see
``_groups``), (2) checks this rank's progress against ``soft_timeout`` and records a
soft timeout, (3) reads the iteration's interruption records and the dead ranks from
the store in one round trip. On any interruption it takes the atomic
lock (so an ``atomic()`` section finishes first), calls ``abort`` once, and raises
:class:`RankShouldRestart` in the main thread with ``PyThreadState_SetAsyncExc``,
then sends the main thread a signal so a GIL-releasing call (``time.sleep``, a
socket read, a lock wait) returns at once and the exception is delivered. If the
main thread swallows it, it is raised again every interval until the main thread
leaves the function.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from relaunch.inprocess._coord import CoordinationStore
from relaunch.inprocess._groups import GroupRefs
from relaunch.inprocess._logs import get_logger
from relaunch.inprocess.attribution import Interruption, InterruptionRecord
from relaunch.inprocess.exception import RankShouldRestart
from relaunch.inprocess.progress_watchdog import SharedProgress

__all__ = [
    "WAKE_SIGNAL",
    "MainThreadControl",
    "MonitorThread",
    "RankShouldRestart",
    "async_abort_main_thread",
    "async_raise",
    "delayed_async_raise",
    "reraise_if_unraisable",
]

log = get_logger(__name__)

WAKE_SIGNAL = signal.SIGRTMIN + 4
"""Signal sent to the main thread to interrupt a blocking call (a real-time signal)."""


def _set_async_exc(ident: int, exc: type[BaseException] | None) -> int:
    obj = ctypes.py_object(exc) if exc is not None else None
    result: int = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), obj)
    return result


def async_raise(
    tid: int, exc_type: type[BaseException], event: threading.Event | None = None
) -> None:
    """Raise ``exc_type`` in thread ``tid`` (NVIDIA's helper): it is raised when that
    thread next runs Python code. Waits for ``event`` first when one is given. Raises
    RuntimeError when no thread has that id (or, inconsistently, several)."""
    if event is not None:
        event.wait()
    result = 1 if sys.is_finalizing() else _set_async_exc(tid, exc_type)
    if result == 0:
        raise RuntimeError(f"no thread with id {tid}")
    if result > 1:
        _set_async_exc(tid, None)
        raise RuntimeError(f"PyThreadState_SetAsyncExc matched {result} threads")


def delayed_async_raise(tid: int, exc_type: type[BaseException]) -> None:
    """:func:`async_raise` from a helper thread (callable where raising is not safe)."""
    event = threading.Event()
    threading.Thread(
        target=async_raise, args=(tid, exc_type, event), name="relaunch-async-raise", daemon=True
    ).start()
    event.set()


def async_abort_main_thread(msg: str | None = None) -> None:
    """Raise :class:`RankShouldRestart` (with ``msg``) in the main thread."""
    exc_type: type[BaseException] = RankShouldRestart
    if msg is not None:
        exc_type = type(
            "RankShouldRestart",
            (RankShouldRestart,),
            {"__init__": lambda self: RankShouldRestart.__init__(self, msg)},
        )
    main = threading.main_thread().ident
    assert main is not None
    async_raise(main, exc_type)


@contextlib.contextmanager
def reraise_if_unraisable(exc_type: type[BaseException]) -> Iterator[None]:
    """While active (a context manager or a decorator), an exception of ``exc_type``
    that Python can only report as unraisable (raised in a finalizer or a callback)
    is raised again in the main thread, asynchronously."""
    original = sys.unraisablehook

    def hook(args: Any) -> None:
        original(args)
        if issubclass(args.exc_type, exc_type) and not sys.is_finalizing():
            main = threading.main_thread().ident
            if main is not None:
                delayed_async_raise(main, exc_type)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = original


def _wake_handler(signum: int, frame: FrameType | None) -> None:
    """Do nothing: running any Python code lets a pending restart exception be raised."""


class MainThreadControl:
    """Whether the main thread is inside the wrapped function (may be interrupted)."""

    def __init__(self, atomic_lock: threading.RLock) -> None:
        self.lock = atomic_lock
        self.ident = threading.get_ident()
        self.is_main = threading.current_thread() is threading.main_thread()
        self.in_fn = False
        self._old_handler: Callable[[int, FrameType | None], object] | int | None = None

    def install(self) -> None:
        """Install the wake-up handler (main thread only)."""
        if self.is_main:
            self._old_handler = signal.signal(WAKE_SIGNAL, _wake_handler)

    def uninstall(self) -> None:
        if self.is_main and self._old_handler is not None:
            signal.signal(WAKE_SIGNAL, self._old_handler)
            self._old_handler = None

    def enter(self) -> None:
        with self.lock:
            self.in_fn = True

    def leave(self) -> None:
        """Leave the function; a restart exception can no longer be raised after this."""
        while True:
            try:
                with self.lock:
                    self.in_fn = False
                    _set_async_exc(self.ident, None)  # drop one still pending
                return
            except RankShouldRestart:
                continue

    def importing(self) -> bool:
        """Whether the main thread is inside the import machinery.

        An exception raised asynchronously there can leave a module lock of
        ``importlib._bootstrap`` in a broken state (later imports of that module
        spin or deadlock), so the restart exception waits until the import is over.
        """
        frame = sys._current_frames().get(self.ident)
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib"):
                return True
            frame = frame.f_back
        return False

    def interrupt(self) -> bool:
        """Raise RankShouldRestart in the main thread if inside the function (hold the lock).

        Returns False when nothing was raised (outside the function, or importing:
        the caller retries).
        """
        if not self.in_fn or self.importing():
            return False
        _set_async_exc(self.ident, RankShouldRestart)
        if self.is_main:
            with contextlib.suppress(OSError):
                signal.pthread_kill(self.ident, WAKE_SIGNAL)
        return True


REABORT_AFTER = 0.25
"""Seconds after an abort before the monitor thread aborts again, while the main
thread has not left the function."""


class MonitorThread:
    """Watches one iteration of one rank (see module docstring)."""

    def __init__(
        self,
        *,
        coord: CoordinationStore,
        iteration: int,
        initial_rank: int,
        members: set[int],
        interval: float,
        soft_timeout: float,
        shared: SharedProgress,
        control: MainThreadControl,
        abort: Callable[[], None],
        reabort: Callable[[], None] | None = None,
        groups: GroupRefs | None = None,
    ) -> None:
        self.coord = coord
        self.iteration = iteration
        self.initial_rank = initial_rank
        self.members = members
        self.interval = interval
        self.soft_timeout = soft_timeout
        self.shared = shared
        self.control = control
        self.abort = abort
        self.reabort = reabort
        self._aborted_at = 0.0
        self.groups = groups
        self.triggered = threading.Event()
        self._stop = threading.Event()
        self._soft_recorded = False
        self.stalled_at: float | None = None
        """When this rank's last progress was, if the iteration ended by its soft timeout."""
        self._retry = min(interval, 0.01)
        self._deferred = False
        self._thread = threading.Thread(
            target=self._run, name=f"relaunch-inprocess-monitor-{iteration}", daemon=True
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
                self.coord.record_interrupted(
                    self.iteration,
                    InterruptionRecord(
                        initial_rank=self.initial_rank,
                        interruption=Interruption.MONITORING_PROCESS_EXCEPTION,
                        message="monitor thread failed",
                    ),
                )
            self._trigger()

    def _interrupted(self) -> bool:
        watched = self.shared.armed and not self._soft_recorded
        idle = self.shared.idle(time.monotonic()) if watched else None
        if idle is not None and idle > self.soft_timeout:
            self._soft_recorded = True
            self.stalled_at = self.shared.progress()
            log.warning("rank %s: soft timeout, no progress", self.initial_rank)
            self.coord.record_interrupted(
                self.iteration,
                InterruptionRecord(
                    initial_rank=self.initial_rank,
                    interruption=Interruption.SOFT_TIMEOUT,
                    message=f"no progress for {self.soft_timeout:.3g} s",
                ),
            )
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
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("monitor thread did not stop within %.1f s", timeout)
