"""The keep-alive thread of one rendezvous handler: heartbeats, dead-node removal, and
the node's lifeline (:mod:`relaunch.rendezvous._lifeline`): a watched node whose
processes die is removed at once, not after the heartbeat timeout.

Each beat costs this node O(1) store work: its heartbeat key, the steward key
(:mod:`relaunch.rendezvous._liveness`), the refused-nodes count. Only the steward reads
the state and everyone's liveness, and removes the dead; a node whose lifeline reported
a lost node reads the state to remove it. The steward also reports a corrupt state in
its key, so every node learns of it (and gives up on it after the dead-node delay)
without reading the state itself.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

from relaunch.errors import RelaunchError, RendezvousStateError, StoreLostError
from relaunch.rendezvous._backend import StateBackend
from relaunch.rendezvous._corrupt import CorruptWatch
from relaunch.rendezvous._lifeline import Lifeline, Target, decode_address, encode_address
from relaunch.rendezvous._ops import remove_lost
from relaunch.rendezvous._places import assignment_of
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState
from relaunch.store import has_leases, together

__all__ = ["KeepAlive"]

logger = logging.getLogger(__name__)


class KeepAlive:
    """Every ``keep_alive_interval``: write ``node``'s heartbeat and run ``after_beat``;
    as the steward, then remove the dead nodes (one state read, one liveness read, at
    most one compare-and-set). With ``lifeline_host``, the node listens there
    (:class:`Lifeline`) and watches the next participant (:meth:`follow`, or the ring
    of the state when it read one): one it reports lost wakes the thread, which
    removes it.

    Owns one thread (named after the node) from :meth:`start` until :meth:`stop`, and
    the lifeline from :meth:`open` (or :meth:`start`) until :meth:`close_lifeline`
    (after the node left the state).
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
        self._opened = False
        self._lost: set[str] = set()
        self._lost_lock = threading.Lock()
        self._followed: str | None = None
        self._looked: tuple[frozenset[str] | None, float] = (None, -math.inf)
        """As the steward on a store with leases: the keys of the live leases when it
        last read the state and removed the dead it showed, and when."""

    def open(self) -> None:
        """Listen on the lifeline and publish its address (once): before the node joins,
        so that the other nodes of its round find it when they are placed."""
        if self._opened or self._stop.is_set():
            return
        self._opened = True
        self._start_lifeline()

    def start(self) -> None:
        """Start beating: the thread (once; later calls do nothing), the lifeline first."""
        if self._thread is not None or self._stop.is_set():
            return
        self.open()
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

    def follow(self, node: str | None) -> None:
        """Watch ``node``'s lifeline (the next participant of this node's round, as its
        assignment says; None: no one)."""
        lifeline = self._lifeline
        if lifeline is None or node == self._followed:
            return
        self._followed = node
        target = None
        if node is not None:
            raw = self._rdzv.store.get(_lifeline_key(self._rdzv.prefix, node))
            try:
                target = None if raw is None else Target(node, *decode_address(raw))
            except ValueError as exc:
                logger.warning("the lifeline address of node %s is corrupt (%s): its loss "
                               "is noticed by its heartbeats only", node, exc)  # fmt: skip
        lifeline.watch(target)

    def _follow_ring(self, state: RendezvousState) -> None:
        """Watch the participant after this node by rank, as ``state`` has them."""
        if self._node in state.participants:
            self.follow(assignment_of(state, self._node).successor)
        else:
            self.follow(None)

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
            except RendezvousStateError as exc:
                self._corrupt.seen(exc)  # logged once per content, not once per beat
            except StoreLostError:
                return  # no beat can land again; the agent's next call says why
            except RelaunchError as exc:
                logger.warning("rendezvous keep-alive of %s failed: %s", self._node, exc)

    def beat(self) -> None:
        """Write our heartbeat, and run ``after_beat``; as the steward (or with lost
        nodes to remove), then read the state and remove the dead and the lost (at most
        one CAS). On a store with leases the steward reads the keys of the live leases
        first, and the state only when they changed since its last look, or once per
        dead-node delay (a read of O(N) bytes through a consensus round saved).

        The small calls go :func:`~relaunch.store.together`: a wait of the node's
        parked on its connection (for its next round) is cut into once a beat, not once
        a call (three messages each: five cuts a beat just after a round, with the
        round's spent keys)."""
        rdzv = self._rdzv
        with together(rdzv.store):
            rdzv.liveness.beat(self._node)
            with self._lost_lock:
                lost, self._lost = self._lost, set()
            steward = rdzv.liveness.steward(self._node, self._corrupt)
            self._after_beat()
        if not (steward or lost):
            return
        alive = None
        if steward and has_leases(rdzv.store):
            # the keys of the live leases first: while they are the ones of the last
            # look, no node died or came, and the state needs no read (once per
            # dead-node delay all the same)
            alive = rdzv.liveness.everyone_alive()
            known, read_at = self._looked
            if not lost and alive == known and self._clock() - read_at < self._settings.dead_after:
                return
        try:
            state, raw = rdzv.load()
        except RendezvousStateError as exc:
            if steward:
                rdzv.liveness.report_corrupt(exc)
            raise
        self._corrupt.ok()
        if steward:
            rdzv.liveness.report_corrupt(None)
            filled = rdzv.fill_epochs(state)
            if filled:
                logger.warning("rendezvous %s: epoch keys %s were missing (a writer lost "
                               "after its write): written", state.run_id, filled)  # fmt: skip
        if alive is not None and not alive.issuperset(state.last_heartbeats):
            # a node placed since ``alive`` was read has a younger key: read them again,
            # and the state again next beat
            alive = None
        self._follow_ring(self._clean(state, raw, lost, scan=steward, alive=alive))
        # the state is clean of the dead these keys showed: until they change, no read
        self._looked = (alive, self._clock()) if alive is not None else (None, -math.inf)

    def _clean(
        self,
        state: RendezvousState,
        raw: bytes | None,
        lost: set[str],
        *,
        scan: bool,
        alive: frozenset[str] | None,
    ) -> RendezvousState:
        """Remove the ``lost`` nodes, and the dead ones too with ``scan`` (at the first
        try by ``alive``, the keys of the live leases when given: read before the
        state, they cover every node in it); the state now."""
        rdzv = self._rdzv
        while not self._stop.is_set():
            now = self._clock()
            new, dead = rdzv.remove_dead(state, now, alive=alive) if scan else (state, [])
            alive = None  # a retry reads them again
            new, gone = remove_lost(new, lost, now, self._settings)
            dead += gone
            if new is state:
                return state
            state, raw, written = rdzv.commit(state, raw, new)
            if written:
                logger.info("rendezvous %s: removed dead nodes %s", state.run_id, dead)
                return state
        return state


def _lifeline_key(prefix: str, node: str) -> str:
    return f"{prefix}lifeline/{node}"
