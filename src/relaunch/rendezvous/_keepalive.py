"""The keep-alive thread of one rendezvous handler: heartbeats, dead-node removal, and
the node's lifeline (:mod:`relaunch.rendezvous._lifeline`): a watched node whose
processes die is removed at once, not after the heartbeat timeout."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from relaunch.errors import RelaunchError, RendezvousStateError, RendezvousTimeoutError
from relaunch.rendezvous._backend import StateBackend
from relaunch.rendezvous._corrupt import CorruptWatch
from relaunch.rendezvous._lifeline import Lifeline, Target, decode_address, encode_address
from relaunch.rendezvous._ops import Action, apply, decide_keep_alive, remove_lost
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState, node_sort_key
from relaunch.store import LeaseStore

__all__ = ["KeepAlive"]

logger = logging.getLogger(__name__)


class KeepAlive:
    """Every ``keep_alive_interval``: write ``node``'s heartbeat when due and remove the
    dead nodes (one read, at most one compare-and-set); ``after_beat`` runs after each.
    With ``lifeline_host``, the node listens there (:class:`Lifeline`) and watches the
    next participant: one it reports lost wakes the thread, which removes it.

    Owns one thread (named after the node) from :meth:`start` until :meth:`stop`, and
    the lifeline until :meth:`close_lifeline` (after the node left the state).
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
        lifeline_host: str | None = None,
    ) -> None:
        self._node = node
        self._rdzv = backend
        self._settings = settings
        self._corrupt = corrupt
        self._clock = clock
        self._after_beat = after_beat
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lifeline_host = lifeline_host
        self._lifeline: Lifeline | None = None
        self._lost: set[str] = set()
        self._lost_lock = threading.Lock()
        self._followed: str | None = None

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        if self._thread is not None or self._stop.is_set():
            return
        self._start_lifeline()
        self._thread = threading.Thread(
            target=self._loop, name=f"relaunch-rdzv-keepalive-{self._node}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop and join the thread (within ``heartbeat_timeout`` + 1 s)."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self._settings.heartbeat_timeout + 1.0)
            if thread.is_alive():
                logger.warning("keep-alive thread %s did not stop", thread.name)

    def close_lifeline(self) -> None:
        """Close the lifeline (after the node left the state: its watcher then finds
        nothing to report). Idempotent."""
        lifeline, self._lifeline = self._lifeline, None
        if lifeline is not None:
            lifeline.close()

    def _start_lifeline(self) -> None:
        """Listen and publish the address (before the thread starts: its store)."""
        if self._lifeline_host is None:
            return
        lifeline = Lifeline(self._node, self._lifeline_host, self._lost_seen)
        try:
            lifeline.start()
            host, port = lifeline.address
            self._rdzv.store.set(_lifeline_key(self._rdzv.prefix, self._node),
                                 encode_address(host, port))  # fmt: skip
        except (OSError, RelaunchError) as exc:
            lifeline.close()
            logger.warning("node %s has no lifeline (%s): its loss is noticed by its "
                           "heartbeats only", self._node, exc)  # fmt: skip
            return
        self._lifeline = lifeline

    def _lost_seen(self, node: str) -> None:
        with self._lost_lock:
            self._lost.add(node)
        self._wake.set()

    def _follow(self, state: RendezvousState) -> None:
        """Watch the participant after this node (a ring over the participants)."""
        lifeline = self._lifeline
        if lifeline is None:
            return
        ring = sorted(state.participants, key=node_sort_key)
        nxt = ring[(ring.index(self._node) + 1) % len(ring)] if self._node in ring else None
        if nxt == self._node:
            nxt = None
        if nxt == self._followed:
            return
        self._followed = nxt
        target = None
        if nxt is not None:
            raw = self._rdzv.store.get(_lifeline_key(self._rdzv.prefix, nxt))
            try:
                target = None if raw is None else Target(nxt, *decode_address(raw))
            except ValueError as exc:
                logger.warning("the lifeline address of node %s is corrupt (%s): its loss "
                               "is noticed by its heartbeats only", nxt, exc)  # fmt: skip
        lifeline.watch(target)

    def wake(self) -> None:
        """Beat now (a round began: the ring's next participant may be another)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._settings.keep_alive_interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.beat()
                self._after_beat()
            except RendezvousStateError as exc:
                self._corrupt.seen(exc)  # logged once per content, not once per beat
            except RelaunchError as exc:
                logger.warning("rendezvous keep-alive of %s failed: %s", self._node, exc)

    def beat(self) -> None:
        """Write our heartbeat when due and remove dead and lost nodes (one read, at
        most one CAS); then watch the next participant."""
        rdzv = self._rdzv
        deadline = self._clock() + self._settings.heartbeat_timeout
        state, raw = rdzv.load()
        self._corrupt.ok()
        with self._lost_lock:
            lost, self._lost = self._lost, set()
        self._follow(self._beat(state, raw, deadline, lost))

    def _beat_due(self, state: RendezvousState, now: float) -> bool:
        """Whether to write the heartbeat into the state now. Where the store has
        liveness of its own (etcd leases decide who is dead), the state's heartbeat
        only tells ``relaunch status`` how recent a node is: once per ``dead_after``."""
        if not isinstance(self._rdzv.store, LeaseStore):
            return True
        last = state.last_heartbeats.get(self._node)
        return last is None or now - last >= self._settings.dead_after

    def _beat(
        self, state: RendezvousState, raw: bytes | None, deadline: float, lost: set[str]
    ) -> RendezvousState:
        rdzv = self._rdzv
        while not self._stop.is_set():
            now = self._clock()
            new, dead = rdzv.remove_dead(state, now)
            new, gone = remove_lost(new, lost, now, self._settings)
            dead += gone
            action = decide_keep_alive(new, self._node, now, self._settings, deadline)
            if action is Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError(f"heartbeat of {self._node} not written in time")
            if action is Action.KEEP_ALIVE and self._beat_due(new, now):
                new = apply(action, new, self._node, now, self._settings)
            if new is state:
                return state
            state, raw, written = rdzv.commit(state, raw, new)
            if written:
                if dead:
                    logger.info("rendezvous %s: removed dead nodes %s", state.run_id, dead)
                return state
        return state


def _lifeline_key(prefix: str, node: str) -> str:
    return f"{prefix}lifeline/{node}"
