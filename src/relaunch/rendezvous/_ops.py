"""The rendezvous state machine: pure functions over (state, node, now, settings).

Each ``decide_*`` returns the next :class:`Action` of one operation (join, exit,
leave, close, keep-alive); :func:`apply` performs a write action on a state's copy
(the round's moves themselves are in :mod:`relaunch.rendezvous._rounds`). Nothing here
reads a clock or touches a store: ``now`` is the wall-clock time in seconds, deadlines
are on the same clock (tests inject any).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable

from relaunch.rendezvous._news import needs_wake, nodes_waiting
from relaunch.rendezvous._rounds import (
    add_participant,
    after_removal,
    can_complete,
    complete,
    fill_vacancy,
    held_seats,
    maybe_complete,
    reopen,
)
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState

__all__ = [
    "JOIN_REQUEST_ACTIONS",
    "ROLLBACK_WINDOW",
    "Action",
    "apply",
    "can_complete",
    "decide_close",
    "decide_depart",
    "decide_exit",
    "decide_join",
    "decide_leave",
    "incarnation_base",
    "needs_wake",
    "nodes_waiting",
    "perform_requests",
    "place",
    "record_failure",
    "remove_dead",
    "remove_lost",
    "went_on",
]

ROLLBACK_WINDOW = 5.0
"""Seconds after its join deadline during which a node still removes itself."""


class Action(enum.Enum):
    """What a node does next."""

    ADD_TO_PARTICIPANTS = "add_to_participants"
    ADD_TO_WAIT_LIST = "add_to_wait_list"
    ADD_TO_REDUNDANCY_LIST = "add_to_redundancy_list"
    REMOVE_FROM_PARTICIPANTS = "remove_from_participants"
    REMOVE_FROM_WAIT_LIST = "remove_from_wait_list"
    REMOVE_FROM_REDUNDANCY_LIST = "remove_from_redundancy_list"
    FILL_VACANCY = "fill_vacancy"
    MARK_INPROCESS = "mark_inprocess"
    CLAIM_STORE_HOST = "claim_store_host"
    LEAVE = "leave"
    DEPART = "depart"
    MARK_COMPLETE = "mark_complete"
    MARK_CLOSED = "mark_closed"
    SYNC = "sync"
    ERROR_CLOSED = "error_closed"
    ERROR_TIMEOUT = "error_timeout"
    EXIT_GRACEFULLY = "exit_gracefully"
    FINISH = "finish"


JOIN_REQUEST_ACTIONS = frozenset({
    Action.ADD_TO_PARTICIPANTS, Action.ADD_TO_WAIT_LIST, Action.ADD_TO_REDUNDANCY_LIST,
    Action.REMOVE_FROM_REDUNDANCY_LIST, Action.FILL_VACANCY,
})  # fmt: skip
"""Placements of a joining node; they go through the request queue, applied in batches."""


def decide_join(
    state: RendezvousState, node: str, now: float, settings: RendezvousSettings, deadline: float
) -> Action:
    """Next step of ``node`` joining the next complete round; ``deadline`` is its join deadline.

    Heartbeats are not this operation's business: the keep-alive thread writes them
    (:mod:`relaunch.rendezvous._liveness`) for as long as the handler lives.
    """
    if state.closed:
        if node in state.redundancy_list:
            return Action.EXIT_GRACEFULLY
        return Action.ERROR_CLOSED
    if state.complete and state.vacancies and node not in state.participants:
        # A lost node's place in the running round: a spare, a waiting or a new node
        # takes it, and the round's other nodes go on (tiered recovery).
        return Action.FILL_VACANCY
    if node in state.redundancy_list:
        # A spare does not time out: it waits for a free seat (a lost participant's,
        # not one held for a node of the last round until it is back or late).
        if not _room(state, now, settings):
            return Action.SYNC
        return Action.REMOVE_FROM_REDUNDANCY_LIST
    is_participant = node in state.participants
    if state.complete and is_participant:
        return Action.FINISH
    if now > deadline:
        if now <= deadline + ROLLBACK_WINDOW and (is_participant or node in state.wait_list):
            return Action.LEAVE
        return Action.ERROR_TIMEOUT
    if state.complete:
        if len(state.participants) < settings.max_nodes:
            if node not in state.wait_list:
                return Action.ADD_TO_WAIT_LIST
        elif node not in state.wait_list:
            return Action.ADD_TO_REDUNDANCY_LIST
    elif is_participant:
        if can_complete(state, now, settings):
            return Action.MARK_COMPLETE
    elif node in state.expected or _room(state, now, settings):
        return Action.ADD_TO_PARTICIPANTS
    else:
        return Action.ADD_TO_REDUNDANCY_LIST  # the free seats are held for others
    return Action.SYNC


def _room(state: RendezvousState, now: float, settings: RendezvousSettings) -> bool:
    """Whether a spare or a new node may take a seat: the round has one that is
    neither taken nor held for a node of the last round."""
    taken = len(state.participants)
    if state.complete or taken + len(state.expected) < settings.max_nodes:
        return taken < settings.max_nodes  # (held seats are a subset of ``expected``)
    return taken + held_seats(state, now) < settings.max_nodes


def decide_exit(state: RendezvousState, node: str, now: float, deadline: float) -> Action:
    """Leave the current round's participants before joining the next one."""
    if node in state.participants:
        return Action.ERROR_TIMEOUT if now > deadline else Action.REMOVE_FROM_PARTICIPANTS
    return Action.FINISH


