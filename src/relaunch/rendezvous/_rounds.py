"""How a round moves: it fills, completes, and is opened again; pure functions that
change a state in place (:mod:`relaunch.rendezvous._ops` decides when).

A round opened again after a loss or a restart holds the seats of the last round's
nodes that are still alive for a last call of their own: a spare or a new node takes
only the other seats. Such a node holds its ranks' newest snapshots in its own memory
(and often the only copy of them, when its ring successor was the node lost); a spare
that took its seat 80 ms before it came back would start those ranks from what it can
fetch, or from nothing.
"""

from __future__ import annotations

from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState, node_sort_key

__all__ = [
    "add_participant",
    "after_removal",
    "can_complete",
    "complete",
    "fill_vacancy",
    "held_seats",
    "maybe_complete",
    "reopen",
]


def can_complete(state: RendezvousState, now: float, settings: RendezvousSettings) -> bool:
    """Whether the open round may complete now.

    With at least ``min_nodes``: at ``max_nodes``, when the last call expired, or
    when every node the round expects (after a loss or a restart) is back.
    """
    if state.complete or state.closed:
        return False
    count = len(state.participants)
    if count < settings.min_nodes:
        return False
    if count >= settings.max_nodes:
        return True
    if state.deadline is not None and now >= state.deadline:
        return True
    expected = state.expected
    if not expected or count < len(expected):  # (cheap first: a batch of joins is O(N))
        return False
    return all(n in state.participants for n in expected)


def held_seats(state: RendezvousState, now: float) -> int:
    """Seats of the open round held for the last round's nodes that are not back yet
    (until ``state.held_until``; a node found dead leaves ``expected``, and its seat
    with it). O(expected): callers ask only when the held seats could fill the round."""
    if state.held_until is None or now >= state.held_until or state.complete:
        return 0
    elsewhere = (state.participants, state.redundancy_list, state.wait_list)
    return sum(1 for n in state.expected if not any(n in where for where in elsewhere))


def reopen(state: RendezvousState, now: float, settings: RendezvousSettings) -> None:
    """Start the next round; it expects every node still known to be alive, and holds
    the seats of the last round's nodes for ``last_call_timeout``."""
    state.expected = set(state.participants) | state.wait_list | state.redundancy_list
    state.participants = {}
    state.inprocess = set()
    state.vacancies = {}
    state.incarnations = {}
    state.round += 1
    state.complete = False
    state.deadline = None
    state.held_until = now + settings.last_call_timeout


def complete(state: RendezvousState) -> None:
    """Mark the round complete; ranks in the nodes' sorted order, the store's host first."""
    state.complete = True
    state.deadline = None
    state.held_until = None
    state.expected = set()

    def order(node: str) -> tuple[bool, tuple[str, int, int]]:
        return node != state.store_host, node_sort_key(node)

    for rank, member in enumerate(sorted(state.participants, key=order)):
        state.participants[member] = rank


def maybe_complete(state: RendezvousState, now: float, settings: RendezvousSettings) -> None:
    if can_complete(state, now, settings):
        complete(state)


def after_removal(state: RendezvousState, settings: RendezvousSettings) -> None:
    if not state.complete and len(state.participants) < settings.min_nodes:
        state.deadline = None


def add_participant(
    state: RendezvousState, node: str, now: float, settings: RendezvousSettings
) -> None:
    """``node`` takes part in the open round; the last call starts at ``min_nodes``."""
    state.wait_list.discard(node)
    state.participants[node] = 0
    state.last_heartbeats[node] = now
    if len(state.participants) >= settings.min_nodes and state.deadline is None:
        state.deadline = now + settings.last_call_timeout


def fill_vacancy(state: RendezvousState, node: str, now: float) -> None:
    """``node`` takes the lowest vacant rank of the running round (and its incarnation)."""
    rank = min(state.vacancies)
    state.incarnations[rank] = state.vacancies.pop(rank)
    state.wait_list.discard(node)
    state.redundancy_list.discard(node)
    state.expected.discard(node)
    state.participants[node] = rank
    state.last_heartbeats[node] = now
