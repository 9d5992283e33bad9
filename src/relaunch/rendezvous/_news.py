"""Who must learn of a change of the shared state: pure functions over two states."""

from __future__ import annotations

from relaunch.rendezvous._state import RendezvousState

__all__ = ["needs_wake", "nodes_waiting", "round_ended"]


def needs_wake(old: RendezvousState, new: RendezvousState) -> bool:
    """Whether the change from ``old`` to ``new`` matters to nodes waiting for a change."""
    if (
        old.round,
        old.complete,
        old.closed,
        old.deadline,
        old.wait_list,
        old.redundancy_list,
        old.expected,
        old.restarts,
        old.vacancies,
    ) != (
        new.round,
        new.complete,
        new.closed,
        new.deadline,
        new.wait_list,
        new.redundancy_list,
        new.expected,
        new.restarts,
        new.vacancies,
    ):
        return True
    return any(n not in new.participants for n in old.participants)


def nodes_waiting(state: RendezvousState, my_round: int | None) -> int:
    """How many nodes wait for a new round, as the agent of a node in ``my_round`` sees it.

    More than zero also when a new round has started without this node (a loss
    or another node's restart): the agent must restart and call next_rendezvous.
    """
    if state.closed:
        return 0
    if round_ended(state, my_round):
        return max(1, len(state.participants) + len(state.wait_list))
    return len(state.wait_list)


def round_ended(state: RendezvousState, my_round: int | None) -> bool:
    """Whether ``my_round`` (this node's last round) is over without this node: a node
    left it to restart, a lost node reopened it, or a newer round began. Nodes waiting
    to join do not end it, nor does closing the rendezvous."""
    return my_round is not None and (state.round != my_round or not state.complete)
