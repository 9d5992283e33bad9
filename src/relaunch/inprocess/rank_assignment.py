"""Rank assignment: which rank each surviving rank takes at the next iteration, and
which ranks are active (NVIDIA's ``inprocess.rank_assignment``, same classes and
semantics).

A :class:`RankAssignment` is called with a :class:`RankAssignmentCtx` (this rank's
:class:`~relaunch.inprocess.state.State`, the store, the set of *current* ranks that
were terminated) and returns it with the new state; a rank that has no place raises
:class:`RankDiscarded`. Assignments compose with :class:`~relaunch.inprocess.Compose`
(the last one runs first): the default is ``Compose(ActivateAllRanks(), ShiftRanks())``.
The pure ones (relaunch's own but :class:`Tree` and :class:`FilterCountGroupedByKey`,
which exchange data through the store) give every rank the same answer from the same
inputs; every rank computes them for every rank. An assignment of your own is called
as NVIDIA's wrapper calls it: by each rank for itself, with the store.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterator
from typing import Any

from relaunch.inprocess._core._assign_base import (
    Layer,
    LayerFlag,
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
    RankFilter,
)
from relaunch.inprocess._core._tree import Tree
from relaunch.inprocess.state import Mode, State

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "FilterCountGroupedByKey",
    "Layer",
    "LayerFlag",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
    "ShiftRanks",
    "Tree",
]


def _active_size(state: State) -> int:
    if state.active_world_size is None:
        return state.world_size
    return min(state.active_world_size, state.world_size)


def _with_active_size(ctx: RankAssignmentCtx, size: int) -> RankAssignmentCtx:
    state = ctx.state
    active = state.rank is not None and state.rank < size
    ctx.state = dataclasses.replace(
        state,
        mode=Mode.ACTIVE if active else Mode.INACTIVE,
        active_rank=state.rank if active else None,
        active_world_size=size,
    )
    return ctx


class ActivateAllRanks(RankFilter):
    """Every rank still in the job calls the wrapped function."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        s = ctx.state
        ctx.state = dataclasses.replace(
            s, mode=Mode.ACTIVE, active_rank=s.rank, active_world_size=s.world_size
        )
        return ctx


class MaxActiveWorldSize(RankFilter):
    """At most ``max_active_world_size`` ranks are active (the lowest); the rest wait."""

    def __init__(self, max_active_world_size: int | None = None) -> None:
        self.max_active_world_size = max_active_world_size

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = _active_size(ctx.state)
        if self.max_active_world_size is not None:
            size = min(size, self.max_active_world_size)
        return _with_active_size(ctx, size)


class ActiveWorldSizeDivisibleBy(RankFilter):
    """The number of active ranks is the largest multiple of ``divisor`` that fits."""

    def __init__(self, divisor: int = 1) -> None:
        self.divisor = divisor

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        return _with_active_size(ctx, _active_size(ctx.state) // self.divisor * self.divisor)


class ShiftRanks(RankAssignment):
    """Close the gaps: every rank above a terminated one moves down (order kept).

    Ranks ``0 1 2 3`` with ``1`` terminated become ``0 - 1 2``.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state, dead = ctx.state, ctx.terminated_ranks
        if state.rank in dead:
            raise RankDiscarded(f"rank={state.rank} terminated_ranks={sorted(dead)}")
        assert state.rank is not None
        rank = state.rank - sum(1 for r in dead if r < state.rank)
        ctx.state = dataclasses.replace(state, rank=rank, world_size=state.world_size - len(dead))
        ctx.terminated_ranks = set()
        return ctx


class FillGaps(RankAssignment):
    """Fill each gap with one of the highest ranks; the others keep their rank.

    Ranks ``0 1 2 3`` with ``1`` terminated become ``0 3 2 -``: few ranks change.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state, dead = ctx.state, ctx.terminated_ranks
        if state.rank in dead:
            raise RankDiscarded(f"rank={state.rank} terminated_ranks={sorted(dead)}")
        assert state.rank is not None
        world_size = state.world_size - len(dead)
        rank = state.rank
        if rank >= world_size:  # a mover: the n-th live rank above takes the n-th gap below
            gaps = sorted(r for r in dead if r < world_size)
            movers = [r for r in range(world_size, state.world_size) if r not in dead]
            rank = gaps[movers.index(rank)]
        ctx.state = dataclasses.replace(state, rank=rank, world_size=world_size)
        ctx.terminated_ranks = set()
        return ctx


class FilterCountGroupedByKey(RankAssignment):
    """Group the surviving ranks by a key; a rank whose group's count fails
    ``condition`` is added to the terminated ranks (a following assignment, e.g.
    ShiftRanks, discards it). Exchanges the counts through the store: every
    surviving rank must call it."""

    instance_count = 0

    def __init__(
        self,
        key_or_fn: str | Callable[[State], Any],
        condition: Callable[[int], bool],
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
    ) -> None:
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout
        self.name = f"{type(self).__name__}_{type(self).instance_count}"
        type(self).instance_count += 1

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state, store, dead = ctx.state, ctx.store, ctx.terminated_ranks
        if state.rank in dead:
            return ctx
        alive = state.world_size - len(dead)
        key = self.key_or_fn(state) if callable(self.key_or_fn) else self.key_or_fn
        counter = f"filter_grouped_by_key_{self.name}_{key}"
        doomed = f"ranks_to_terminate_{self.name}"
        store.add(counter, 1)
        store.barrier([state.rank], f"count_alive_barrier_{self.name}", alive, self.timeout)
        if not self.condition(int(store.get(counter))):
            store.append(doomed, f"{state.rank},")
        store.barrier([state.rank], f"submit_mismatching_barrier_{self.name}", alive, self.timeout)
        extra: set[int] = set()
        if store.check([doomed]):
            extra = {int(r) for r in store.get(doomed).decode().rstrip(",").split(",") if r}
        ctx.terminated_ranks = set(dead) | extra
        return ctx


def _iter_instances(assignment: Any) -> Iterator[Any]:
    """``assignment`` and, for a Compose, every instance inside it."""
    yield assignment
    for inner in getattr(assignment, "instances", ()):
        yield from _iter_instances(inner)


def uses_store(assignment: Any) -> bool:
    """Whether each rank calls the assignment for itself, with the store: ``Tree`` and
    ``FilterCountGroupedByKey`` exchange data through it, and one of the user's may
    (or may decide from this process's own facts, as under NVIDIA's wrapper); only
    relaunch's pure ones are computed by every rank for every rank (they had the
    store as None, and one of the user's every rank's answer from one process)."""
    return any(
        not hasattr(a, "instances") and type(a) not in _PURE for a in _iter_instances(assignment)
    )


_PURE = (ActivateAllRanks, MaxActiveWorldSize, ActiveWorldSizeDivisibleBy, ShiftRanks, FillGaps)
"""relaunch's assignments that decide from the ranks' states alone (exact types: a
subclass of the user's may do more)."""
