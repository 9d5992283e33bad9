"""The request queue: N nodes join a round, or leave the rendezvous, in O(N) store
operations.

Keys, under the rendezvous prefix (:func:`relaunch.rendezvous._backend.key_prefix`):
``req`` (the ticket counter), ``req/<t>`` (ticket ``t``'s request), ``ack/<t>`` (what
its applier decided, a :class:`JoinAck`), and ``applied`` (the last ticket an applier
folded into the state: a hint, written with the acks).

A joining (or leaving) node takes ticket ``t`` (:func:`~relaunch.store.take_ticket` on
``req``: an atomic add, or etcd's version of the key) and writes its
request at ``req/<t>``. The node holding the oldest unapplied ticket (the *head*) folds
every pending request into the state in one compare-and-set, in ticket order, then
sets ``ack/<t>`` for each and ``ack/<next>`` to ``h`` to hand the head over. A node
that is not the head never reads the state: while it waits for its ack it reads
``applied`` to tell a queue that moves from one that stalled (reading the state
instead, every waiting node of a slow round of 12,288 read half a megabyte each, every
wait timeout). Leaves take the same path: when each leaving node rewrote the state by
compare-and-set, N nodes leaving at once (a job's end) moved O(N^2) bytes, and 976 of
1,024 nodes leaving at once had not left after 30 s.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from relaunch._json import loads as json_loads
from relaunch.errors import RendezvousStateError, StoreTimeoutError
from relaunch.rendezvous._ops import perform_requests
from relaunch.rendezvous._places import JoinAck, assignment_of, successors
from relaunch.rendezvous._spent import SpentKeys
from relaunch.rendezvous._state import RendezvousState
from relaunch.store import get_many, set_many, take_ticket, tickets_taken

if TYPE_CHECKING:
    from relaunch.rendezvous._backend import StateBackend

__all__ = ["REQUEST_VERSION", "Request", "RequestQueue"]

logger = logging.getLogger(__name__)

REQUEST_VERSION = 3
"""Version of a departure's JSON (2 added ``leave``, 3 ``depart``); a join is still
written as version 1 and a leave as version 2, which older appliers read."""
_LEAVE_VERSION = 2

_HINT_DIGITS = 20  # an ``applied`` hint longer than this is not a ticket number
_FARTHEST_LOOK = 4
"""A waiting node that needs more stalled periods than this to become the head reads
the ``applied`` hint once every this many periods, not every period."""


class Request(NamedTuple):
    """A request read from the queue: ``node`` joins, or with ``leave`` leaves (with
    ``depart`` too: its running round, as a lost node, before its workers stop)."""

    node: str
    leave: bool
    depart: bool = False


class RequestQueue:
    """The request queue of the rendezvous whose state ``backend`` reads and writes.
    A request's two keys go to ``spent`` (when given) once a state includes it."""

    def __init__(self, backend: StateBackend, spent: SpentKeys | None = None) -> None:
        self.backend = backend
        self.spent = spent
        self.store = backend.store
        self.settings = backend.settings
        self.clock = backend.clock
        self.prefix = backend.prefix
        self._hint_key = backend.prefix + "applied"

    def request(
        self,
        node: str,
        interrupted: Callable[[], bool] = lambda: False,
        *,
        leave: bool = False,
        depart: bool = False,
    ) -> JoinAck | None:
        """Queue the join request of ``node`` (with ``leave``: its leave request; with
        ``depart``: its departure from its running round); return once a state includes it.

        Returns what the applier reported (no state read), or None when the caller
        must read the state to learn more (or ``interrupted`` said so). A node waiting
        in the queue takes over the head's work only when the queue stalls, and then in
        ticket order (one more node per stalled period), never all at once. It reads the
        ``applied`` hint when its wait times out, and only once every few timeouts while
        it is too far from the head to take over sooner (a slow round of thousands).
        """
        ticket = self._enqueue(node, leave, depart)
        request_key, ack_key = f"{self.prefix}req/{ticket}", f"{self.prefix}ack/{ticket}"

        def in_the_state() -> None:  # the request is in the state: its keys are spent
            if self.spent is not None:
                self.spent.add(request_key, ack_key)

        timeout = min(self.settings.heartbeat_timeout, self.settings.dead_after)
        head, stalls = ticket == 1, _Stalls(ticket)
        while True:
            try:
                if interrupted():
                    if head:  # hand the queue over, as an applier does: no stall
                        self.store.set(f"{self.prefix}ack/{ticket + 1}", b"h")
                    return None
                if head:
                    state, raw = self.backend.load()
                    self._correct_hint(state.applied)
                    if state.applied >= ticket:
                        in_the_state()
                        return None
                    self._apply_requests(state, raw, stalls.count > 0, interrupted)
                    head = False
                try:
                    self.store.wait([ack_key], timeout)
                except StoreTimeoutError:
                    if not stalls.timed_out():  # far back: no stall it counts makes it the head
                        continue
                    last = self._applied(ticket, ack_key)
                    if last is None:
                        continue  # acked just after the wait ended: read the ack
                    if last >= ticket:
                        in_the_state()
                        return None
                    head = stalls.hint_read(last)
                    continue
                ack = JoinAck.parse(self.store.get(ack_key) or b"")
                if ack is None:
                    head = True  # handed over: we hold the oldest unapplied ticket
                    continue
                in_the_state()
                return ack
            except RendezvousStateError:
                return None  # corrupt: the caller's patient read says it once and decides

    def _enqueue(self, node: str, leave: bool, depart: bool) -> int:
        """Take a ticket and write the request of ``node`` under it; return the ticket."""
        ticket = take_ticket(self.store, self.prefix + "req")
        request: dict[str, object] = {"version": 1, "run_id": self.settings.run_id, "node": node}
        if depart:
            request.update(version=REQUEST_VERSION, leave=True, depart=True)
        elif leave:
            request.update(version=_LEAVE_VERSION, leave=True)
        self.store.set(f"{self.prefix}req/{ticket}", json.dumps(request).encode())
        return ticket

    def _correct_hint(self, applied: int) -> None:
        """Make the hint say ``applied`` (read in the state) where it says less or is
        not a number: an applier lost between its commit and its acks left it behind,
        and the nodes it did not ack would count stalls on it one timeout per ticket.
        A higher hint is left alone (a newer applier's, or one the state's reset left:
        the ack check in :meth:`_applied` sees through it)."""
        hint = self._read_hint()
        if hint is None or hint < applied:
            self.store.set(self._hint_key, str(applied).encode())

    def _read_hint(self) -> int | None:
        """The ``applied`` hint; None when it is missing or not a ticket number (said)."""
        raw = self.store.get(self._hint_key)
        if raw is not None and len(raw) <= _HINT_DIGITS and raw.isdigit():
            return int(raw)
        if raw is not None:
            logger.warning("rendezvous key %s is not a ticket number: %r", self._hint_key, raw[:40])
        return None

    def _applied(self, ticket: int, ack_key: str) -> int | None:
        """The last ticket applied, from the ``applied`` hint (a few bytes), or None
        when it says ``ticket`` was and its ack is there (written with the hint). From
        the state when the hint is missing, is not a number, or says ``ticket`` was
        applied with no ack (the state decides: a hint may survive a state reset)."""
        hint = self._read_hint()
        if hint is not None:
            if hint < ticket:
                return hint
            if self.store.get(ack_key) is not None:
                return None
        state, _ = self.backend.load()
        return state.applied

    def _read_requests(
        self, first: int, last: int, *, skip_missing: bool, until: float
    ) -> list[Request | None]:
        """The requests ``first..`` (None: refused): up to ``last`` with
        ``skip_missing`` (a ticket never written, its node gone: waited for a keep-alive
        interval, then skipped), else up to the first one not written by ``until`` (its
        node, a call away from it, applies from there, handed the queue)."""
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
        self, state: RendezvousState, batch: list[Request | None], first: int, until: float,
        interrupted: Callable[[], bool],
    ) -> list[Request | None]:  # fmt: skip
        """The requests from ticket ``first`` on that come while ``batch`` cannot
        complete the round (fewer than ``min_nodes``), each waited for a tenth of a
        keep-alive interval, until ``until`` at most: nodes that start together (a job,
        a group restart) land in one batch that completes the round, and each learns
        its place from its ack, not by waiting for the round and reading it."""
        came: list[Request | None] = []
        ticket, slice_ = first, self.settings.keep_alive_interval / 10
        joined = set(state.participants).union(_asking(batch))
        while not state.complete and len(joined) < self.settings.min_nodes:
            left = until - self.clock()
            if left <= 0 or interrupted():
                break
            try:
                self.store.wait([f"{self.prefix}req/{ticket}"], min(slice_, left))
            except StoreTimeoutError:
                break
            more = self._read_requests(ticket, tickets_taken(self.store, self.prefix + "req"),
                                       skip_missing=False, until=until)  # fmt: skip
            came += more
            ticket += len(more)
            joined.update(_asking(more))
        return came

    def _parse_request(self, key: str, raw: bytes | None) -> Request | None:
        if raw is None:
            logger.warning("rendezvous request %s never written; skipped", key)
            return None
        try:
            doc = json_loads(raw)
            version = doc.get("version") if isinstance(doc, dict) else None
            if version not in (1, _LEAVE_VERSION, REQUEST_VERSION) or isinstance(version, bool):
                raise ValueError(f"not a request of version 1 to {REQUEST_VERSION}")
            if doc.get("run_id") != self.settings.run_id:
                raise ValueError(f"request of another run id {doc.get('run_id')!r}")
            node = doc.get("node")
            if not isinstance(node, str) or not node:
                raise ValueError("no node id")
            leave = doc.get("leave", False) if version > 1 else False
            depart = doc.get("depart", False) if version > _LEAVE_VERSION else False
            for name, flag in (("leave", leave), ("depart", depart)):
                if not isinstance(flag, bool):
                    raise ValueError(f"{name!r} is {flag!r}, not true or false")
            if depart and not leave:
                raise ValueError("a departure that does not leave")
        except ValueError as exc:
            logger.warning("rendezvous request %s refused: %s", key, exc)
            return None
        return Request(node, leave, depart)

    def _apply_requests(
        self, state: RendezvousState, raw: bytes | None, skip_missing: bool,
        interrupted: Callable[[], bool],
    ) -> None:  # fmt: skip
        until = self._applier_deadline()
        first = state.applied + 1
        if raw is None:  # no state, with tickets taken: its key was deleted (by hand)
            # The requests its last applier applied (the hint says which) are spent, their
            # keys deleted by their nodes, who ask again once they see a state without them.
            first = max(first, (self._read_hint() or 0) + 1)
        requests = self._read_requests(first, tickets_taken(self.store, self.prefix + "req"),
                                       skip_missing=skip_missing, until=until)  # fmt: skip
        if _asking(requests):  # (a batch of leaves waits for no one)
            requests += self._latecomers(state, requests, first + len(requests), until,
                                         interrupted)  # fmt: skip
        last = first + len(requests) - 1
        new = self._commit(state, raw, requests, first, last)
        if new is not None:
            acks = {}
            ring = successors(new) if new.complete else {}
            for ticket, request in zip(range(first, last + 1), requests, strict=True):
                node = None if request is None or request.leave else request.node
                took = node is not None and node in new.participants
                place = None
                if node is not None and took and new.complete:
                    place = assignment_of(new, node, ring)
                left = request is not None and request.leave and not new.knows(request.node)
                ack = JoinAck(new.epoch, new.round, took, new.complete, place, left)
                acks[f"{self.prefix}ack/{ticket}"] = ack.encode()
            acks[f"{self.prefix}ack/{last + 1}"] = b"h"
            acks[self._hint_key] = str(new.applied).encode()
            set_many(self.store, acks)

    def _applier_deadline(self) -> float:
        """When an applier's waits (for requests, for its write) end: before the others
        take a stall for its loss (min(hb, dead))."""
        return self.clock() + min(self.settings.keep_alive_interval, self.settings.dead_after / 2)

    def _commit(
        self, state: RendezvousState, raw: bytes | None, requests: list[Request | None],
        first: int, last: int,
    ) -> RendezvousState | None:  # fmt: skip
        """Fold ``requests`` (tickets ``first..last``) into the state in one
        compare-and-set; the state written, or None. A write lost to another kind (a
        node claiming the store's host, a failure counted, the dead removed) is made
        again at once on the state now, for a keep-alive interval at most: before, the
        queue stood still for a stall's timeout when its first applier lost one. None
        when another applier took ticket ``first`` or later (its acks answer them)."""
        end = self._applier_deadline()
        stamped = False
        while True:
            now = self.clock()
            new, _ = self.backend.remove_dead(state, now, _asking(requests, leave=True))
            new = new.copy()
            perform_requests(new, [r for r in requests if r is not None], now, self.settings)
            new.applied = max(last, state.applied)
            if not stamped:  # the joining nodes' heartbeats, before the state holds them
                self.backend.liveness.stamp(_asking(requests))
                stamped = True
            new, raw, written = self.backend.commit(state, raw, new)
            if written:
                return new
            if new.applied >= first or self.clock() > end:
                return None
            state = new


