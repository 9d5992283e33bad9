"""Watching the state's epoch instead of polling it, where the store can watch.

An agent asks "did the state change?" at every monitor tick (10 times a second by
default): one read of ``epoch/<n + 1>`` each time, from every node. On the embedded
store (etcd) those reads were most of its idle CPU. Where a store's ``wait`` is a
watch that does not hold a connection others need (etcd: an HTTP stream of its own),
one thread per node waits on the next epoch key instead, and the ticks read what it
saw: no store traffic at idle but one wait every few seconds.

The thread's knowledge is used only while it is fresh (it answered within its wait
bound); else, and when it is behind the state the caller holds, the caller reads the
store itself, so a broken watch costs speed, never a missed change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from relaunch.errors import RelaunchError, StoreTimeoutError
from relaunch.store import Store

__all__ = ["EpochWatch"]

log = logging.getLogger(__name__)

_WAIT = 5.0
"""Seconds of one wait on the next epoch key (a silent stream is dropped after this)."""


class EpochWatch:
    """The highest epoch known to exist, kept by a thread that waits on the next one.

    Owns one thread (``relaunch-rdzv-epochs-<node>``) from the first :meth:`follow`
    until :meth:`close`."""

    def __init__(
        self, store: Store, key: Callable[[int], str], node: str, wait: float = _WAIT
    ) -> None:
        self._store = store
        self._key = key
        self._node = node
        self._wait = wait
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._fresh_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def changed_since(self, epoch: int) -> bool | None:
        """Whether an epoch after ``epoch`` exists, as the thread saw it; None when it
        cannot say (not fresh, or behind ``epoch``): the caller then reads the store."""
        self.follow(epoch)
        with self._lock:
            if self._epoch is None or time.monotonic() > self._fresh_until:
                return None
            if self._epoch > epoch:
                return True
            return False if self._epoch == epoch else None

    def follow(self, epoch: int) -> None:
        """Start the thread from ``epoch`` (first call), or move it up to ``epoch``."""
        with self._lock:
            if self._epoch is None or epoch > self._epoch:
                self._epoch = epoch
                self._fresh_until = 0.0  # the wait in flight is for an older epoch
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=self._run, name=f"relaunch-rdzv-epochs-{self._node}", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop and join the thread (within one wait). Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self._wait + 10.0)
            if thread.is_alive():
                log.warning("epoch watch %s did not stop", thread.name)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                assert self._epoch is not None
                nxt = self._epoch + 1
                # while this wait runs, it vouches that epoch ``nxt`` is not set yet
                # (it returns as soon as it is), up to its bound
                self._fresh_until = time.monotonic() + self._wait
            try:
                self._store.wait([self._key(nxt)], self._wait)
            except StoreTimeoutError:
                continue
            except RelaunchError as exc:  # the ticks read the store meanwhile
                log.debug("epoch watch of %s: %s", self._node, exc)
                with self._lock:
                    self._fresh_until = 0.0
                self._stop.wait(1.0)
            else:
                with self._lock:
                    self._epoch = max(self._epoch, nxt)
