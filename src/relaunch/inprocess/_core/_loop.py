"""The restart loop of one call on this rank: the first roster (after the initial
barrier, or a replacement's admission), then iterations until every active rank has
returned; after each interrupted one, the restart procedure and the next roster
(the rank assignment, or the replacements readmitted).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from relaunch.inprocess._core import _rejoin
from relaunch.inprocess._core._call import POLL, RankCall
from relaunch.inprocess._core._env import announce_to_agent
from relaunch.inprocess._core._exceptions import RestartAbort
from relaunch.inprocess._core._iteration import run_iteration
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess._core._records import Interruption
from relaunch.inprocess._core._restart import restart
from relaunch.inprocess._core._roster import assign, assign_exchanged, initial_state, readmit
from relaunch.inprocess._core._state import Mode, State

__all__ = ["run"]

log = get_logger(__name__)


def run(
    call: RankCall, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Call ``fn(*args, **kwargs)``, restarting it on every interruption, until every
    active rank has returned; return its value (None on a spare, and for a
    replacement that came when the job had completed). A rank that leaves the job
    records it and raises."""
    me = call.state.initial_rank
    call.control.install()
    call.rdzv.install()
    announce_to_agent()
    try:
        return _iterations(call, fn, args, kwargs)
    except BaseException as exc:
        kind = (
            Interruption.TERMINATED if isinstance(exc, Exception) else Interruption.BASE_EXCEPTION
        )
        log.error("rank %s leaves the job: %r", me, exc)
        with contextlib.suppress(Exception):
            call.coord.record_dead(call.state.iteration, me, kind, repr(exc))
        raise
    finally:
        call.shared.armed = 0
        call.rdzv.uninstall()
        call.control.uninstall()
        with contextlib.suppress(Exception):
            call.coord.record_exited(me)


def _iterations(
    call: RankCall, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    roster = _first_roster(call)
    if roster is None:
        return None  # a replacement that came when the job had completed
    while True:
        _enter(call, roster)
        end = run_iteration(call, fn, args, kwargs, roster)
        if end.completed:
            return end.value
        it = call.state.iteration
        terminated = restart(call, end.value, set(roster))
        roster = _next_roster(call, roster, terminated, it)
        call.fresh = _rejoin.fresh_ranks(call.coord, roster)


def _enter(call: RankCall, roster: dict[int, State]) -> None:
    """Take this rank's state in ``roster`` (its iteration's), and publish the roster
    for replacements to read."""
    me = call.state.initial_rank
    state = roster.get(me)
    if state is None or state.mode is Mode.TERMINATED:
        raise RestartAbort(f"rank {me} was terminated")
    call.state = state
    state.set_distributed_vars()
    call.shared.iteration = state.iteration
    call.shared.started = 1
    doc = _rejoin.encode_roster(roster, call.coord.incarnations)
    call.coord.publish_roster(state.iteration, doc)


def _first_roster(call: RankCall) -> dict[int, State] | None:
    """The roster of the first iteration this process runs: the initial one after
    the initial barrier, or, for a replacement, the one it is admitted into."""
    me, timeout = call.state.initial_rank, call.config.seconds("barrier_timeout")
    size = call.state.initial_world_size
    if call.incarnation > 0:
        if call.exchanged:
            # an assignment that exchanged states through the store (Tree) takes no
            # replacement in; asking, it restarted its peers' iteration again and
            # again (its join record) until its barrier timed out
            log.warning("rank %s: a replacement is not admitted with the rank assignment "
                        "%s: it ends", me, type(call.config.rank_assignment).__name__)  # fmt: skip
            return None
        _rejoin.preload()  # ready before it asks: its peers must not wait for imports
        roster = _rejoin.wait_for_admission(call.coord, me, call.incarnation, timeout, POLL)
        if roster is not None:
            call.fresh = _rejoin.fresh_ranks(call.coord, roster)
            log.info("rank %s: replacement admitted at iteration %s", me, roster[me].iteration)
        return roster
    world = set(range(size))
    dead = call.coord.initial_barrier(me, world, timeout, POLL)
    layout = {r: initial_state(r, size) for r in world}
    return _assign(call, layout, dead, advance=False, tag="init")


def _next_roster(
    call: RankCall, roster: dict[int, State], terminated: set[int], iteration: int
) -> dict[int, State]:
    """The roster after ``iteration``, which ended with ``terminated`` gone."""
    # A stateful, store-exchanging assignment (Tree) cannot be replayed to readmit
    # replacements: they are not admitted (they end cleanly).
    admitted = (
        {} if call.exchanged else _rejoin.admit(call.coord, iteration, set(roster), terminated)
    )
    if admitted:
        log.info("rank %s: ranks %s rejoin", call.state.initial_rank, sorted(admitted))
        return readmit(call.config, roster, terminated, set(admitted), iteration)
    return _assign(call, roster, terminated, advance=True, tag=str(iteration))


def _assign(
    call: RankCall, roster: dict[int, State], terminated: set[int], *, advance: bool, tag: str
) -> dict[int, State]:
    if not call.exchanged:
        return assign(call.config, roster, terminated, advance=advance)
    return assign_exchanged(
        call.config,
        roster,
        terminated,
        advance=advance,
        me=call.state.initial_rank,
        coord=call.coord,
        tag=tag,
        timeout=call.config.seconds("barrier_timeout"),
    )