def decide_leave(state: RendezvousState, node: str, now: float, deadline: float) -> Action:
    """Leave the rendezvous for good (shutdown): drop every trace of ``node``."""
    if state.knows(node) or node in state.expected:
        return Action.ERROR_TIMEOUT if now > deadline else Action.LEAVE
    return Action.FINISH


def decide_depart(state: RendezvousState, node: str, now: float, deadline: float) -> Action:
    """Stop for good while this node's round runs (a signal: a scale-down, a drained
    machine): leave the round as a lost node does, before its workers stop; a round
    not complete (one that another departure reopened) is left as a leave does."""
    if state.closed:
        return Action.FINISH  # the job is over: nobody goes on from the round
    if state.complete and node in state.participants:
        return Action.ERROR_TIMEOUT if now > deadline else Action.DEPART
    return decide_leave(state, node, now, deadline)


def decide_close(state: RendezvousState, now: float, deadline: float) -> Action:
    """Close the rendezvous for good."""
    if state.closed:
        return Action.FINISH
    return Action.ERROR_TIMEOUT if now > deadline else Action.MARK_CLOSED


def apply(
    action: Action,
    state: RendezvousState,
    node: str,
    now: float,
    settings: RendezvousSettings,
) -> RendezvousState:
    """Return a copy of ``state`` with the write ``action`` of ``node`` performed."""
    new = state.copy()
    _perform(action, new, node, now, settings)
    return new


def _perform(
    action: Action, new: RendezvousState, node: str, now: float, settings: RendezvousSettings
) -> None:
    """Perform the write ``action`` of ``node`` on ``new`` itself."""
    if action is Action.ADD_TO_PARTICIPANTS:
        add_participant(new, node, now, settings)
    elif action is Action.ADD_TO_WAIT_LIST:
        new.redundancy_list.discard(node)
        new.wait_list.add(node)
        new.last_heartbeats[node] = now
    elif action is Action.ADD_TO_REDUNDANCY_LIST:
        new.redundancy_list.add(node)
        new.last_heartbeats[node] = now
    elif action is Action.REMOVE_FROM_PARTICIPANTS:
        # The node rejoins at once: a complete round is reopened and expects it back.
        if new.complete:
            reopen(new, now, settings)
        else:
            new.participants.pop(node, None)
            after_removal(new, settings)
    elif action is Action.REMOVE_FROM_WAIT_LIST:
        new.wait_list.discard(node)
        new.expected.discard(node)
        new.last_heartbeats.pop(node, None)
    elif action is Action.REMOVE_FROM_REDUNDANCY_LIST:
        new.redundancy_list.discard(node)
    elif action is Action.FILL_VACANCY:
        if new.complete and new.vacancies and node not in new.participants:
            fill_vacancy(new, node, now)
    elif action is Action.CLAIM_STORE_HOST:
        new.store_host = node
    elif action is Action.MARK_INPROCESS:
        if node in new.participants:
            new.inprocess.add(node)
    elif action is Action.LEAVE:
        _forget(new, [node], settings, dead=False, now=now)
    elif action is Action.DEPART:  # as if lost: its workers stop next
        _forget(new, [node], settings, dead=True, now=now)
    elif action is Action.MARK_COMPLETE:
        if not new.complete and new.participants:
            complete(new)
    elif action is Action.MARK_CLOSED:
        new.closed = True
    else:
        raise ValueError(f"{action} is not a write action")
    maybe_complete(new, now, settings)


def incarnation_base(now: float) -> int:
    """The incarnation a vacancy's workers start at: microseconds of the loss, above
    every earlier incarnation of its ranks (those are earlier bases plus a few
    replacements)."""
    return int(now * 1_000_000)


def _keeps_round(state: RendezvousState, lost: dict[str, int]) -> bool:
    """Whether a complete round goes on without its ``lost`` participants: every node
    of it restarts in-process, someone is left, and the rank-0 node (which hosts the
    workers' store) is not among the lost."""
    return (
        state.complete
        and bool(state.participants)
        and set(lost) <= state.inprocess
        and set(state.participants) <= state.inprocess
        and 0 not in lost.values()
    )


