"""The base of rank assignments (see :mod:`relaunch.inprocess.rank_assignment`)."""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from relaunch.inprocess._core._exceptions import RestartError
from relaunch.inprocess._core._state import State

__all__ = [
    "Layer",
    "LayerFlag",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
]


class RankDiscarded(RestartError):
    """This rank has no place in the next iteration (it leaves the job)."""


@dataclasses.dataclass
class RankAssignmentCtx:
    """Input and output of a rank assignment."""

    state: State
    store: Any
    terminated_ranks: set[int]


class RankAssignment(abc.ABC):
    """Base class of rank assignments."""

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        """Return ``ctx`` with this rank's new state (raise RankDiscarded to leave)."""


class RankFilter(RankAssignment):
    """A rank assignment that only chooses the active ranks (ranks are unchanged)."""


class LayerFlag(enum.Flag):
    """How a :class:`Tree` layer may be searched for a replacement."""

    RESERVE = enum.auto()
    """Inactive (reserve) ranks in this subtree may replace a terminated active rank."""
    BACKFILL = enum.auto()
    """The highest active ranks in this subtree may move into a terminated one's place."""


@dataclasses.dataclass
class Layer:
    """One level of a :class:`Tree` topology."""

    min_ranks: int = 1
    """Fewer healthy ranks than this in a subtree terminate the whole subtree."""
    max_ranks: int | None = None
    """At most this many active ranks in a subtree (None: no limit)."""
    key_or_fn: str | Callable[[State], Any] = ""
    """The grouping key, or a function of the rank's state that returns it."""
    flag: LayerFlag | None = None
