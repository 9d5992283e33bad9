"""The per-node agent: WorkerSpec, WorkerGroup, Worker, WorkerState, RunResult, the loop."""

from relaunch.agent._agent import LocalAgent
from relaunch.agent._env import worker_env
from relaunch.agent._spec import (
    RoundHook,
    RoundStart,
    RunResult,
    SnapshotFacts,
    SnapshotSource,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

__all__ = [
    "LocalAgent",
    "RoundHook",
    "RoundStart",
    "RunResult",
    "SnapshotFacts",
    "SnapshotSource",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "worker_env",
]
