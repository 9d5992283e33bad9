"""The keep-alive thread of one rendezvous handler: heartbeats and dead-node removal."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from relaunch.errors import RelaunchError, RendezvousStateError, RendezvousTimeoutError
from relaunch.rendezvous._backend import StateBackend
from relaunch.rendezvous._corrupt import CorruptWatch
from relaunch.rendezvous._ops import Action, apply, decide_keep_alive
from relaunch.rendezvous._settings import RendezvousSettings

__all__ = ["KeepAlive"]

logger = logging.getLogger(__name__)


class KeepAlive:
    """Every ``keep_alive_interval``: write ``node``'s heartbeat when due and remove the
    dead nodes (one read, at most one compare-and-set); ``after_beat`` runs after each.

    Owns one thread (named after the node) from :meth:`start` until :meth:`stop`.
    """

    def __init__(
        self,
        *,
        node: str,
        backend: StateBackend,
        settings: RendezvousSettings,
        corrupt: CorruptWatch,
        clock: Callable[[], float],
        after_beat: Callable[[], None],
    ) -> None:
        self._node = node
        self._rdzv = backend
        self._settings = settings
        self._corrupt = corrupt
        self._clock = clock
        self._after_beat = after_beat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        if self._thread is not None or self._stop.is_set():
            return
        self._thread = threading.Thread(
            target=self._loop, name=f"relaunch-rdzv-keepalive-{self._node}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop and join the thread (within ``heartbeat_timeout`` + 1 s)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self._settings.heartbeat_timeout + 1.0)
            if thread.is_alive():
                logger.warning("keep-alive thread %s did not stop", thread.name)

    def _loop(self) -> None:
        while not self._stop.wait(self._settings.keep_alive_interval):
            try:
                self.beat()
                self._after_beat()
            except RendezvousStateError as exc:
                self._corrupt.seen(exc)  # logged once per content, not once per beat
            except RelaunchError as exc:
                logger.warning("rendezvous keep-alive of %s failed: %s", self._node, exc)

    def beat(self) -> None:
        """Write our heartbeat when due and remove dead nodes (one read, at most one CAS)."""
        rdzv = self._rdzv
        deadline = self._clock() + self._settings.heartbeat_timeout
        state, raw = rdzv.load()
        self._corrupt.ok()
        while not self._stop.is_set():
            now = self._clock()
            new, dead = rdzv.remove_dead(state, now)
            action = decide_keep_alive(new, self._node, now, self._settings, deadline)
            if action is Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError(f"heartbeat of {self._node} not written in time")
            if action is Action.KEEP_ALIVE:
                new = apply(action, new, self._node, now, self._settings)
            if new is state:
                return
            state, raw, written = rdzv.commit(state, raw, new)
            if written:
                if dead:
                    logger.info("rendezvous %s: removed dead nodes %s", state.run_id, dead)
                return