def _forget(
    state: RendezvousState, nodes: list[str], settings: RendezvousSettings, *, dead: bool,
    now: float,
) -> None:  # fmt: skip
    """Remove ``nodes`` everywhere.

    A complete round that lost a participant to death is reopened at once, so the
    survivors restart, unless its nodes' workers restart in-process: then the lost
    node's rank is left vacant for a spare or a new node, and no survivor restarts.
    One that a participant left (shutdown, e.g. after success) stays complete for the
    others until the last one leaves.
    """
    lost: dict[str, int] = {}
    for node in nodes:
        rank = state.participants.pop(node, None)
        if rank is not None:
            lost[node] = rank
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
        state.expected.discard(node)
        state.last_heartbeats.pop(node, None)
        if state.store_host == node:
            state.store_host = None
    if lost:
        if dead and _keeps_round(state, lost):
            base = max([incarnation_base(now), *state.vacancies.values(),
                        *state.incarnations.values()]) + 1_000  # fmt: skip
            for rank in sorted(lost.values()):
                state.vacancies[rank] = base
            state.inprocess -= set(lost)
        elif state.complete and (dead or not state.participants):
            reopen(state, now, settings)
        elif not state.complete:
            after_removal(state, settings)


def remove_dead(
    state: RendezvousState,
    now: float,
    settings: RendezvousSettings,
    alive: Collection[str] | None = None,
) -> tuple[RendezvousState, list[str]]:
    """Drop dead nodes: with ``alive`` (the store's own liveness, e.g. etcd leases),
    every node not in it; else each node whose heartbeat is older than
    ``settings.dead_after``.

    Returns the (possibly unchanged, then identical) state and the dead nodes.
    """
    if alive is not None:
        dead = sorted(n for n in state.last_heartbeats if n not in alive)
    else:
        limit = now - settings.dead_after
        dead = sorted(n for n, last in state.last_heartbeats.items() if last < limit)
    return _drop_dead(state, dead, now, settings)


def remove_lost(
    state: RendezvousState, nodes: Collection[str], now: float, settings: RendezvousSettings
) -> tuple[RendezvousState, list[str]]:
    """Drop ``nodes`` as dead now (their processes are known gone: a lifeline closed)."""
    known = set(state.last_heartbeats) | set(state.participants)
    return _drop_dead(state, sorted(n for n in nodes if n in known), now, settings)


def _drop_dead(state: RendezvousState, dead: list[str], now: float,
               settings: RendezvousSettings) -> tuple[RendezvousState, list[str]]:  # fmt: skip
    if not dead:
        return state, dead
    new = state.copy()
    _forget(new, dead, settings, dead=True, now=now)
    maybe_complete(new, now, settings)
    return new, dead


def place(
    state: RendezvousState, node: str, now: float, settings: RendezvousSettings
) -> RendezvousState:
    """Perform the join request of ``node``: its placement actions, without a deadline."""
    new = state.copy()
    perform_requests(new, [(node, False, False)], now, settings)
    return new


def perform_requests(
    state: RendezvousState, requests: Iterable[tuple[str, bool, bool]], now: float,
    settings: RendezvousSettings,
) -> None:  # fmt: skip
    """Perform join ``(node, False, False)``, leave ``(node, True, False)`` and departure
    ``(node, True, True)`` requests in order on ``state`` itself (one copy for a batch,
    not one per request: a batch of N is O(N))."""
    for node, leaving, departing in requests:
        if leaving:
            decide = decide_depart if departing else decide_leave
            action = decide(state, node, now, math.inf)
            if action in (Action.DEPART, Action.LEAVE):
                _perform(action, state, node, now, settings)
            continue
        for _ in range(3):
            action = decide_join(state, node, now, settings, math.inf)
            if action not in JOIN_REQUEST_ACTIONS:
                break
            _perform(action, state, node, now, settings)


def went_on(state: RendezvousState, failed_round: int, node: str) -> bool:
    """Whether the job went on from ``failed_round`` before ``node`` reported its
    workers' failure there: another node began the next round (a node joined, left or
    was lost, and the round's workers were stopped for it: a worker of ``node`` then
    fails on its peers' closed connections), or the job dropped ``node`` (the state no
    longer knows it: silent past the dead-node delay, a stalled machine). Such a failure
    follows from the change and is not counted (a failure counted for the round by
    another node is this one too: :func:`record_failure`); the workers restart in the
    next round anyway, and a rank that fails again there is counted then."""
    return failed_round < state.round or not (state.knows(node) or node in state.expected)


def record_failure(state: RendezvousState, failed_round: int) -> RendezvousState:
    """Count a failure restart for ``failed_round``, once however many nodes report it."""
    if failed_round <= state.failed_round:
        return state
    new = state.copy()
    new.failed_round = failed_round
    new.restarts += 1
    return new
