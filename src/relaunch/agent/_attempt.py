"""One attempt's workers on this node: their environment, files and process specs."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from relaunch._contract import ERROR_FILE_ENV, INCARNATION_ENV, AttemptFiles
from relaunch._json import loads as json_loads
from relaunch.agent._env import substitute_local_rank, worker_env, worker_streams
from relaunch.agent._spec import Worker, WorkerGroup, WorkerSpec
from relaunch.errors import ProcessFailure
from relaunch.procs import ProcessSpec, RunLogDir

__all__ = ["Slot", "attempt_workers", "replacement", "return_values"]

log = logging.getLogger(__name__)


@dataclass
class Slot:
    """One local rank's worker of the current attempt: its environment and files."""

    env: dict[str, str]
    files: AttemptFiles
    started: float
    """Wall-clock start (hang detection counts from it before the first progress)."""
    lost: ProcessFailure | None = None
    """Set when the worker died and its in-process peers went on without it."""
    respawns: int = 0
    """Replacement processes this local rank had in this attempt."""
    incarnation: int = 0
    """Its worker's ``RELAUNCH_INPROCESS_INCARNATION``: the node's base incarnation (0,
    or a vacancy's for a node that replaced a lost one) plus its respawns."""


def attempt_workers(
    spec: WorkerSpec,
    group: WorkerGroup,
    logdir: RunLogDir,
    attempt: int,
    *,
    restart_count: int,
    run_id: str,
    extra: Mapping[str, str],
    incarnation: int = 0,
) -> tuple[dict[int, Slot], list[ProcessSpec]]:
    """The slot (environment, files) and the process spec of each local rank."""
    assert group.master_addr is not None and group.master_port is not None
    assert group.group_rank is not None and group.group_world_size is not None
    slots: dict[int, Slot] = {}
    specs: list[ProcessSpec] = []
    for worker in group.workers:
        lr = worker.local_rank
        attempt_dir = logdir.attempt_dir(attempt, lr)
        files = AttemptFiles.in_dir(attempt_dir)
        env = worker_env(
            base=spec.base_env,
            local_rank=lr,
            global_rank=worker.global_rank,
            role_rank=worker.role_rank,
            role=spec.role,
            local_world_size=spec.local_world_size,
            world_size=worker.world_size,
            role_world_size=worker.role_world_size,
            group_rank=group.group_rank,
            group_world_size=group.group_world_size,
            master_addr=group.master_addr,
            master_port=group.master_port,
            restart_count=restart_count,
            max_restarts=spec.max_restarts,
            run_id=run_id,
            error_file=files.error_file,
            extra={
                **extra,
                **files.env(spec.hang_timeout),
                **({INCARNATION_ENV: str(incarnation)} if incarnation else {}),
            },
        )
        slots[lr] = Slot(env=env, files=files, started=time.time(), incarnation=incarnation)
        stdout, stderr, tee = worker_streams(spec, lr, worker.global_rank, attempt_dir)
        args = substitute_local_rank(spec.args, lr)
        is_function = spec.entrypoint.kind == "function"
        specs.append(
            ProcessSpec(
                local_rank=lr,
                env=env,
                args=() if is_function else tuple(str(a) for a in args),
                call_args=args if is_function else (),
                result_file=files.result_file if is_function else None,
                stdout=stdout,
                stderr=stderr,
                tee=tee,
            )
        )
    return slots, specs


def replacement(
    slot: Slot, spec: ProcessSpec, hang_timeout: float | None
) -> tuple[Slot, ProcessSpec]:
    """The slot and process spec of local rank's next replacement process: same
    environment, ranks and output files; its own contract files (in a subdirectory of
    the attempt's) and ``RELAUNCH_INPROCESS_INCARNATION``."""
    respawns = slot.respawns + 1
    incarnation = slot.incarnation + 1
    attempt_dir = os.path.dirname(slot.files.error_file)
    if slot.respawns:
        attempt_dir = os.path.dirname(attempt_dir)  # the rank's directory, not a replacement's
    directory = os.path.join(attempt_dir, f"replacement{respawns}")
    os.makedirs(directory, exist_ok=True)
    files = AttemptFiles.in_dir(directory)
    env = {
        **slot.env,
        **files.env(hang_timeout),
        ERROR_FILE_ENV: files.error_file,
        INCARNATION_ENV: str(incarnation),
    }
    new_slot = Slot(
        env=env, files=files, started=time.time(), respawns=respawns, incarnation=incarnation
    )
    result_file = files.result_file if spec.result_file is not None else None
    return new_slot, dataclasses.replace(spec, env=env, result_file=result_file)


def return_values(
    spec: WorkerSpec, workers: Sequence[Worker], slots: Mapping[int, Slot]
) -> dict[int, object]:
    """Return values of a function entrypoint, by global rank (None if unreadable)."""
    if spec.entrypoint.kind != "function":
        return {}
    values: dict[int, object] = {}
    for worker in workers:
        value: object = None
        try:
            with open(slots[worker.local_rank].files.result_file) as f:
                data = json_loads(f.read())
            if isinstance(data, dict) and data.get("version") == 1:
                value = data.get("value")
        except (OSError, ValueError) as exc:
            log.warning("local rank %s: no readable return value: %s", worker.local_rank, exc)
        values[worker.global_rank] = value
    return values