def _asking(requests: list[Request | None], *, leave: bool = False) -> list[str]:
    """The nodes that ``requests`` ask to join (with ``leave``: to leave)."""
    return [r.node for r in requests if r is not None and r.leave == leave]


class _Stalls:
    """What a node waiting at ``ticket`` counts of the queue's stalls: ``count``, the
    wait timeouts in which the ``applied`` hint did not move. It becomes the head once
    ``ticket - hint <= 1 + count`` (one more node per stalled period, in ticket order),
    and reads the hint only every ``_FARTHEST_LOOK`` timeouts while it is farther back
    than that: a read adds every period since the last one."""

    def __init__(self, ticket: int) -> None:
        self.ticket = ticket
        self.count = 0
        self._seen = -1  # the hint at the last read
        self._periods = 0  # timeouts since the last read
        self._every = 1  # timeouts between two reads

    def timed_out(self) -> bool:
        """Count one wait timeout; True when the hint is due to be read."""
        self._periods += 1
        return self._periods >= self._every

    def hint_read(self, last: int) -> bool:
        """Count the hint read (``last``, below the ticket); True when this node is now
        the head."""
        self.count = self.count + self._periods if last == self._seen else 0
        self._seen, self._periods = last, 0
        self._every = max(1, min(self.ticket - last - 1 - self.count, _FARTHEST_LOOK))
        return self.ticket - last <= 1 + self.count
