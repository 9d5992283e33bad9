"""NVIDIA's ``inprocess.progress_watchdog`` module: the standalone
:class:`ProgressWatchdog` thread and its :class:`Timestamp`; and the wrapper's own
watchdog, defined in the core (:class:`MainThreadProgress`, which writes into a
:class:`SharedProgress` the monitor process reads).

Both take a timestamp when the main thread runs Python bytecode: a watchdog thread
queues a *pending call* (``Py_AddPendingCall``) whose function is libc's
``sem_post``, which the interpreter runs only in the main thread and only between
bytecodes (see ``_core/_progress.py``). When the main thread is stuck in C (a
collective, a sleep, a busy C loop), the timestamp ages.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, NamedTuple

from relaunch.inprocess._core._progress import (
    MainThreadProgress,
    SharedProgress,
    get_probe,
    idle_since,
)

__all__ = ["MainThreadProgress", "ProgressWatchdog", "SharedProgress", "Timestamp", "idle_since"]


class Timestamp(NamedTuple):
    """NVIDIA's progress record: the last automatic and manual (``ping``) progress times
    (``time.monotonic()``), None until there is one."""

    auto: float | None = None
    manual: float | None = None


class ProgressWatchdog(threading.Thread):
    """NVIDIA's standalone progress watchdog: every ``interval`` it checks that the main
    thread runs Python code and sends ``Timestamp(auto=..., manual=...)`` through
    ``connection.send_timestamp``. :meth:`ping` records manual progress;
    :meth:`pause_and_synchronize` stops the sending (no timestamp is sent after it
    returns) until :meth:`resume`. The wrapper itself uses :class:`MainThreadProgress`.
    """

    def __init__(
        self,
        rank: int,
        connection: Any,
        interval: datetime.timedelta,
        daemon: bool = True,
    ) -> None:
        super().__init__(name=f"ProgressWatchdog-{rank}", daemon=daemon)
        self.rank = rank
        self.connection = connection
        self.interval = interval
        self.timestamp = Timestamp(auto=time.monotonic())
        self._send_lock = threading.RLock()
        self._probe = get_probe()
        self._stop_event = threading.Event()
        self._running = threading.Event()  # cleared: paused
        self._running.set()
        self._paused = threading.Event()

    def send(self) -> None:
        with self._send_lock:
            self.connection.send_timestamp(self.timestamp)

    def reset(self) -> None:
        self.timestamp = Timestamp(auto=time.monotonic())
        self.send()

    def ping(self) -> None:
        self.timestamp = Timestamp(auto=self.timestamp.auto, manual=time.monotonic())
        self.send()

    def run(self) -> None:
        seconds = self.interval.total_seconds()
        while not self._stop_event.is_set():
            if not self._running.is_set():
                self._paused.set()
                self._running.wait(seconds)
                continue
            if self._paused.is_set():
                # Resumed: first the last progress seen before the pause, as NVIDIA's
                # watchdog sends the last completed probe before it queues a new one.
                self._paused.clear()
                if not self._stop_event.is_set():
                    self.send()
            started = time.monotonic()
            probed = self._probe.wait(seconds)
            if probed and self._running.is_set() and not self._stop_event.is_set():
                self.timestamp = Timestamp(auto=time.monotonic(), manual=self.timestamp.manual)
                self.send()
            self._stop_event.wait(max(0.0, seconds - (time.monotonic() - started)))
        self._paused.set()

    def pause_and_synchronize(self) -> None:
        """Stop sending; when this returns, no timestamp is sent until :meth:`resume`."""
        with self._send_lock:
            self._running.clear()
        if self.is_alive():
            self._paused.wait()

    def resume(self) -> None:
        if self._stop_event.is_set():
            raise RuntimeError("the progress watchdog was shut down")
        self._running.set()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread (it sends one last timestamp); a second call does nothing."""
        if self._stop_event.is_set():
            return
        self._stop_event.set()
        self._running.set()
        if self.is_alive():
            self.join(timeout)
        self.reset()
