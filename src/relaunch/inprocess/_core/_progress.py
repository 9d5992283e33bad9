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
import mmap
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

from relaunch.inprocess._core._threads import stop_thread

__all__ = ["MainThreadProgress", "SharedProgress", "get_probe", "idle_since"]

_SLOTS = {
    "auto_ts": "d",
    "ping_ts": "d",
    "armed": "q",
    "iteration": "q",
    "stop": "q",
    "killed": "q",
    "started": "q",
}
"""The shared fields, in their order, and their ``struct`` format (8 bytes each)."""
_SIZE = 8 * len(_SLOTS)


def _slot(name: str, doc: str) -> Any:
    """The property of the shared field ``name``: read and written in place, in the
    mapping (a ``struct`` of 8 bytes, at its index in :data:`_SLOTS`)."""
    offset, fmt = 8 * list(_SLOTS).index(name), _SLOTS[name]

    def read(self: SharedProgress) -> Any:
        return struct.unpack_from(fmt, self._map, offset)[0]

    def write(self: SharedProgress, value: float) -> None:
        struct.pack_into(fmt, self._map, offset, value)

    return property(read, write, doc=doc)


class SharedProgress:
    """Fields shared by a rank and its monitor process (aligned 8-byte slots)."""

    auto_ts: float = _slot("auto_ts", "Time of the last automatic progress.")
    ping_ts: float = _slot(
        "ping_ts", "Time of the last ``ping()``; 0 until the first ping of the iteration."
    )
    armed: int = _slot("armed", "1 while the wrapped function runs (progress timeouts apply).")
    iteration: int = _slot("iteration", "The iteration a death of this rank is recorded in.")
    stop: int = _slot("stop", "1 when the rank leaves normally: the monitor process exits.")
    killed: int = _slot("killed", "1 once the monitor process killed the rank for a hard timeout.")
    started: int = _slot(
        "started",
        "1 once the rank has its first roster (past the initial barrier, or admitted): its "
        "monitor process judges the other ranks' heartbeats from then on, as NVIDIA's does.",
    )

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, _SIZE, flags=mmap.MAP_SHARED)
        self.created = time.monotonic()
        """When the record was made (before the monitor process is forked): no progress
        time it holds can be earlier."""
        self.auto_ts = self.created

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


def get_probe() -> _Probe:
    """The process-wide probe (made on first use)."""
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
        self._probe = get_probe()
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
        stop_thread(self._thread, self._stop, timeout, "progress watchdog thread")
