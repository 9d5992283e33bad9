"""Reading a key (or a prefix's keys) only when it may have changed, where the store
watches (etcd).

The keep-alive thread of a node polled two things every beat (twice a second), and on
etcd those polls were most of the embedded store's requests at idle:

- every node read the steward key, to learn when the steward stopped and of a corrupt
  state (one read per node and beat: 2,048 reads a second in a 1,024-node job);
- the steward read the state and every node's liveness key, to find the dead (two
  reads of O(N) bytes: a 1,024-node state is hundreds of KB).

Both rarely change. On etcd a node is dead exactly when its ``alive/`` key is gone
(its lease ended), and the steward key lives under its holder's lease and is
rewritten only when its report changes (and every 10 s). So a thread watches the
key, and its reader reads when :meth:`KeyWatch.due` says:

- the key changed (acted on at the next beat, as before: a burst of changes, as
  when hundreds of nodes join or leave at once, costs a read per beat, not one per
  change; waking the keep-alive thread at each change made the steward read the
  state back to back through a 256-node job's joins);
- the watch in flight started after the last read (a watch ends after ``wait``
  seconds, and a change between two watches is seen by no watch): at idle, one read
  per ``wait`` (none for a single key: the watch reads its value as it begins);
- no watch is in flight (broken, or not started yet): then at every beat, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from relaunch.errors import RelaunchError
from relaunch.store import WatchStore

__all__ = ["KeyWatch"]

log = logging.getLogger(__name__)

_WAIT = 5.0
"""Seconds of one watch (a silent stream, as from a member on a lost host, is dropped
after this and the next watch fails over)."""


class KeyWatch:
    """Whether the reader of ``key`` (with ``prefix``: of every key under it) should
    read it now (:meth:`due`), or the key's value with no read while none is needed
    (:meth:`value`), told by a thread that watches it.

    Owns one thread (``relaunch-rdzv-<name>``) from the first :meth:`due` or
    :meth:`value` until :meth:`close`."""

    def __init__(
        self,
        store: WatchStore,
        key: str,
        *,
        prefix: bool,
        name: str,
        wait: float = _WAIT,
    ) -> None:
        self._store, self._key, self._prefix = store, key, prefix
        self._name, self._wait = name, wait
        self._lock = threading.Lock()
        self._watches = 0
        """Watches started so far (the number of the one in flight)."""
        self._watching: int | None = None
        """The watch in flight, once it covers every change (None: none does)."""
        self._read: int | None = None
        """The watch that was in flight at the last read."""
        self._dirty = False
        """A change came since the last read, or since the watch in flight began."""
        self._value: bytes | None = None
        """The key's value as the watch in flight began."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def due(self) -> bool:
        """Whether to read now (see the module's note); the caller then reads. Starts
        the thread at the first call."""
        with self._lock:
            self._start()
            if self._watching is not None and self._read == self._watching and not self._dirty:
                return False
            self._read = self._watching
            self._dirty = False
            return True

    def value(self, read: Callable[[], bytes | None]) -> bytes | None:
        """The key's value: as the watch in flight began with it, when no change came
        since; else ``read()`` (no watch in flight, or a change came). Starts the thread
        at the first call."""
        with self._lock:
            self._start()
            if self._watching is not None and not self._dirty:
                return self._value
        return read()

    def invalidate(self) -> None:
        """The value in hand is behind the key (a compare-and-set on it failed): read
        it afresh until the next watch begins."""
        with self._lock:
            self._dirty = True

    def close(self) -> None:
        """Stop and join the thread (its watch is ended at once). Idempotent."""
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            self._store.end_watches()
        except RelaunchError as exc:
            log.debug("ending the watch %s: %s", self._name, exc)
        thread.join(timeout=self._wait + 10.0)
        if thread.is_alive():
            log.warning("key watch %s did not stop", thread.name)

    def _start(self) -> None:
        """Start the thread (once; the lock held)."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(
                target=self._run, name=f"relaunch-rdzv-{self._name}", daemon=True
            )
            self._thread.start()

    def _covered(self, value: bytes | None) -> None:
        """A watch covers every change from now on; the key's value was ``value``."""
        with self._lock:
            self._watches += 1
            self._watching, self._value = self._watches, value
            self._dirty = False  # (a reader by :meth:`due` has not read in this watch)

    def _run(self) -> None:
        while not self._stop.is_set():
            began, failed = time.monotonic(), False
            try:
                changed = self._store.watch(
                    self._key, self._wait, self._stop, prefix=self._prefix, watching=self._covered
                )
            except RelaunchError as exc:  # read at every beat meanwhile
                log.debug("key watch %s: %s", self._name, exc)
                changed, failed = False, True
            # (a watch that ends early with no change failed: not again at once)
            failed = failed or (not changed and time.monotonic() - began < self._wait / 2)
            with self._lock:
                self._watching = None
                self._dirty = self._dirty or changed
            if failed:
                self._stop.wait(1.0)
