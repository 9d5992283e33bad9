"""How a node gets its place in the next complete round: the join loop.

:class:`RoundJoin` reads the state, asks the pure core (:func:`decide_join`) what to
do, and does it: queue a join request, wait for the round to change, or write the
state; it returns the node's :class:`Placed` once a round it takes part in is
complete. The handler turns that into the round's info (its store, the peers) and
owns everything else: the keep-alive, the status board, the leave.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from relaunch.errors import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from relaunch.rendezvous._backend import StateBackend
from relaunch.rendezvous._corrupt import CorruptWatch
from relaunch.rendezvous._ops import JOIN_REQUEST_ACTIONS, Action, apply, decide_join
from relaunch.rendezvous._places import Assignment, assignment_of
from relaunch.rendezvous._polled import load_through_corruption
from relaunch.rendezvous._queue import RequestQueue
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState

__all__ = ["Placed", "RoundJoin"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placed:
    """This node's place in a complete round (``state``: the state it was read from,
    when the loop read one of that round; None when the place came on its own)."""

    round: int
    place: Assignment
    state: RendezvousState | None = None


@dataclass(frozen=True)
class RoundJoin:
    """The join loop of one node over the rendezvous state (``clock``: wall time;
    ``interrupted``: set to make a blocked :meth:`run` raise RendezvousClosedError)."""

    node: str
    backend: StateBackend
    queue: RequestQueue
    settings: RendezvousSettings
    corrupt: CorruptWatch
    interrupted: threading.Event
    clock: Callable[[], float]
    dequeued: Callable[[], None] = lambda: None
    """Called once a join request of this node left the queue: its keep-alive starts.
    A queued node is in no state (the applier writes its heartbeat as it places it),
    so no one reads its beats: 16,384 nodes joining at once on a 5 s interval made
    most of the round's store calls with them, each cutting into the node's wait for
    its ack (three messages more), and on 2 cores the round never completed."""

    def run(
        self,
        state: RendezvousState | None,
        raw: bytes | None,
        deadline: float,
        while_waiting: Callable[[], None] | None,
    ) -> Placed:
        """Join from ``state`` (None: queue a request at once; its applier places the
        node) until this node has its place in a complete round.

        Raises RendezvousClosedError (closed, or interrupted), RendezvousTimeoutError
        (past ``deadline``), RendezvousGracefulExitError (a spare no longer needed),
        RendezvousStateError, StoreError.
        """
        while True:
            if self.interrupted.is_set():
                raise RendezvousClosedError(f"node {self.node}: next_rendezvous interrupted")
            now = self.clock()
            if state is None:
                action = Action.ADD_TO_PARTICIPANTS
            else:
                cleaned, dead = self.backend.remove_dead(state, now)
                if dead:
                    logger.info("rendezvous %s: removing dead nodes %s", self.settings.run_id, dead)
                    state, raw, _ = self.backend.commit(state, raw, cleaned)
                    continue
                action = decide_join(state, self.node, now, self.settings, deadline)
            self._raise_if_ended(action)
            placed: Placed | None = None
            if action is Action.FINISH:
                assert state is not None
                placed = Placed(state.round, assignment_of(state, self.node), state)
            elif action in JOIN_REQUEST_ACTIONS:
                if action is Action.REMOVE_FROM_REDUNDANCY_LIST:
                    deadline = now + self.settings.join_timeout
                placed = self._request(now, deadline)
            elif action is Action.SYNC:
                assert state is not None
                placed = self._sync(state, now, deadline, while_waiting)
            else:
                assert state is not None
                new = apply(action, state, self.node, now, self.settings)
                state, raw, _ = self.backend.commit(state, raw, new)
                continue
            if placed is not None:
                return placed
            state, raw = load_through_corruption(
                self.backend, self.corrupt, self.interrupted, patient=state is not None
            )

    def _raise_if_ended(self, action: Action) -> None:
        """Raise what ends the join for ``action``, if it is one of the ends."""
        run_id, node = self.settings.run_id, self.node
        if action is Action.ERROR_CLOSED:
            raise RendezvousClosedError(f"the rendezvous {run_id!r} is closed")
        if action is Action.EXIT_GRACEFULLY:
            raise RendezvousGracefulExitError(
                f"the rendezvous {run_id!r} is closed; spare {node} leaves"
            )
        if action is Action.ERROR_TIMEOUT:
            raise RendezvousTimeoutError(
                f"node {node} did not join a complete round of {run_id!r} "
                f"within join_timeout={self.settings.join_timeout} s"
            )

    def _request(self, now: float, deadline: float) -> Placed | None:
        """Ask the applier to place this node; its place once the round it joined is
        complete (within a dead-node timeout), or None to look at the state again."""
        ack = self.queue.request(self.node, self.interrupted.is_set)
        self.dequeued()  # placed, or its place is read from the state from now on
        if ack is None or not ack.participant:
            return None
        if ack.place is not None:  # this request completed the round
            return Placed(ack.round, ack.place)
        if ack.complete:
            got = self.backend.assignment(ack.round, self.node)
        else:
            timeout = min(self.settings.dead_after, deadline - now)
            got = self.backend.await_place(
                ack.round, self.node, ack.epoch, timeout, self.interrupted.is_set
            )
        return None if got is None else Placed(ack.round, got)

    def _sync(
        self,
        state: RendezvousState,
        now: float,
        deadline: float,
        while_waiting: Callable[[], None] | None,
    ) -> Placed | None:
        """Wait for the state to change (running ``while_waiting`` beside a running
        round); this node's place when its round completed meanwhile, else None."""
        node = self.node
        beside = state.complete and node not in state.participants  # spare, waiting
        if while_waiting is not None and beside:
            while_waiting()
        timeout = self._sync_timeout(state, now, deadline)
        if node not in state.participants:
            self.backend.wait_change(state, timeout)
            return None
        got = self.backend.await_place(
            state.round, node, state.epoch, timeout, self.interrupted.is_set
        )
        return None if got is None else Placed(state.round, got)

    def _sync_timeout(self, state: RendezvousState, now: float, deadline: float) -> float:
        timeout = self.settings.dead_after
        if state.deadline is not None and self.node in state.participants:
            timeout = min(timeout, state.deadline - now)
        if self.node not in state.redundancy_list:
            timeout = min(timeout, deadline - now + 0.01)
        elif state.held_until is not None and state.held_until > now:
            timeout = min(timeout, state.held_until - now + 0.01)  # the seats it waits for
        return max(timeout, 0.001)
