"""The restart procedure of one rank after an interrupted iteration, in NVIDIA's order:
abort (once), finalize, health check; then the failed iteration's frames and process
groups are released and every member meets at the termination barrier, which
freezes the set of terminated ranks the next roster is computed from.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

from relaunch.inprocess._core import _params, _sockets
from relaunch.inprocess._core._abort import destroy_default_group
from relaunch.inprocess._core._call import POLL, RankCall
from relaunch.inprocess._core._exceptions import RestartAbort
from relaunch.inprocess._core._groups import release_frames
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess._core._records import Interruption

__all__ = ["HOLD", "restart"]

log = get_logger(__name__)

HOLD = 0.2
"""Seconds (from the restart) the connections of an aborted iteration stay held open at
most while members have not reached the termination barrier (at least four monitor
thread intervals)."""


def restart(call: RankCall, cause: Any, members: set[int]) -> set[int]:
    """Restart after ``call``'s current iteration was interrupted by ``cause`` (the
    exception the function raised, or None); return the frozen set of terminated
    initial ranks. Raises RestartAbort when this rank is among them."""
    cfg, me, it = call.config, call.state.initial_rank, call.state.iteration
    train_ex = cause if isinstance(cause, BaseException) else None
    # The hard timeout covers the restart procedure too (its waits poll in Python):
    # a rank stuck in C here is killed and the others go on without it.
    call.shared.arm()
    call.aborter.once()
    destroy_default_group()  # here, not in the monitor thread (see _abort.py)
    exc_ = train_ex if isinstance(train_ex, Exception) else None
    call.state = dataclasses.replace(call.state, fn_exception=exc_)
    _params.finalize_then_check(
        cfg.finalize,
        call.wrapper_health_check,
        call.state,
        me,
        lambda why: call.coord.record_dead(it, me, Interruption.TERMINATED, why),
    )
    release_frames(train_ex)
    gc.collect(1)
    call.groups.release()  # the last references: groups are destroyed without the GIL
    call.shared.iteration = it + 1  # a death from now on interrupts the next iteration
    # The abort's connections close once every member reached this barrier (each has
    # aborted its own: a close that reaches a peer's gloo mid-send can hang it, see
    # _sockets), or after a hold at most (a peer blocked in a collective inside
    # atomic() cannot abort: the close releases it).
    hold_until = time.monotonic() + max(HOLD, 4 * cfg.seconds("monitor_thread_interval"))

    def release_when(present: set[int]) -> None:
        if members <= present or time.monotonic() >= hold_until:
            _sockets.release_held()

    try:
        terminated = call.coord.termination_barrier(
            it,
            me,
            members,
            cfg.seconds("barrier_timeout"),
            POLL,
            cfg.seconds("last_call_wait"),
            waiting=release_when,
        )
    finally:
        _sockets.release_held()
    log.info("rank %s: iteration %s ends; terminated ranks %s", me, it, sorted(terminated))
    if me in terminated:
        raise RestartAbort(f"rank {me} was declared terminated")
    return terminated
