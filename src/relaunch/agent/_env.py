"""The environment each worker gets: exactly torchrun's keys and values."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["substitute_local_rank", "worker_env"]

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
