"""The snapshot writer's thread: one for the saves in a row, ended when they stop.

A thread started for each save cost the training thread that start at every save
(``Thread.start`` returns once the new thread runs): 85 us on an idle machine, a median
1.9 ms and up to 6 ms with every core busy (measured beside two busy loops on this
2-core machine), when a data loader's workers or the other ranks keep the cores busy.
A job handed to a running thread costs a queue's put. The thread ends after
:data:`IDLE` seconds without a job (a Saver never closed leaves nothing behind; a job
that saves less often pays the start, rarely).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["Writer"]

log = logging.getLogger(__name__)

IDLE = 2.0
"""Seconds without a job after which the thread ends (the next job starts another)."""

_Jobs = queue.SimpleQueue[Callable[[], None] | None]


class Writer:
    """Runs one job at a time on its thread (``relaunch-snapshot-writer``, started with
    a job when there is none). A forked child has no writer until its own first job:
    it never waits for its parent's."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """A writer with no thread (made anew in a forked child: the parent's lock may
        have been held by its thread at the fork)."""
        self._pid = os.getpid()
        self._jobs: _Jobs = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # a job is never put where no thread will take it

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the thread; the previous one has ended (:meth:`join`)."""
        if self._pid != os.getpid():  # a forked child: the thread is the parent's
            self._reset()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._jobs = queue.SimpleQueue()  # (a dead thread's, with no one to take it)
                self._thread = threading.Thread(
                    target=self._run,
                    args=(self._jobs,),
                    name="relaunch-snapshot-writer",
                    daemon=True,
                )
                self._thread.start()
            self._idle.clear()
            try:
                self._jobs.put(job)
            except BaseException:  # (an in-process restart's exception, raised in here)
                self._idle.set()  # no job queued: nothing to wait for
                raise

    def busy(self) -> bool:
        """Whether a job runs (or waits to)."""
        return self._pid == os.getpid() and not self._idle.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the last job has ended; False when it still runs after ``timeout``."""
        return self._pid != os.getpid() or self._idle.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread once its job has ended (within ``timeout``: else it is left,
        a daemon, with a warning). Idempotent; a later job starts another."""
        if self._pid != os.getpid():
            return
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._jobs.put(None)
            self._jobs = queue.SimpleQueue()  # (a job left behind stays with that thread)
        thread.join(timeout)
        if thread.is_alive():
            log.warning("snapshot writer still busy after %s s", timeout)

    def _run(self, jobs: _Jobs) -> None:
        while True:
            try:
                job = jobs.get(timeout=IDLE)
            except queue.Empty:
                with self._lock:
                    if jobs.empty():  # none came meanwhile: the next job starts a thread
                        if self._thread is threading.current_thread():
                            self._thread = None
                        return
                continue
            if job is None:
                return
            try:
                job()
            except BaseException:  # the job's own to report: the thread serves the next
                log.exception("snapshot writer job failed")
            finally:
                del job  # (a save's state is not kept while the thread idles)
                self._idle.set()
