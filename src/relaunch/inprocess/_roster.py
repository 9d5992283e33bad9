"""Every rank's state for the next iteration: rank assignment and filter, pure.

Each rank computes every rank's next state from the same inputs (the roster, the
frozen terminated set, the frozen admitted set), so they agree without talking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from relaunch.inprocess.config import WrapperConfig
from relaunch.inprocess.exception import RestartAbort, RestartError
from relaunch.inprocess.rank_assignment import RankAssignment, RankAssignmentCtx, RankDiscarded
from relaunch.inprocess.state import Mode, State

__all__ = ["assign", "initial_state", "readmit"]


def initial_state(rank: int, world_size: int, iteration: int = 0) -> State:
    """Rank ``rank``'s state in the initial layout."""
    return State(
        rank=rank,
        world_size=world_size,
        active_rank=None,
        active_world_size=None,
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
    current.discard(None)
    out: dict[int, State] = {}
    for initial, state in sorted(roster.items()):
        ctx = RankAssignmentCtx(dataclasses.replace(state), None, set(current))  # type: ignore[arg-type]
        try:
            ctx = config.rank_assignment(ctx)
        except RankDiscarded:
            continue
        if ctx.terminated_ranks:
            raise RestartError(
                f"the rank assignment left terminated ranks {sorted(ctx.terminated_ranks)} "
                "unhandled (end it with ShiftRanks or FillGaps)"
            )
        new = ctx.state
        if new.mode is Mode.INITIALIZED:  # an assignment that activates no rank: all are
            new = new.activate_all_ranks()
        for rank_filter in _filters(config.rank_filter):
            if isinstance(rank_filter, RankAssignment):  # a rank_assignment filter given here
                new = rank_filter(RankAssignmentCtx(new, None, set())).state
            else:
                new = rank_filter(new)
        if new.mode is Mode.TERMINATED:
            continue
        out[initial] = new.next_iteration() if advance else new
    if not any(s.mode is Mode.ACTIVE for s in out.values()):
        raise RestartAbort(f"no active rank left (terminated: {sorted(terminated)})")
    return out


def _filters(rank_filter: object) -> list:  # type: ignore[type-arg]
    if rank_filter is None:
        return []
    return list(rank_filter) if isinstance(rank_filter, list | tuple) else [rank_filter]


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
