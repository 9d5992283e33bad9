"""Stopping a thread of the engine: every thread has one owner, which stops it with
:func:`stop_thread` (set its event, join it with a timeout, say so when it did not
stop: the threads are daemons, never waited on forever)."""

from __future__ import annotations

import threading

from relaunch.inprocess._core._logs import get_logger

__all__ = ["stop_thread"]

log = get_logger(__name__)


def stop_thread(thread: threading.Thread, stop: threading.Event, timeout: float, what: str) -> None:
    """Set ``stop`` and join ``thread`` (unless it is the caller) for up to ``timeout``
    seconds; log a warning naming ``what`` when it is still alive after that."""
    stop.set()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout)
        if thread.is_alive():
            log.warning("%s did not stop within %.1f s", what, timeout)
