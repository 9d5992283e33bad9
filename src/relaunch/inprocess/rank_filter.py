"""Rank filters (deprecated by NVIDIA in favour of ``rank_assignment``; kept so code
that passes ``rank_filter=`` still runs): which ranks call the wrapped function.

A filter gets this rank's :class:`State` after rank assignment and returns it with
``mode``, ``active_rank`` and ``active_world_size`` set. The classes here apply the
same rules as their namesakes in :mod:`relaunch.inprocess.rank_assignment`.
"""

from __future__ import annotations

import abc

from relaunch.errors import ConfigError
from relaunch.inprocess import rank_assignment as ra
from relaunch.inprocess.state import State

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "MaxActiveWorldSize",
    "RankFilter",
    "WorldSizeDivisibleBy",
]


class RankFilter(abc.ABC):
    """Base class of rank filters."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Return the state with this rank active or inactive."""


def _apply(assignment: ra.RankAssignment, state: State) -> State:
    return assignment(ra.RankAssignmentCtx(state, None, set())).state


class ActivateAllRanks(RankFilter):
    """Every rank still in the job is active."""

    def __call__(self, state: State) -> State:
        return _apply(ra.ActivateAllRanks(), state)


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
        return _apply(ra.MaxActiveWorldSize(self.max_active_world_size), state)


class ActiveWorldSizeDivisibleBy(RankFilter):
    """The number of active ranks is the largest multiple of ``divisor`` that fits."""

    def __init__(self, divisor: int = 1) -> None:
        if not isinstance(divisor, int) or divisor < 1:
            raise ConfigError(f"divisor: expected a positive int, got {divisor!r}")
        self.divisor = divisor

    def __call__(self, state: State) -> State:
        return _apply(ra.ActiveWorldSizeDivisibleBy(self.divisor), state)


WorldSizeDivisibleBy = ActiveWorldSizeDivisibleBy
"""The older name of :class:`ActiveWorldSizeDivisibleBy`."""
