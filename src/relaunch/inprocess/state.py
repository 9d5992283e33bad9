"""The restart state of one rank: its ranks, world sizes, status and iteration."""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping

from relaunch.errors import ConfigError

__all__ = ["State", "Status"]


class Status(enum.Enum):
    """What a rank does in the current iteration."""

    ACTIVE = "active"
    """The rank calls the wrapped function."""
    INACTIVE = "inactive"
    """The rank is a spare: it waits and may be activated at a later iteration."""
    TERMINATED = "terminated"
    """The rank left the job."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class State:
    """The restart state of one rank. Immutable: use :func:`dataclasses.replace`."""

    rank: int
    """Rank among the ranks still in the job (active and spare); -1 once terminated."""
    world_size: int
    """Number of ranks still in the job (active and spare)."""
    initial_rank: int
    """Rank at the first call (``RANK`` when the wrapper started); never changes."""
    initial_world_size: int
    """World size at the first call."""
    active_rank: int | None = None
    """Rank among the active ranks (what ``RANK`` is set to), None for a spare."""
    active_world_size: int = 0
    """Number of active ranks (what ``WORLD_SIZE`` is set to)."""
    iteration: int = 0
    """Index of the restart iteration, 0 for the first call."""
    status: Status = Status.ACTIVE
    """Active, spare (inactive) or terminated."""

    def __post_init__(self) -> None:
        if self.initial_world_size < 1:
            raise ConfigError(f"initial_world_size: expected >= 1, got {self.initial_world_size}")
        if not 0 <= self.initial_rank < self.initial_world_size:
            raise ConfigError(
                f"initial_rank: expected 0 <= initial_rank < {self.initial_world_size}, "
                f"got {self.initial_rank}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> State:
        """Build the initial state from ``RANK`` and ``WORLD_SIZE`` (default 0 and 1)."""
        env = os.environ if env is None else env
        try:
            rank = int(env.get("RANK", "0"))
            world_size = int(env.get("WORLD_SIZE", "1"))
        except ValueError as exc:
            raise ConfigError(f"RANK / WORLD_SIZE: expected integers ({exc})") from exc
        return cls(
            rank=rank,
            world_size=world_size,
            initial_rank=rank,
            initial_world_size=world_size,
            active_rank=rank,
            active_world_size=world_size,
        )

    def activate_all_ranks(self) -> State:
        """Every rank still in the job becomes active."""
        if self.status is Status.TERMINATED:
            return self
        return dataclasses.replace(
            self,
            active_rank=self.rank,
            active_world_size=self.world_size,
            status=Status.ACTIVE,
        )

    def advance(self) -> State:
        """The same state at the next iteration."""
        return dataclasses.replace(self, iteration=self.iteration + 1)

    def set_distributed_vars(self) -> None:
        """Set ``RANK`` and ``WORLD_SIZE`` for the wrapped function (active ranks only)."""
        if self.status is Status.ACTIVE and self.active_rank is not None:
            os.environ["RANK"] = str(self.active_rank)
            os.environ["WORLD_SIZE"] = str(self.active_world_size)
