"""The loop's eyes around the core: observe one poll, describe the failures.

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
from dataclasses import replace

from relaunch.agent._attempt import Slot
from relaunch.agent._core import ExitBarrier, Hang, Observation, RankView
from relaunch.agent._spec import Worker
from relaunch.agent._worker_files import (
    announced_exit,
    collect_stacks,
    last_progress,
    record_hang,
    returned_at,
)
from relaunch.errors import ProcessFailure
from relaunch.errors._failure import signal_name
from relaunch.events import Cause, WorkerHung
from relaunch.procs import is_stopped

__all__ = ["after_return", "causes", "failures", "observe", "report_hang"]

log = logging.getLogger(__name__)


def observe(
    slots: Mapping[int, Slot],
    codes: Mapping[int, int | None],
    *,
    watch_progress: bool,
    stop_signal: int | None,
    pids: Mapping[int, int] | None = None,
    stalled_after: float | None = None,
) -> Observation:
    """One poll: each local rank's exit code (announced ones included), whether its
    script returned, in-process marker, progress (when hangs are watched), and whether
    it was dropped already; once some rank made no progress for ``stalled_after`` s,
    whether each running process (``pids``) is stopped (no /proc read per poll before)."""
    ranks: list[RankView] = []
    for lr, slot in sorted(slots.items()):
        inprocess = os.path.exists(slot.files.marker)
        code = codes.get(lr)
        returned = returned_at(slot.files)
        if code is None and not inprocess and returned is None:
            code = announced_exit(slot.files)  # (in-process workers announce no failure)
        ranks.append(
            RankView(
                local_rank=lr,
                exitcode=code,
                inprocess=inprocess,
                progress=last_progress(slot.files, slot.started) if watch_progress else None,
                lost=slot.lost is not None,
                respawns=slot.respawns,
                returned=returned,
            )
        )
    now = time.time()
    if (
        pids is not None
        and stalled_after is not None
        and any(v.progress is not None and now - v.progress >= stalled_after for v in ranks)
    ):
        ranks = [
            replace(v, stopped=v.exitcode is None and _stopped(pids, v.local_rank)) for v in ranks
        ]
    return Observation(ranks=ranks, now=now, stop_signal=stop_signal)


def _stopped(pids: Mapping[int, int], local_rank: int) -> bool:
    pid = pids.get(local_rank)
    return pid is not None and is_stopped(pid)


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


def after_return(
    action: ExitBarrier, obs: Observation, workers: Sequence[Worker], grace: float
) -> dict[int, str]:
    """Log (one line per rank) what the interpreters of workers whose script returned
    did afterwards that would otherwise have been a failure: a signal death or a non-zero
    status in teardown, or a teardown still going after the grace (``action.kill``: the
    loop kills them). Returns those lines' facts by global rank, for the event."""
    notes: dict[int, str] = {}
    for view in obs.ranks:
        if view.returned is None:
            continue
        if view.local_rank in action.kill:
            what = (
                f"was still tearing down its interpreter {obs.now - view.returned:.1f} s "
                f"later (teardown grace {grace:g} s): killed"
            )
        elif view.exitcode is not None and view.exitcode < 0:
            what = f"died by {signal_name(-view.exitcode)} in interpreter teardown"
        elif view.exitcode:
            what = f"exited with status {view.exitcode} in interpreter teardown"
        else:
            continue
        rank = workers[view.local_rank].global_rank
        log.warning("rank %s returned, then %s: counted as succeeded", rank, what)
        notes[rank] = what
    return notes


def causes(failures: Mapping[int, ProcessFailure]) -> dict[int, Cause]:
    """What the ``workers_failed`` event says of each failure (the status board reads it)."""
    return {
        rank: Cause(
            local_rank=f.local_rank, pid=f.pid, exitcode=f.exitcode, message=f.message, time=f.time
        )
        for rank, f in failures.items()
    }


def report_hang(hang: Hang, slot: Slot, pid: int, timeout: float) -> WorkerHung:
    """Collect the hung worker's stacks and write its error file; the event."""
    stacks = collect_stacks(pid, slot.files)
    message = record_hang(slot.files, since=hang.since, timeout=timeout, stacks=stacks)
    log.error("local rank %s (pid %s): %s; its stacks:\n%s", hang.local_rank, pid, message, stacks)
    return WorkerHung(local_rank=hang.local_rank, pid=pid, reason=message, stacks=stacks)
