"""The loop's eyes and hands around the core: observe one poll, build the failures.

:func:`observe` turns the process table and the worker-contract files into the
:class:`~relaunch.agent._core.Observation` the core decides on; :func:`failures`
and :func:`record_hang` turn the core's answer back into reports.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence

from relaunch.agent._attempt import Slot
from relaunch.agent._core import Hang, Observation, RankView
from relaunch.agent._observe import announced_exit, collect_stacks, last_progress, record_hang
from relaunch.agent._spec import Worker
from relaunch.errors import ProcessFailure

__all__ = ["causes", "drop", "failures", "observe", "report_hang"]

log = logging.getLogger(__name__)


def observe(
    slots: Mapping[int, Slot],
    codes: Mapping[int, int | None],
    *,
    watch_progress: bool,
    stop_signal: int | None,
    nodes_waiting: int,
) -> Observation:
    """One poll: each local rank's exit code (announced ones included), in-process
    marker, progress (when hangs are watched) and whether it was dropped already."""
    ranks: list[RankView] = []
    for lr, slot in sorted(slots.items()):
        inprocess = os.path.exists(slot.files.marker)
        code = codes.get(lr)
        if code is None and not inprocess:  # in-process workers announce nothing
            code = announced_exit(slot.files)
        ranks.append(
            RankView(
                local_rank=lr,
                exitcode=code,
                inprocess=inprocess,
                progress=last_progress(slot.files, slot.started) if watch_progress else None,
                lost=slot.lost is not None,
                respawns=slot.respawns,
            )
        )
    return Observation(
        ranks=ranks, now=time.time(), stop_signal=stop_signal, nodes_waiting=nodes_waiting
    )


def failures(
    local_ranks: Sequence[int],
    obs: Observation,
    workers: Sequence[Worker],
    slots: Mapping[int, Slot],
    pids: Mapping[int, int],
) -> dict[int, ProcessFailure]:
    """The failures of these local ranks, by global rank (a lost rank's is the one
    recorded when it was dropped; a hung rank's exit code is SIGKILL's)."""
    codes = {v.local_rank: v.exitcode for v in obs.ranks}
    result: dict[int, ProcessFailure] = {}
    for lr in local_ranks:
        slot = slots[lr]
        code = codes.get(lr)
        result[workers[lr].global_rank] = slot.lost or ProcessFailure(
            local_rank=lr,
            pid=pids[lr],
            exitcode=code if code else -signal.SIGKILL,
            error_file=slot.files.error_file,
        )
    return result


def causes(failures: Mapping[int, ProcessFailure]) -> dict[int, dict[str, object]]:
    """What the ``workers_failed`` event says of each failure (the status board reads it)."""
    return {
        rank: {
            "local_rank": f.local_rank,
            "pid": f.pid,
            "exitcode": f.exitcode,
            "message": f.message,
            "time": f.time,
        }
        for rank, f in failures.items()
    }


def drop(
    local_ranks: Sequence[int],
    obs: Observation,
    workers: Sequence[Worker],
    slots: Mapping[int, Slot],
    pids: Mapping[int, int],
) -> list[ProcessFailure]:
    """Mark these local ranks lost in their slots (by local rank: the slot's key);
    return their failures, for the ``worker_lost`` events."""
    dropped = list(failures(local_ranks, obs, workers, slots, pids).values())
    for failure in dropped:
        slots[failure.local_rank].lost = failure
    return dropped


def report_hang(hang: Hang, slot: Slot, pid: int, timeout: float) -> dict[str, object]:
    """Collect the hung worker's stacks and write its error file; the event's fields."""
    stacks = collect_stacks(pid, slot.files)
    message = record_hang(slot.files, since=hang.since, timeout=timeout, stacks=stacks)
    log.error("local rank %s (pid %s): %s; its stacks:\n%s", hang.local_rank, pid, message, stacks)
    return {"local_rank": hang.local_rank, "pid": pid, "reason": message, "stacks": stacks}
