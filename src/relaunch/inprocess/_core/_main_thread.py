"""The main thread's side of an interruption: whether it may be interrupted now, and
how (an exception raised in it asynchronously, and a signal that wakes it up).

:class:`MainThreadControl` knows whether the main thread is inside the wrapped
function; the monitor thread calls :meth:`MainThreadControl.interrupt` under the
atomic lock, which raises :class:`RankShouldRestart` in the main thread with
``PyThreadState_SetAsyncExc`` and sends it :data:`WAKE_SIGNAL`, so a GIL-releasing
call (``time.sleep``, a socket read, a lock wait) returns at once and the exception
is delivered.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from relaunch.inprocess._core._exceptions import RankShouldRestart

__all__ = ["WAKE_SIGNAL", "MainThreadControl", "set_async_exc"]

WAKE_SIGNAL = signal.SIGRTMIN + 4
"""Signal sent to the main thread to interrupt a blocking call (a real-time signal)."""


def set_async_exc(ident: int, exc: type[BaseException] | None) -> int:
    """``PyThreadState_SetAsyncExc``: raise ``exc`` in thread ``ident`` when it next
    runs Python code (None: drop one pending). Returns how many threads matched."""
    obj = ctypes.py_object(exc) if exc is not None else None
    result: int = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), obj)
    return result


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
                    set_async_exc(self.ident, None)  # drop one still pending
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
        set_async_exc(self.ident, RankShouldRestart)
        if self.is_main:
            with contextlib.suppress(OSError):
                signal.pthread_kill(self.ident, WAKE_SIGNAL)
        return True
