"""Rank assignment: which rank each surviving rank takes at the next iteration.

A :class:`RankAssignment` is called with this rank's :class:`State` and the set of
*current* ranks that were terminated, and returns the new state and the terminated
ranks it did not handle (a non-empty remainder stops the job with RestartError).
Every rank calls it with the same arguments except its own state, so the result must
be a pure function of them.
"""

from __future__ import annotations

import abc
import dataclasses

from relaunch.inprocess.state import State, Status

__all__ = ["FillGaps", "RankAssignment", "ShiftRanks"]


class RankAssignment(abc.ABC):
    """Base class of rank assignments."""

    @abc.abstractmethod
    def __call__(self, state: State, terminated_ranks: set[int]) -> tuple[State, set[int]]:
        """Return this rank's new state and the terminated ranks left unhandled."""


def _terminate(state: State) -> State:
    return dataclasses.replace(
        state,
        rank=-1,
        active_rank=None,
        active_world_size=0,
        status=Status.TERMINATED,
    )


class ShiftRanks(RankAssignment):
    """Close the gaps: every rank above a terminated one moves down (order kept).

    Ranks ``0 1 2 3`` with ``1`` terminated become ``0 - 1 2``.
    """

    def __call__(self, state: State, terminated_ranks: set[int]) -> tuple[State, set[int]]:
        world_size = state.world_size - len({r for r in terminated_ranks if r < state.world_size})
        if state.rank in terminated_ranks or state.status is Status.TERMINATED:
            return _terminate(dataclasses.replace(state, world_size=world_size)), set()
        rank = state.rank - sum(1 for r in terminated_ranks if r < state.rank)
        return dataclasses.replace(state, rank=rank, world_size=world_size), set()

    def __repr__(self) -> str:
        return "ShiftRanks()"


class FillGaps(RankAssignment):
    """Fill each gap with one of the highest ranks; the others keep their rank.

    Ranks ``0 1 2 3`` with ``1`` terminated become ``0 3 2 -``: few ranks change.
    """

    def __call__(self, state: State, terminated_ranks: set[int]) -> tuple[State, set[int]]:
        dead = {r for r in terminated_ranks if 0 <= r < state.world_size}
        world_size = state.world_size - len(dead)
        if state.rank in dead or state.status is Status.TERMINATED:
            return _terminate(dataclasses.replace(state, world_size=world_size)), set()
        if state.rank < world_size:
            return dataclasses.replace(state, world_size=world_size), set()
        gaps = sorted(r for r in dead if r < world_size)
        movers = sorted(r for r in range(world_size, state.world_size) if r not in dead)
        rank = gaps[movers.index(state.rank)]
        return dataclasses.replace(state, rank=rank, world_size=world_size), set()

    def __repr__(self) -> str:
        return "FillGaps()"
