"""What each worker gets: torchrun's environment, its arguments, its output streams."""

from __future__ import annotations

import os
from collections.abc import Mapping
from string import Template
from typing import TYPE_CHECKING

from relaunch.procs import Std, TeeTarget

if TYPE_CHECKING:
    from relaunch.agent._spec import WorkerSpec

__all__ = ["substitute_local_rank", "worker_env", "worker_streams"]

LOCAL_RANK_MACRO = "${local_rank}"


def substitute_local_rank(args: tuple[object, ...], local_rank: int) -> tuple[object, ...]:
    """Replace ``${local_rank}`` in every string argument, like torchelastic's macros."""
    return tuple(
        a.replace(LOCAL_RANK_MACRO, str(local_rank)) if isinstance(a, str) else a for a in args
    )


def worker_env(
    *,
    base: Mapping[str, str],
    local_rank: int,
    global_rank: int,
    role_rank: int,
    role: str,
    local_world_size: int,
    world_size: int,
    role_world_size: int,
    group_rank: int,
    group_world_size: int,
    master_addr: str,
    master_port: int,
    restart_count: int,
    max_restarts: int,
    run_id: str,
    error_file: str,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The full environment of one worker: the agent's plus torchrun's per-worker variables."""
    env = dict(base)
    env.update(
        {
            "LOCAL_RANK": str(local_rank),
            "RANK": str(global_rank),
            "GROUP_RANK": str(group_rank),
            "ROLE_RANK": str(role_rank),
            "ROLE_NAME": role,
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "WORLD_SIZE": str(world_size),
            "GROUP_WORLD_SIZE": str(group_world_size),
            "ROLE_WORLD_SIZE": str(role_world_size),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_ERROR_FILE": error_file,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
    )
    if extra:
        env.update(extra)
    return env


def worker_streams(
    spec: WorkerSpec, local_rank: int, global_rank: int, attempt_dir: str
) -> tuple[str | None, str | None, list[TeeTarget]]:
    """Where a worker's stdout and stderr go (a file, or None for the console) and what is tee'd.

    Like torchrun: ``--tee`` implies the redirect to the file, then the file is shown with a
    ``[<role><local_rank>]:`` prefix (or ``--log-line-prefix-template``); ranks outside
    ``--local-ranks-filter`` are not shown (their console streams go to /dev/null).
    """
    tee = spec.tee.get(local_rank, Std.NONE)
    redirect = spec.redirects.get(local_rank, Std.NONE) | tee
    stdout = os.path.join(attempt_dir, "stdout.log") if redirect & Std.OUT else None
    stderr = os.path.join(attempt_dir, "stderr.log") if redirect & Std.ERR else None
    if spec.log_line_prefix_template:
        prefix = Template(spec.log_line_prefix_template).safe_substitute(
            role_name=spec.role, rank=global_rank, local_rank=local_rank
        )
    else:
        prefix = f"[{spec.role}{local_rank}]:"
    targets: list[TeeTarget] = []
    if tee & Std.OUT and stdout:
        targets.append(TeeTarget(stdout, prefix, 1))
    if tee & Std.ERR and stderr:
        targets.append(TeeTarget(stderr, prefix, 2))
    if spec.local_ranks_filter is not None and local_rank not in spec.local_ranks_filter:
        return stdout or os.devnull, stderr or os.devnull, []
    return stdout, stderr, targets
