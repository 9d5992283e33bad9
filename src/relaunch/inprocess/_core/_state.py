"""The restart state of one rank: :class:`State`, :class:`Mode`, :class:`FrozenState`
(NVIDIA's field names; :mod:`relaunch.inprocess.state` re-exports them).

The engine hands callbacks a :class:`FrozenState` (read-only); rank assignments get
and return a :class:`State`. The engine never mutates a state it shared: it builds
new ones with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Iterable
from typing import Any

from relaunch.errors import ConfigError

__all__ = ["FrozenState", "Mode", "State", "Status"]


class Mode(enum.Enum):
    """What a rank does in the current iteration."""

    INITIALIZED = enum.auto()
    """The state was built; rank assignment has not run yet."""
    ACTIVE = enum.auto()
    """The rank calls the wrapped function."""
    INACTIVE = enum.auto()
    """The rank is a spare: it waits and may be activated at a later iteration."""
    TERMINATED = enum.auto()
    """The rank left the job."""


Status = Mode
"""relaunch's earlier name of :class:`Mode`."""


@dataclasses.dataclass
class State:
    """The restart state of one rank (NVIDIA's field names and order)."""

    rank: int | None
    """Rank among the ranks still in the job (active and spare); None once terminated."""
    world_size: int
    """Number of ranks still in the job (active and spare)."""
    active_rank: int | None = None
    """Rank among the active ranks (what ``RANK`` is set to), None for a spare."""
    active_world_size: int | None = None
    """Number of active ranks (what ``WORLD_SIZE`` is set to)."""
    initial_rank: int = None  # type: ignore[assignment]  # None: set from rank
    """Rank at the first call (``RANK`` when the wrapper started); defaults to ``rank``."""
    initial_world_size: int = None  # type: ignore[assignment]  # None: set from world_size
    """World size at the first call; defaults to ``world_size``."""
    iteration: int = 0
    """Index of the restart iteration, 0 for the first call."""
    mode: Mode = Mode.INITIALIZED
    """Initialized, active, spare (inactive) or terminated."""
    fn_exception: BaseException | None = None
    """The exception the wrapped function raised in this iteration, if it raised."""

    def __post_init__(self) -> None:
        if self.initial_rank is None:
            self.initial_rank = self.rank if self.rank is not None else -1
        if self.initial_world_size is None:
            self.initial_world_size = self.world_size

    @property
    def status(self) -> Mode:
        """relaunch's earlier name of :attr:`mode`."""
        return self.mode

    @classmethod
    def from_env(cls, env: Any = None) -> State:
        """The initial state from ``RANK`` and ``WORLD_SIZE`` (default 0 and 1)."""
        env = os.environ if env is None else env
        try:
            rank = int(env.get("RANK", "0"))
            world_size = int(env.get("WORLD_SIZE", "1"))
        except ValueError as exc:
            raise ConfigError(f"RANK / WORLD_SIZE: expected integers ({exc})") from exc
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(
                f"RANK / WORLD_SIZE: expected 0 <= RANK < WORLD_SIZE, got {rank} / {world_size}"
            )
        return cls(
            rank=rank, world_size=world_size, initial_rank=rank, initial_world_size=world_size
        )

    def set_distributed_vars(self) -> None:
        """Set ``RANK`` and ``WORLD_SIZE`` for the wrapped function (its active rank)."""
        os.environ["RANK"] = str(self.active_rank)
        os.environ["WORLD_SIZE"] = str(self.active_world_size)

    def advance(self) -> None:
        """Move to the next iteration (in place, as NVIDIA's)."""
        self.iteration += 1
        self.fn_exception = None

    def freeze(self) -> FrozenState:
        """A read-only copy."""
        return FrozenState(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def copy_from(self, other: Any, fields: Iterable[str] | None = None) -> None:
        """Copy ``fields`` (default: all) from ``other``."""
        wanted = None if fields is None else set(fields)
        for field in dataclasses.fields(self):
            if wanted is None or field.name in wanted:
                setattr(self, field.name, getattr(other, field.name))

    # relaunch's helpers (return new states; shared states are never mutated) -------
    def activate_all_ranks(self) -> State:
        """Every rank still in the job becomes active."""
        if self.mode is Mode.TERMINATED:
            return self
        return dataclasses.replace(
            self, active_rank=self.rank, active_world_size=self.world_size, mode=Mode.ACTIVE
        )

    def next_iteration(self) -> State:
        """The same state at the next iteration."""
        return dataclasses.replace(self, iteration=self.iteration + 1, fn_exception=None)


@dataclasses.dataclass(frozen=True)
class FrozenState:
    """:class:`State` with every field read-only (what callbacks receive)."""

    rank: int | None
    world_size: int
    active_rank: int | None = None
    active_world_size: int | None = None
    initial_rank: int | None = None
    initial_world_size: int | None = None
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: BaseException | None = None

    @property
    def status(self) -> Mode:
        return self.mode
