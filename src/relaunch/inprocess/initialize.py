"""Initialize: runs at the start of every iteration (NVIDIA's ``inprocess.initialize``).

It gets the read-only :class:`~relaunch.inprocess.state.FrozenState`. Raising an
:class:`Exception` restarts the iteration (as a fault of this rank); raising a
:class:`BaseException` such as :class:`~relaunch.inprocess.exception.RestartAbort`
ends the wrapper.
"""

from __future__ import annotations

import abc
from typing import Any

from relaunch.inprocess.exception import RestartAbort

__all__ = ["Initialize", "RetryController"]


class Initialize(abc.ABC):
    """Base class of ``initialize`` callbacks."""

    @abc.abstractmethod
    def __call__(self, state: Any) -> Any:
        """Prepare this rank for the iteration; raise to interrupt it."""


class RetryController(Initialize):
    """Ends the wrapper (``RestartAbort``) at iteration ``max_iterations`` (None: no
    limit), or when fewer than ``min_world_size`` ranks (``min_active_world_size``
    active ranks) are left."""

    def __init__(
        self,
        max_iterations: int | None = None,
        min_world_size: int = 1,
        min_active_world_size: int = 1,
    ) -> None:
        self.max_iterations = max_iterations
        self.min_world_size = min_world_size
        self.min_active_world_size = min_active_world_size

    def __call__(self, state: Any) -> Any:
        active = state.active_world_size if state.active_world_size is not None else 0
        if (
            state.world_size < self.min_world_size
            or active < self.min_active_world_size
            or (self.max_iterations is not None and state.iteration >= self.max_iterations)
        ):
            raise RestartAbort(
                f"iteration={state.iteration} max_iterations={self.max_iterations} "
                f"world_size={state.world_size} min_world_size={self.min_world_size} "
                f"active_world_size={active} min_active_world_size={self.min_active_world_size}"
            )
        return state
