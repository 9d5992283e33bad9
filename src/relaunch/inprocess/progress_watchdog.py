"""Progress watchdog: timestamps written while the main thread runs Python bytecode.

The watchdog thread queues a *pending call* (``Py_AddPendingCall``) whose function is
libc's ``sem_post``: the interpreter runs pending calls only in the main thread and
only between bytecodes, so the semaphore is posted exactly when the main thread
executes Python code. When it is posted, the watchdog writes the time into
:class:`SharedProgress`; when the main thread is stuck in C (a collective, a sleep,
a busy C loop), the timestamp ages. No Python callback runs in the main thread, so
nothing can swallow the restart exception there. At most one call is queued at a time.

:class:`SharedProgress` lives in an anonymous shared mapping created before the
monitor process is forked, so the monitor process reads the same timestamps
(``CLOCK_MONOTONIC`` is system-wide).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import mmap
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from relaunch.inprocess._logs import get_logger

__all__ = ["MainThreadProgress", "ProgressWatchdog", "SharedProgress", "Timestamp", "idle_since"]

log = get_logger(__name__)

_FIELDS = ("auto_ts", "ping_ts", "armed", "iteration", "stop", "killed")
_SIZE = 8 * len(_FIELDS)


class SharedProgress:
    """Fields shared by a rank and its monitor process (aligned 8-byte slots)."""

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, _SIZE, flags=mmap.MAP_SHARED)
        self.created = time.monotonic()
        """When the record was made (before the monitor process is forked): no progress
        time it holds can be earlier."""
        self.auto_ts = self.created

    def _get_d(self, index: int) -> float:
        value: float = struct.unpack_from("d", self._map, 8 * index)[0]
        return value

    def _get_q(self, index: int) -> int:
        value: int = struct.unpack_from("q", self._map, 8 * index)[0]
        return value

    @property
    def auto_ts(self) -> float:
        return self._get_d(0)

    @auto_ts.setter
    def auto_ts(self, value: float) -> None:
        struct.pack_into("d", self._map, 0, value)

    @property
    def ping_ts(self) -> float:
        """Time of the last ``ping()``; 0 until the first ping of the iteration."""
        return self._get_d(1)

    @ping_ts.setter
    def ping_ts(self, value: float) -> None:
        struct.pack_into("d", self._map, 8, value)

    def _set_q(self, index: int, value: int) -> None:
        struct.pack_into("q", self._map, 8 * index, value)

    armed = property(lambda self: self._get_q(2), lambda self, v: self._set_q(2, v))
    """1 while the wrapped function runs (progress timeouts apply)."""
    iteration = property(lambda self: self._get_q(3), lambda self, v: self._set_q(3, v))
    """The iteration a death of this rank is recorded in."""
    stop = property(lambda self: self._get_q(4), lambda self, v: self._set_q(4, v))
    """1 when the rank leaves normally: the monitor process exits."""
    killed = property(lambda self: self._get_q(5), lambda self, v: self._set_q(5, v))
    """1 once the monitor process killed the rank for a hard timeout."""

    def progress(self) -> float:
        """The time of the last progress: automatic, and manual once ``ping()`` was used."""
        auto, ping = self.auto_ts, self.ping_ts
        return min(auto, ping) if ping > 0 else auto

    def idle(self, now: float) -> float | None:
        """Seconds since the last progress at ``now``; None when the record holds a time
        it cannot hold (before it was made, or after ``now``): a bad read, not a hang."""
        return idle_since(self.auto_ts, self.ping_ts, created=self.created, now=now)

    def reset(self) -> None:
        """Start of an iteration: progress now, manual timeout inactive."""
        self.auto_ts = time.monotonic()
        self.ping_ts = 0.0

    def arm(self) -> None:
        """Progress timeouts apply from now on, counted from now."""
        self.reset()
        self.armed = 1

    @contextlib.contextmanager
    def unarmed(self) -> Iterator[None]:
        """No progress timeout inside the block; progress counts from its end."""
        armed = self.armed
        self.armed = 0
        try:
            yield
        finally:
            if armed:
                now = time.monotonic()
                self.auto_ts = now
                if self.ping_ts > 0:
                    self.ping_ts = now
                self.armed = armed

    def close(self) -> None:
        self._map.close()


def idle_since(auto: float, ping: float, *, created: float, now: float) -> float | None:
    """Seconds since the last progress (the older of the automatic and, once used, the
    manual timestamp) at ``now``; None unless each timestamp in use lies between
    ``created`` and ``now`` (a little slack for the clock read after the write)."""
    used = (auto, ping) if ping != 0.0 else (auto,)
    if not all(created <= t <= now + 1.0 for t in used):
        return None
    return max(0.0, now - min(used))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Probe:
    """One process-wide semaphore posted by a pending call in the main thread."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.sem = ctypes.create_string_buffer(64)  # sizeof(sem_t) is 32 on Linux
        if self.libc.sem_init(self.sem, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        add = ctypes.pythonapi.Py_AddPendingCall
        add.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        add.restype = ctypes.c_int
        self.add = add
        self.post = ctypes.cast(self.libc.sem_post, ctypes.c_void_p)
        self.outstanding = False
        self.lock = threading.Lock()

    def wait(self, timeout: float) -> bool:
        """Queue a probe if none is queued; True when the main thread ran it in time."""
        with self.lock:
            if not self.outstanding:
                if self.add(self.post, ctypes.addressof(self.sem)) != 0:
                    return False
                self.outstanding = True
            deadline = time.time() + timeout
            spec = _Timespec(int(deadline), int((deadline % 1) * 1e9))
            if self.libc.sem_timedwait(self.sem, ctypes.byref(spec)) == 0:
                self.outstanding = False
                return True
            return False


_probe: _Probe | None = None
_probe_lock = threading.Lock()


def _get_probe() -> _Probe:
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = _Probe()  # never freed: a queued pending call may still post it
        return _probe


class MainThreadProgress:
    """The wrapper's watchdog thread: writes automatic progress timestamps into
    :class:`SharedProgress` every ``interval`` seconds."""

    def __init__(self, shared: SharedProgress, interval: float) -> None:
        self.shared = shared
        self.interval = interval
        self._stop = threading.Event()
        self._probe = _get_probe()
        self._thread = threading.Thread(
            target=self._run, name="relaunch-inprocess-watchdog", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            if self._probe.wait(self.interval):
                self.shared.auto_ts = time.monotonic()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def ping(self) -> None:
        """Manual progress: activates the manual timeout for this iteration."""
        self.shared.ping_ts = time.monotonic()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("progress watchdog thread did not stop within %.1f s", timeout)


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
        self._probe = _get_probe()
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
