"""One iteration of the restart loop on this rank: the iteration barrier, then (an
active rank) the wrapped function under a monitor thread, or (a spare) the wait for
the active ranks; and how the iteration ended, for the loop to act on.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from relaunch.inprocess._core import _params, _sockets
from relaunch.inprocess._core._call import POLL, RankCall
from relaunch.inprocess._core._env import announce_to_agent, terminate_self
from relaunch.inprocess._core._exceptions import (
    BarrierTimeoutError,
    RankShouldRestart,
    TimeoutError,
)
from relaunch.inprocess._core._groups import release_frames, reset_group_names
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess._core._monitor_thread import MonitorThread
from relaunch.inprocess._core._records import Interruption, InterruptionRecord
from relaunch.inprocess._core._state import Mode, State

__all__ = ["Ending", "IterationEnd", "run_iteration"]

log = get_logger(__name__)


class Ending(enum.Enum):
    """How the wrapped function's call ended in one iteration."""

    RETURNED = enum.auto()
    RAISED = enum.auto()
    """It raised an exception (or ``initialize`` or the health check did)."""
    RESTART = enum.auto()
    """``RankShouldRestart`` stopped it (the monitor thread, or the function itself)."""


@dataclasses.dataclass(frozen=True)
class _Called:
    ending: Ending
    value: Any
    """What the function returned, the exception it raised, or the restart's cause."""


@dataclasses.dataclass(frozen=True)
class IterationEnd:
    """How one iteration ended on this rank."""

    completed: bool
    """Every active rank returned: the job is done."""
    value: Any
    """This rank's return value when completed; else the cause of the restart (the
    exception the function raised, or None)."""


def run_iteration(
    call: RankCall,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    roster: dict[int, State],
) -> IterationEnd:
    """Run one iteration of ``call`` (its state is this rank's in ``roster``)."""
    cfg, state, coord = call.config, call.state, call.coord
    me, it = state.initial_rank, state.iteration
    active = {r for r, s in roster.items() if s.mode is Mode.ACTIVE}
    call.aborter.rearm()
    if not coord.iteration_barrier(it, me, set(roster), cfg.seconds("barrier_timeout"), POLL):
        return IterationEnd(completed=False, value=None)
    log.debug("rank %s: iteration %s barrier passed", me, it)
    announce_to_agent(iteration=it, active=state.mode is Mode.ACTIVE)
    if state.mode is not Mode.ACTIVE:
        log.debug("rank %s is a spare at iteration %s", me, it)
        return IterationEnd(coord.completion(it, None, active, None, POLL), None)
    called, triggered = _watched_call(call, fn, args, kwargs, set(roster))
    if called.ending is not Ending.RETURNED:
        if called.ending is Ending.RAISED:
            log.warning("rank %s: iteration %s raised %r", me, it, called.value)
        # (a restart the monitor did not trigger: the function asked for it itself)
        if not triggered:
            why = repr(called.value) if called.ending is Ending.RAISED else "RankShouldRestart"
            record = InterruptionRecord(
                initial_rank=me, interruption=Interruption.EXCEPTION, message=why
            )
            coord.record_interrupted(it, record)
        return IterationEnd(completed=False, value=called.value)
    call.groups.release()  # the function's frame is gone: so are its DDP reducers
    try:
        done = coord.completion(it, me, active, cfg.seconds("completion_timeout"), POLL)
    except BarrierTimeoutError as exc:
        # NVIDIA's: an interruption, every rank restarts (this one with them), not a
        # leave of this rank (the others then went on without it)
        log.warning("rank %s: iteration %s: %s: restarting", me, it, exc)
        record = InterruptionRecord(
            initial_rank=me, interruption=Interruption.EXCEPTION, message=repr(exc)
        )
        coord.record_interrupted(it, record)
        return IterationEnd(completed=False, value=exc)
    return IterationEnd(done, called.value)


def _watched_call(
    call: RankCall,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    members: set[int],
) -> tuple[_Called, bool]:
    """Call the function under a monitor thread; return how the call ended and whether
    the monitor thread interrupted it."""
    cfg = call.config
    _sockets.mark_baseline()
    call.shared.arm()
    assert call.thread_coord is not None
    monitor = MonitorThread(
        coord=call.thread_coord,
        iteration=call.state.iteration,
        initial_rank=call.state.initial_rank,
        members=members,
        interval=cfg.seconds("monitor_thread_interval"),
        soft_timeout=cfg.seconds("soft_timeout"),
        shared=call.shared,
        control=call.control,
        abort=call.aborter.once,
        reabort=call.aborter.again,
        groups=call.groups,
    )
    monitor.start()
    try:
        called = _call(call, fn, args, kwargs)
    finally:
        call.shared.armed = 0
        monitor.shutdown(cfg.seconds("barrier_timeout"))
    _check_stall(call, monitor.stalled_at)
    return called, monitor.triggered.is_set()


def _check_stall(call: RankCall, stalled_at: float | None) -> None:
    """The hard timeout across restarts (see :class:`StallClock`)."""
    me, hard = call.state.initial_rank, call.config.seconds("hard_timeout")
    message = call.stall.overdue(stalled_at, hard, me)
    if message is not None:  # killed as NVIDIA's monitor process kills at hard_timeout
        call.coord.record_dead(call.state.iteration, me, Interruption.HARD_TIMEOUT, message)
        terminate_self(message, call.config.seconds("termination_grace_time"))
        raise TimeoutError(message)  # a SIGTERM handler of the program raised


def _call(
    call: RankCall, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> _Called:
    """``initialize``, the health check, then the function, interruptible in between."""
    called: _Called | None = None
    try:
        try:
            reset_group_names(call.state.iteration)
            call.control.enter()
            cfg, state = call.config, call.state
            _params.initialize_then_check(
                cfg.initialize, cfg.health_check, state, state.initial_rank
            )
            called = _Called(Ending.RETURNED, fn(*args, **kwargs))
        except Exception as exc:
            called = _Called(Ending.RAISED, exc)
        finally:
            call.control.leave()
    except RankShouldRestart as restart:
        call.control.leave()
        release_frames(restart, chain=False)  # landed in fn: free its frames' objects
        cause = called.value if called is not None else restart.__context__
        return _Called(Ending.RESTART, cause)
    assert called is not None
    return called
