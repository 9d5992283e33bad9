"""Starting, watching and stopping worker processes; logs; warm standby interpreters."""

from relaunch.procs._context import Entrypoint, ProcessSpec, WorkerProcesses
from relaunch.procs._logs import RunLogDir, TeeTarget
from relaunch.procs._standby import Standby
from relaunch.procs._sys import set_child_subreaper, signal_name

__all__ = [
    "Entrypoint",
    "ProcessSpec",
    "RunLogDir",
    "Standby",
    "TeeTarget",
    "WorkerProcesses",
    "set_child_subreaper",
    "signal_name",
]
