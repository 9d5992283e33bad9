"""Rank filters: which ranks call the wrapped function; the others wait as spares.

A filter gets this rank's :class:`State` after rank assignment (every rank active)
and returns it with ``status``, ``active_rank`` and ``active_world_size`` set.
"""

from __future__ import annotations

import abc
import dataclasses

from relaunch.errors import ConfigError
from relaunch.inprocess.state import State, Status

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "MaxActiveWorldSize",
    "RankFilter",
]


class RankFilter(abc.ABC):
    """Base class of rank filters."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Return the state with this rank active or inactive."""


def _with_active_world_size(state: State, active_world_size: int) -> State:
    if state.status is Status.TERMINATED:
        return state
    if state.rank < active_world_size:
        return dataclasses.replace(
            state,
            active_rank=state.rank,
            active_world_size=active_world_size,
            status=Status.ACTIVE,
        )
    return dataclasses.replace(
        state,
        active_rank=None,
        active_world_size=active_world_size,
        status=Status.INACTIVE,
    )


class ActivateAllRanks(RankFilter):
    """Every rank still in the job is active."""

    def __call__(self, state: State) -> State:
        return _with_active_world_size(state, state.world_size)


class MaxActiveWorldSize(RankFilter):
    """At most ``max_active_world_size`` ranks are active (the lowest); the rest are spares."""

    def __init__(self, max_active_world_size: int | None = None) -> None:
        if max_active_world_size is not None and (
            not isinstance(max_active_world_size, int) or max_active_world_size < 1
        ):
            raise ConfigError(
                f"max_active_world_size: expected a positive int or None, "
                f"got {max_active_world_size!r}"
            )
        self.max_active_world_size = max_active_world_size

    def __call__(self, state: State) -> State:
        size = state.active_world_size or state.world_size
        if self.max_active_world_size is not None:
            size = min(size, self.max_active_world_size)
        return _with_active_world_size(state, size)


class ActiveWorldSizeDivisibleBy(RankFilter):
    """The number of active ranks is the largest multiple of ``divisor`` that fits."""

    def __init__(self, divisor: int = 1) -> None:
        if not isinstance(divisor, int) or divisor < 1:
            raise ConfigError(f"divisor: expected a positive int, got {divisor!r}")
        self.divisor = divisor

    def __call__(self, state: State) -> State:
        size = state.active_world_size or state.world_size
        return _with_active_world_size(state, size // self.divisor * self.divisor)
