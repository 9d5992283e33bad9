"""The I/O around the pure state machine: the shared state in a Store.

Keys, under ``relaunch/rdzv/<run_id>/``:

``state``
    The JSON state. Every write is a compare-and-set against the bytes last read
    (they carry ``seq``, so the bytes are the fencing token: no lost update).
``epoch/<n>``
    Set after the write that raised the state's ``epoch`` to ``n``. A node
    waiting for a change waits on ``epoch/<epoch + 1>``: the store wakes it.
``req``, ``req/<t>``, ``ack/<t>``
    The join queue. A joining node takes ticket ``t`` (atomic add on ``req``) and
    writes its request at ``req/<t>``. The node holding the oldest unapplied
    ticket (the *head*) folds every pending request into the state in one
    compare-and-set, then sets ``ack/<t>`` for each (``a <epoch> <round> <p|-> <c|o>``),
    and ``ack/<next>`` to ``h`` to hand the head over. So N nodes joining at once
    cost O(N) store operations, not the O(N^2) of everyone retrying the same
    compare-and-set, and a node that is not the head never reads the state.
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
    The prefix of the store handed out with round ``r``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from relaunch.errors import RendezvousStateError, StoreTimeoutError
from relaunch.rendezvous._liveness import Liveness
from relaunch.rendezvous._ops import needs_wake, place_all, remove_dead
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState, decode_state, encode_state, round_size
from relaunch.store import Store, get_many, set_many

__all__ = [
    "REQUEST_VERSION",
    "Assignment",
    "JoinAck",
    "StateBackend",
    "assignment_of",
    "key_prefix",
]

logger = logging.getLogger(__name__)

REQUEST_VERSION = 1
"""Version of the join request JSON."""


def key_prefix(run_id: str) -> str:
    """Where the rendezvous of ``run_id`` keeps its keys."""
    return f"relaunch/rdzv/{run_id}/"


@dataclass(frozen=True)
class Assignment:
    """A participant's place in a complete round, at ``assign/<r>/<node>``."""

    rank: int
    world_size: int
    incarnation: int = 0
    """The incarnation its workers start at (a vacancy's; else 0)."""
    successor: str | None = None
    """The next participant by rank, whose lifeline this node watches (None: alone)."""

    def encode(self) -> bytes:
        return f"{self.rank} {self.world_size} {self.incarnation} {self.successor or '-'}".encode()

    @classmethod
    def parse(cls, raw: bytes) -> Assignment | None:
        parts = raw.decode(errors="replace").split()
        try:
            if len(parts) == 4:
                nxt = None if parts[3] == "-" else parts[3]
                return cls(int(parts[0]), int(parts[1]), int(parts[2]), nxt)
            if len(parts) == 2:
                return cls(int(parts[0]), int(parts[1]))
        except ValueError:
            pass
        return None


@dataclass(frozen=True)
class JoinAck:
    """What the applier of a join request tells its node, at ``ack/<t>``."""

    epoch: int
    round: int
    participant: bool
    """Whether the node is a participant of ``round`` (else: read the state)."""
    complete: bool
    """Whether ``round`` was complete in the state that took the node in."""
    place: Assignment | None = None
    """The node's place when its request completed the round (no more reads)."""

    def encode(self) -> bytes:
        where = "p" if self.participant else "-"
        head = f"a {self.epoch} {self.round} {where} {'c' if self.complete else 'o'}".encode()
        return head if self.place is None else head + b" " + self.place.encode()

    @classmethod
    def parse(cls, raw: bytes) -> JoinAck | None:
        parts = raw.split(maxsplit=5)
        if len(parts) not in (5, 6) or parts[0] != b"a":
            return None
        place = Assignment.parse(parts[5]) if len(parts) == 6 else None
        if len(parts) == 6 and place is None:
            return None
        try:
            flags = parts[3] == b"p", parts[4] == b"c"
            return cls(int(parts[1]), int(parts[2]), *flags, place)
        except ValueError:
            return None


def _ring(state: RendezvousState) -> dict[str, str]:
    """Each participant -> the next by rank (the node whose lifeline it watches)."""
    order = sorted(state.participants, key=state.participants.__getitem__)
    if len(order) < 2:
        return {}
    return {n: order[(i + 1) % len(order)] for i, n in enumerate(order)}


