"""Starting, watching and stopping worker processes; logs; the fork server."""

from relaunch.procs._context import Entrypoint, ProcessSpec, WorkerProcesses
from relaunch.procs._forkserver import ForkServer
from relaunch.procs._logs import RunLogDir, Std, TeeTarget
from relaunch.procs._standby import Standby
from relaunch.procs._sys import (
    is_stopped,
    process_state,
    raise_open_files_limit,
    set_child_subreaper,
    terminate,
)

__all__ = [
    "Entrypoint",
    "ForkServer",
    "ProcessSpec",
    "RunLogDir",
    "Standby",
    "Std",
    "TeeTarget",
    "WorkerProcesses",
    "is_stopped",
    "process_state",
    "raise_open_files_limit",
    "set_child_subreaper",
    "terminate",
]
