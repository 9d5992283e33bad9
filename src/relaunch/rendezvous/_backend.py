"""The I/O around the pure state machine: the shared state in a Store.

Keys, under ``relaunch/rdzv/<run_id>/``:

``state``
    The JSON state. Every write is a compare-and-set against the bytes last read
    (they carry ``seq``, so the bytes are the fencing token: no lost update).
``epoch/<n>``
    Set after the write that raised the state's ``epoch`` to ``n``. A node
    waiting for a change waits on ``epoch/<epoch + 1>``: the store wakes it.
``req``, ``req/<t>``, ``ack/<t>``, ``applied``
    The request queue (:mod:`relaunch.rendezvous._queue`): N nodes joining (or leaving)
    at once cost O(N) store operations, and a node that is not the queue's head never
    reads the state.
``assign/<r>/<node>``
    ``"<rank> <world_size> <incarnation> <successor>"``, written (before the epoch
    key) by whoever completes round ``r`` (or fills a vacancy of it): a participant
    learns its rank, the incarnation its workers start at, and the node it watches
    (the next participant by rank, ``-`` for none) with one small read, without
    reading the state.
``hb/<node>``, ``alive/<node>``, ``steward``
    Liveness (:mod:`relaunch.rendezvous._liveness`): each node's own heartbeat key,
    its lease's key on etcd, and the node that finds the dead this interval. The
    heartbeat times in the state are when each node was placed, not heartbeats.
``round/<r>/``
    The prefix of the store handed out with round ``r`` (and, to be read, with the two
    rounds after it: where round ``r``'s nodes serve their snapshots).

A node deletes its own ``req/<t>``, ``ack/<t>`` and ``assign/<r>/<node>`` once it has
its place in a later round (:mod:`relaunch.rendezvous._spent`): the store holds the live
round's keys, not three more per node each round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable

from relaunch.errors import StoreTimeoutError
from relaunch.rendezvous._liveness import Liveness
from relaunch.rendezvous._ops import needs_wake, remove_dead
from relaunch.rendezvous._places import Assignment, assignment_of, successors
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState, decode_state, encode_state
from relaunch.store import Store, get_many, set_many

__all__ = ["StateBackend", "key_prefix"]

logger = logging.getLogger(__name__)


def key_prefix(run_id: str) -> str:
    """Where the rendezvous of ``run_id`` keeps its keys."""
    return f"relaunch/rdzv/{run_id}/"


FILL_BACK = 16
"""Epochs a new steward looks back over for a missing ``epoch/<n>`` key."""


class StateBackend:
    """Reads and writes the shared state of one run in ``store``.

    ``clock`` returns wall-clock seconds (the time written into the state); ``ticks``,
    seconds that never step (how long a heartbeat stood unchanged; None: ``clock``).
    """

    def __init__(
        self,
        store: Store,
        settings: RendezvousSettings,
        *,
        clock: Callable[[], float],
        ticks: Callable[[], float] | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self.prefix = key_prefix(settings.run_id)
        self.state_key = self.prefix + "state"
        self.liveness = Liveness(store, self.prefix, settings, clock, ticks)
        self._epochs_filled = 0
        """The epoch up to which :meth:`fill_epochs` found every ``epoch/<n>`` key."""

    def announce(self, node: str) -> None:
        """Write ``node``'s liveness keys where they come before it joins (a lease's)."""
        self.liveness.announce(node)

    def remove_dead(
        self,
        state: RendezvousState,
        now: float,
        leaving: Collection[str] = (),
        alive: Collection[str] | None = None,
    ) -> tuple[RendezvousState, list[str]]:
        """:func:`remove_dead` of the nodes the state knows, by their liveness keys (one
        read of O(N) bytes: only the steward, a join's applier and a waiting node call
        it, never every node at every beat; none when the caller read ``alive`` just
        before, :meth:`Liveness.everyone_alive`). The ``leaving`` nodes (a batch of
        leave requests) count as alive: they leave, not die, so a complete round stays
        complete for the others."""
        if not state.last_heartbeats:
            return state, []
        seen = self.liveness.alive(state.last_heartbeats) if alive is None else set(alive)
        return remove_dead(state, now, self.settings, seen | set(leaving))

    def fresh(self) -> RendezvousState:
        return RendezvousState(run_id=self.settings.run_id)

    def epoch_key(self, epoch: int) -> str:
        return f"{self.prefix}epoch/{epoch}"

    def fill_epochs(self, state: RendezvousState) -> list[int]:
        """Write the ``epoch/<n>`` keys up to ``state``'s epoch that are missing (the
        steward's, after it read the state); the epochs filled. A writer lost between
        its compare-and-set and that key left one out, and the nodes waiting on it saw
        no later change until their next rendezvous (a reopened round missed, workers
        hung in a collective). Reads the keys of the epochs since its last call only
        (none at idle), the last :data:`FILL_BACK` at its first."""
        top = state.epoch
        first = max(self._epochs_filled + 1, top - FILL_BACK + 1, 1)
        if first > top:
            return []
        keys = [self.epoch_key(n) for n in range(first, top + 1)]
        missing = [key for key, raw in zip(keys, get_many(self.store, keys), strict=True)
                   if raw is None]  # fmt: skip
        if missing:
            set_many(self.store, dict.fromkeys(missing, b"1"))
        self._epochs_filled = top
        return [first + keys.index(key) for key in missing]

    def _decode(self, raw: bytes) -> RendezvousState:
        return decode_state(
            raw,
            key=self.state_key,
            run_id=self.settings.run_id,
            max_nodes=self.settings.max_nodes,
        )

    def load(self) -> tuple[RendezvousState, bytes | None]:
        """The current state and its bytes (``None``: no state yet, a fresh one)."""
        raw = self.store.get(self.state_key)
        if raw is None:
            return self.fresh(), None
        return self._decode(raw), raw

    def commit(
        self, old: RendezvousState, old_raw: bytes | None, new: RendezvousState
    ) -> tuple[RendezvousState, bytes | None, bool]:
        """Write ``new`` if the state is still ``old_raw``; return the state now and whether."""
        new.seq = old.seq + 1
        new.epoch = old.epoch + 1 if needs_wake(old, new) else old.epoch
        data = encode_state(new)
        current, written = self.store.compare_set(self.state_key, old_raw, data)
        # A compare-and-set sent again (the etcd client resends to another member once
        # one is slow to answer) after its first send was applied answers "not written"
        # with this write's own bytes: it was written (the same bytes from another node
        # would be the same step from the same state, whose effects below repeat safely).
        if written or current == data:
            if new.complete and not (old.complete and old.round == new.round):
                self._publish_assignments(new, new.participants)
            elif new.complete and new.participants.keys() - old.participants.keys():
                # a vacancy filled: tell the node that took it
                fresh = new.participants.keys() - old.participants.keys()
                self._publish_assignments(new, fresh)
            if new.epoch != old.epoch:
                self.store.set(self.epoch_key(new.epoch), b"1")
            return new, data, True
        if not current:
            return self.fresh(), None, False
        return self._decode(current), current, False

    def assign_key(self, round_: int, node: str) -> str:
        return f"{self.prefix}assign/{round_}/{node}"

    def _publish_assignments(self, state: RendezvousState, nodes: Iterable[str]) -> None:
        """Tell participants of a just-completed round (or a node that filled a vacancy)
        their place without a state read."""
        ring = successors(state)
        items = {
            self.assign_key(state.round, node): assignment_of(state, node, ring).encode()
            for node in nodes
        }
        set_many(self.store, items)

    def assignment(self, round_: int, node: str) -> Assignment | None:
        """``node``'s place in round ``round_`` once it completed, else None."""
        raw = self.store.get(self.assign_key(round_, node))
        return None if raw is None else Assignment.parse(raw)

    def await_place(
        self, round_: int, node: str, epoch: int, timeout: float, interrupted: Callable[[], bool]
    ) -> Assignment | None:
        """``node``'s place once round ``round_`` completes within ``timeout`` seconds
        (None: not by then, or ``interrupted``), the state at ``epoch`` when it began
        waiting. Woken by each later epoch, it reads only its assignment (a few bytes): a
        round assembled in many batches raises the epoch at each, and every waiting
        node reading the state each time moved O(N^2) bytes (12,288 simulated nodes
        ran out of memory). The state is read by the caller once the wait ends."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0 or interrupted() or not self.wait_epoch(epoch, left):
                return None
            epoch += 1
            place = self.assignment(round_, node)
            if place is not None:
                return place

    def wait_epoch(self, epoch: int, timeout: float) -> bool:
        """Wait until the state's epoch passed ``epoch``; False after ``timeout``."""
        try:
            self.store.wait([self.epoch_key(epoch + 1)], max(timeout, 0.001))
        except StoreTimeoutError:
            return False
        return True

    def wait_change(self, state: RendezvousState, timeout: float) -> bool:
        """Wait until a write raised the epoch past ``state``'s; False after ``timeout``."""
        try:
            self.store.wait([self.epoch_key(state.epoch + 1)], max(timeout, 0.001))
        except StoreTimeoutError:
            return False
        return True

    def changed_since(self, state: RendezvousState) -> bool:
        """Whether a write that waiting nodes must see happened after ``state`` (one get)."""
        return self.store.get(self.epoch_key(state.epoch + 1)) is not None
