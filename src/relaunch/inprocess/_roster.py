"""Every rank's state for the next iteration: rank assignment and filter, pure.

Each rank computes every rank's next state from the same inputs (the roster, the
frozen terminated set, the frozen admitted set), so they agree without talking.
"""

from __future__ import annotations

from collections.abc import Mapping

from relaunch.inprocess._params import run_callbacks
from relaunch.inprocess.config import WrapperConfig
from relaunch.inprocess.exception import RestartAbort, RestartError
from relaunch.inprocess.state import State, Status

__all__ = ["assign", "initial_state", "readmit"]


def initial_state(rank: int, world_size: int, iteration: int = 0) -> State:
    """Rank ``rank``'s state in the initial layout."""
    return State(
        rank=rank,
        world_size=world_size,
        initial_rank=rank,
        initial_world_size=world_size,
        iteration=iteration,
    )


def assign(
    config: WrapperConfig, roster: Mapping[int, State], terminated: set[int], *, advance: bool
) -> dict[int, State]:
    """The next roster: ``terminated`` (initial ranks) leave, the assignment and the
    filter place the others. Raises RestartAbort when no rank is left active."""
    current = {roster[r].rank for r in terminated if r in roster}
    out: dict[int, State] = {}
    for initial, state in sorted(roster.items()):
        new, left = config.rank_assignment(state, current)
        if left:
            raise RestartError(f"rank assignment left terminated ranks {sorted(left)}")
        if new.status is Status.TERMINATED:
            continue
        new = run_callbacks(config.rank_filter, new.activate_all_ranks())
        out[initial] = new.advance() if advance else new
    if not any(s.status is Status.ACTIVE for s in out.values()):
        raise RestartAbort(f"no active rank left (terminated: {sorted(terminated)})")
    return out


def readmit(
    config: WrapperConfig,
    roster: Mapping[int, State],
    terminated: set[int],
    admitted: set[int],
    iteration: int,
) -> dict[int, State]:
    """The next roster when replacements are admitted: the assignment is recomputed
    from the initial layout, as if only the ranks that are gone had been terminated."""
    any_state = next(iter(roster.values()))
    size = any_state.initial_world_size
    staying = (set(roster) - terminated) | admitted
    layout = {r: initial_state(r, size, iteration) for r in range(size)}
    gone = set(range(size)) - staying
    return assign(config, layout, gone, advance=True)
