"""Watching one attempt's workers: the group's state and its failures, from one poll.

A worker has failed once its runner announced a non-zero exit (before its teardown),
once it exited non-zero, or once it hung (``--hang-timeout``). A failed worker of an
in-process restart group is *lost*, not a group failure, while in-process peers of it
still run: they go on without it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence

from relaunch.agent._attempt import Slot
from relaunch.agent._observe import (
    announced_exit,
    collect_stacks,
    last_progress,
    oldest_hung,
    record_hang,
)
from relaunch.agent._spec import Worker, WorkerState
from relaunch.errors import ProcessFailure

__all__ = ["poll_group"]

log = logging.getLogger(__name__)

Emit = Callable[..., None]


def poll_group(
    workers: Sequence[Worker],
    slots: Mapping[int, Slot],
    codes: dict[int, int | None],
    pids: Mapping[int, int],
    *,
    hang_timeout: float | None,
    emit: Emit,
) -> tuple[WorkerState, dict[int, ProcessFailure]]:
    """The group's state and its failures by global rank. ``codes`` (exit code per local
    rank, None while running) gets the announced exits; lost workers are recorded in
    their slot (``worker_lost`` is emitted once)."""
    failures: dict[int, ProcessFailure] = {}
    for worker in workers:
        lr, slot = worker.local_rank, slots[worker.local_rank]
        code = codes.get(lr)
        if code is None:
            code = codes[lr] = announced_exit(slot.files)
        if code is None or code == 0 or slot.lost is not None:
            continue
        failure = ProcessFailure(
            local_rank=lr, pid=pids[lr], exitcode=code, error_file=slot.files.error_file
        )
        if _peers_restart_in_process(slots, lr, codes):
            slot.lost = failure
            emit("worker_lost", local_rank=lr, exitcode=code, reason=failure.message)
            continue
        failures[worker.global_rank] = failure
    lost = {w.global_rank: s.lost for w in workers if (s := slots[w.local_rank]).lost}
    if not failures and hang_timeout:
        failures = _hung(workers, slots, codes, pids, hang_timeout, emit)
    if failures:
        failures.update(lost)
        return WorkerState.FAILED, failures
    if all(code is not None for code in codes.values()):
        if len(lost) == len(codes):
            return WorkerState.FAILED, lost
        return WorkerState.SUCCEEDED, failures
    return WorkerState.HEALTHY, failures


def _hung(
    workers: Sequence[Worker],
    slots: Mapping[int, Slot],
    codes: Mapping[int, int | None],
    pids: Mapping[int, int],
    timeout: float,
    emit: Emit,
) -> dict[int, ProcessFailure]:
    """The worker hung longest, as a failure with its stacks, if one passed the timeout."""
    progress = {
        lr: t
        for lr, slot in slots.items()
        if codes.get(lr) is None
        and not os.path.exists(slot.files.marker)
        and (t := last_progress(slot.files, slot.started)) is not None
    }
    lr = oldest_hung(progress, time.time(), timeout)
    if lr is None:
        return {}
    files = slots[lr].files
    stacks = collect_stacks(pids[lr], files)
    message = record_hang(files, since=progress[lr], timeout=timeout, stacks=stacks)
    emit("worker_hung", local_rank=lr, pid=pids[lr], reason=message, stacks=stacks)
    log.error("local rank %s (pid %s): %s; its stacks:\n%s", lr, pids[lr], message, stacks)
    failure = ProcessFailure(
        local_rank=lr, pid=pids[lr], exitcode=-signal.SIGKILL, error_file=files.error_file
    )
    return {workers[lr].global_rank: failure}


def _peers_restart_in_process(
    slots: Mapping[int, Slot], local_rank: int, codes: Mapping[int, int | None]
) -> bool:
    """Whether the worker ran under relaunch.inprocess, and so do running peers of it."""
    return os.path.exists(slots[local_rank].files.marker) and any(
        code is None and os.path.exists(slots[lr].files.marker)
        for lr, code in codes.items()
        if lr != local_rank
    )