def assignment_of(
    state: RendezvousState, node: str, ring: dict[str, str] | None = None
) -> Assignment:
    """The place of ``node``, a participant of the complete round of ``state``
    (``ring``: :func:`_ring` of it, when already made)."""
    rank = state.participants[node]
    after = (_ring(state) if ring is None else ring).get(node)
    return Assignment(rank, round_size(state), state.incarnations.get(rank, 0), after)


class StateBackend:
    """Reads and writes the shared state of one run in ``store``.

    ``clock`` returns wall-clock seconds (the time written into the state).
    """

    def __init__(
        self, store: Store, settings: RendezvousSettings, *, clock: Callable[[], float]
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self.prefix = key_prefix(settings.run_id)
        self.state_key = self.prefix + "state"
        self.liveness = Liveness(store, self.prefix, settings, clock)

    def announce(self, node: str) -> None:
        """Write ``node``'s liveness keys where they come before it joins (a lease's)."""
        self.liveness.announce(node)

    def remove_dead(self, state: RendezvousState, now: float) -> tuple[RendezvousState, list[str]]:
        """:func:`remove_dead` of the nodes the state knows, by their liveness keys (one
        read of O(N) bytes: only the steward, a join's applier and a waiting node call
        it, never every node at every beat)."""
        if not state.last_heartbeats:
            return state, []
        alive = self.liveness.alive(state.last_heartbeats)
        return remove_dead(state, now, self.settings, alive)

    def fresh(self) -> RendezvousState:
        return RendezvousState(run_id=self.settings.run_id)

    def epoch_key(self, epoch: int) -> str:
        return f"{self.prefix}epoch/{epoch}"

    def _decode(self, raw: bytes) -> RendezvousState:
        return decode_state(
            raw,
            key=self.state_key,
            run_id=self.settings.run_id,
            now=self.clock(),
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
        if written:
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

    def _assign_key(self, round_: int, node: str) -> str:
        return f"{self.prefix}assign/{round_}/{node}"

    def _publish_assignments(self, state: RendezvousState, nodes: Iterable[str]) -> None:
        """Tell participants of a just-completed round (or a node that filled a vacancy)
        their place without a state read."""
        ring = _ring(state)
        items = {
            self._assign_key(state.round, node): assignment_of(state, node, ring).encode()
            for node in nodes
        }
        set_many(self.store, items)

    def assignment(self, round_: int, node: str) -> Assignment | None:
        """``node``'s place in round ``round_`` once it completed, else None."""
        raw = self.store.get(self._assign_key(round_, node))
        return None if raw is None else Assignment.parse(raw)

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

    # -- the join queue -------------------------------------------------------------

    def request_join(
        self, node: str, interrupted: Callable[[], bool] = lambda: False
    ) -> JoinAck | None:
        """Queue the join request of ``node``; return once a state includes it.

        Returns what the applier reported (no state read), or None when the
        caller must read the state to learn more. A node waiting in the queue
        takes over the head's work only when the queue stalls, and then in
        ticket order (one more node per stalled period), never all at once.
        """
        ticket = self.store.add(self.prefix + "req", 1)
        request = {"version": REQUEST_VERSION, "run_id": self.settings.run_id, "node": node}
        self.store.set(f"{self.prefix}req/{ticket}", json.dumps(request).encode())
        ack_key = f"{self.prefix}ack/{ticket}"
        timeout = min(self.settings.heartbeat_timeout, self.settings.dead_after)
        head = ticket == 1
        seen, stalls = -1, 0
        while True:
            try:
                if interrupted():
                    return None
                if head:
                    state, raw = self.load()
                    if state.applied >= ticket:
                        return None
                    self._apply_requests(state, raw, stalls > 0, interrupted)
                    head = False
                try:
                    self.store.wait([ack_key], timeout)
                except StoreTimeoutError:
                    state, _ = self.load()
                    if state.applied >= ticket:
                        return None
                    stalls = stalls + 1 if state.applied == seen else 0
                    seen = state.applied
                    head = ticket - state.applied <= 1 + stalls
                    continue
                ack = JoinAck.parse(self.store.get(ack_key) or b"")
                if ack is None:
                    head = True  # handed over: we hold the oldest unapplied ticket
                    continue
                return ack
            except RendezvousStateError:
                return None  # corrupt: the caller's patient read says it once and decides

    def _read_requests(
        self, first: int, last: int, *, skip_missing: bool, until: float
    ) -> list[str | None]:
        """The node ids of join requests ``first..`` (None: refused): up to ``last``
        with ``skip_missing`` (a ticket never written, its node gone: waited for a
        keep-alive interval, then skipped), else up to the first one not written by
        ``until`` (its node, a call away from it, applies from there, handed the queue)."""
        keys = [f"{self.prefix}req/{t}" for t in range(first, last + 1)]
        raws = get_many(self.store, keys)
        missing = [key for key, raw in zip(keys, raws, strict=True) if raw is None]
        wait = self.settings.keep_alive_interval if skip_missing else until - self.clock()
        if missing and wait > 0:
            with contextlib.suppress(StoreTimeoutError):
                self.store.wait(missing, wait)
            raws = get_many(self.store, keys)
        if None in raws and not skip_missing:
            raws = raws[: raws.index(None)]
        return [self._parse_request(key, raw) for key, raw in zip(keys, raws, strict=False)]

    def _latecomers(
        self, state: RendezvousState, batch: list[str | None], first: int, until: float,
        interrupted: Callable[[], bool],
    ) -> list[str | None]:  # fmt: skip
        """The requests from ticket ``first`` on that come while ``batch`` cannot
        complete the round (fewer than ``min_nodes``), each waited for a tenth of a
        keep-alive interval, until ``until`` at most: nodes that start together (a job,
        a group restart) land in one batch that completes the round, and each learns
        its place from its ack, not by waiting for the round and reading it."""
        came: list[str | None] = []
        ticket, slice_ = first, self.settings.keep_alive_interval / 10
        joined = set(state.participants).union(n for n in batch if n is not None)
        while not state.complete and len(joined) < self.settings.min_nodes:
            left = until - self.clock()
            if left <= 0 or interrupted():
                break
            try:
                self.store.wait([f"{self.prefix}req/{ticket}"], min(slice_, left))
            except StoreTimeoutError:
                break
            more = self._read_requests(ticket, self.store.add(self.prefix + "req", 0),
                                       skip_missing=False, until=until)  # fmt: skip
            came += more
            ticket += len(more)
            joined.update(n for n in more if n is not None)
        return came

    def _parse_request(self, key: str, raw: bytes | None) -> str | None:
        if raw is None:
            logger.warning("join request %s never written; skipped", key)
            return None
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != REQUEST_VERSION:
                raise ValueError("not a version 1 join request")
            if doc.get("run_id") != self.settings.run_id:
                raise ValueError(f"request of another run id {doc.get('run_id')!r}")
            node = doc.get("node")
            if not isinstance(node, str) or not node:
                raise ValueError("no node id")
        except ValueError as exc:
            logger.warning("join request %s refused: %s", key, exc)
            return None
        return node

    def _apply_requests(
        self, state: RendezvousState, raw: bytes | None, skip_missing: bool,
        interrupted: Callable[[], bool],
    ) -> None:  # fmt: skip
        # waits end before the others take a stall for the applier's loss (min(hb, dead))
        until = self.clock() + min(self.settings.keep_alive_interval, self.settings.dead_after / 2)
        first = state.applied + 1
        nodes = self._read_requests(first, self.store.add(self.prefix + "req", 0),
                                    skip_missing=skip_missing, until=until)  # fmt: skip
        nodes += self._latecomers(state, nodes, first + len(nodes), until, interrupted)
        last = first + len(nodes) - 1
        now = self.clock()
        new, _ = self.remove_dead(state, now)
        new = new.copy()
        placed = [n for n in nodes if n is not None]
        place_all(new, placed, now, self.settings)
        new.applied = max(last, state.applied)
        self.liveness.stamp(placed)
        new, _, written = self.commit(state, raw, new)
        if written:
            acks = {}
            ring = _ring(new) if new.complete else {}
            for ticket, node in zip(range(first, last + 1), nodes, strict=True):
                took = node is not None and node in new.participants
                place = None
                if node is not None and took and new.complete:
                    place = assignment_of(new, node, ring)
                ack = JoinAck(new.epoch, new.round, took, new.complete, place)
                acks[f"{self.prefix}ack/{ticket}"] = ack.encode()
            acks[f"{self.prefix}ack/{last + 1}"] = b"h"
            set_many(self.store, acks)
