"""NVIDIA's ``inprocess.monitor_thread`` module: the helpers that raise an exception in
another thread (:func:`async_raise`, :func:`delayed_async_raise`,
:func:`async_abort_main_thread`, :func:`reraise_if_unraisable`), and the wrapper's
monitor thread, defined in the core (:class:`MonitorThread`, :class:`MainThreadControl`).

The monitor thread notices an interruption anywhere, aborts, and raises
:class:`RankShouldRestart` in the main thread; see ``_core/_monitor_thread.py``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from relaunch.inprocess._core._exceptions import RankShouldRestart
from relaunch.inprocess._core._main_thread import WAKE_SIGNAL, MainThreadControl, set_async_exc
from relaunch.inprocess._core._monitor_thread import MonitorThread

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


def async_raise(
    tid: int, exc_type: type[BaseException], event: threading.Event | None = None
) -> None:
    """Raise ``exc_type`` in thread ``tid`` (NVIDIA's helper): it is raised when that
    thread next runs Python code. Waits for ``event`` first when one is given. Raises
    RuntimeError when no thread has that id (or, inconsistently, several)."""
    if event is not None:
        event.wait()
    result = 1 if sys.is_finalizing() else set_async_exc(tid, exc_type)
    if result == 0:
        raise RuntimeError(f"no thread with id {tid}")
    if result > 1:
        set_async_exc(tid, None)
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
