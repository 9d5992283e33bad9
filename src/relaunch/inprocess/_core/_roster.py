"""Every rank's state for the next iteration: rank assignment and filter, pure.

Each rank computes every rank's next state from the same inputs (the roster, the
frozen terminated set, the frozen admitted set), so they agree without talking.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from relaunch.inprocess._core._assign_base import RankAssignment, RankAssignmentCtx, RankDiscarded
from relaunch.inprocess._core._config import CallConfig
from relaunch.inprocess._core._exceptions import BarrierTimeoutError, RestartAbort, RestartError
from relaunch.inprocess._core._state import Mode, State

__all__ = ["assign", "assign_exchanged", "initial_state", "readmit"]


def initial_state(rank: int, world_size: int, iteration: int = 0) -> State:
    """Rank ``rank``'s state in the initial layout."""
    return State(rank=rank, world_size=world_size, iteration=iteration)  # initial_*: the same


def assign(
    config: CallConfig, roster: Mapping[int, State], terminated: set[int], *, advance: bool
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
    config: CallConfig,
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


def assign_exchanged(
    config: CallConfig,
    roster: Mapping[int, State],
    terminated: set[int],
    *,
    advance: bool,
    me: int,
    coord: Any,
    tag: str,
    timeout: float,
) -> dict[int, State]:
    """The next roster for a rank assignment that exchanges data through the store
    (``Tree``, ``FilterCountGroupedByKey``), as NVIDIA's wrapper runs it: every
    surviving rank calls it for itself only (with the store), then the ranks publish
    their new states and read each other's. ``tag`` names this assignment's keys."""
    from relaunch.inprocess._core._exchange import decode_state, encode_state, mixin_view

    current = {rank for r in terminated if r in roster and (rank := roster[r].rank) is not None}
    view = mixin_view(coord.key("ra", tag) + "/", coord.store)
    ctx = RankAssignmentCtx(dataclasses.replace(roster[me]), view, set(current))
    try:
        ctx = config.rank_assignment(ctx)
        mine: State | None = ctx.state
    except RankDiscarded:
        mine = None
    if mine is not None and ctx.terminated_ranks:
        raise RestartError(
            f"the rank assignment left terminated ranks {sorted(ctx.terminated_ranks)}"
        )
    view.set(f"result_{me}", b"-" if mine is None else encode_state(mine))
    members = sorted(set(roster) - terminated)
    keys = [f"result_{r}" for r in members]
    try:
        view.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:
        raise BarrierTimeoutError(
            f"rank assignment {tag}: not every rank of {members} published its state "
            f"within {timeout:g} s"
        ) from exc
    out: dict[int, State] = {}
    for rank, raw in zip(members, view.multi_get(keys), strict=True):
        if raw == b"-":
            continue
        state = decode_state(raw, f"result_{rank}")
        if state.mode is Mode.INITIALIZED:
            state = state.activate_all_ranks()
        if state.mode is not Mode.TERMINATED:
            out[rank] = state.next_iteration() if advance else state
    if not any(s.mode is Mode.ACTIVE for s in out.values()):
        raise RestartAbort(f"no active rank left (terminated: {sorted(terminated)})")
    return out
