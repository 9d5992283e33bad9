"""In-process restart: restart the training function on every healthy rank, in-process.

Usage::

    from relaunch import inprocess

    @inprocess.Wrapper(soft_timeout=timedelta(seconds=30), hard_timeout=timedelta(seconds=60))
    def train(call_wrapper: inprocess.CallWrapper | None = None):
        torch.distributed.init_process_group("gloo")
        ...
            call_wrapper.ping()

The modules, names, parameters and semantics follow NVIDIA's resiliency extension
(``nvidia_resiliency_ext.inprocess`` 0.7): code written for it runs after changing
the import (see the README's "Migrating from NVIDIA's resiliency extension"). This
package imports torch lazily, but it is meant to run in workers, where torch is
loaded anyway.
"""

import importlib
from typing import Any

from relaunch.inprocess import (
    abort,
    auto_restart,
    compose,
    exception,
    finalize,
    health_check,
    initialize,
    monitor_thread,
    nested_restarter,
    progress_watchdog,
    rank_assignment,
    rank_filter,
    state,
    tools,
    wrap,
)

# NVIDIA's module, loaded with the package as NVIDIA's is (not among the names of __all__)
from relaunch.inprocess import monitor_process as monitor_process
from relaunch.inprocess.abort import Abort, AbortTorchDistributed
from relaunch.inprocess.attribution import Interruption, InterruptionRecord
from relaunch.inprocess.compose import Compose
from relaunch.inprocess.config import WrapperConfig
from relaunch.inprocess.exception import (
    BarrierTimeoutError,
    HealthCheckError,
    InternalError,
    RankShouldRestart,
    RestartAbort,
    RestartError,
)
from relaunch.inprocess.finalize import Finalize, ThreadedFinalize
from relaunch.inprocess.health_check import CudaHealthCheck, FaultCounter, HealthCheck
from relaunch.inprocess.initialize import Initialize, RetryController
from relaunch.inprocess.peer_state import broadcast_state
from relaunch.inprocess.rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    MaxActiveWorldSize,
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
    RankFilter,
    ShiftRanks,
)
from relaunch.inprocess.state import FrozenState, Mode, State, Status
from relaunch.inprocess.wrap import Wrapper
from relaunch.inprocess.wrapper import CallWrapper


def __getattr__(name: str) -> Any:
    # ``store`` imports torch.distributed: loaded on first use (``inprocess.store``).
    if name == "store":
        return importlib.import_module("relaunch.inprocess.store")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Abort",
    "AbortTorchDistributed",
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "BarrierTimeoutError",
    "CallWrapper",
    "Compose",
    "CudaHealthCheck",
    "FaultCounter",
    "FillGaps",
    "Finalize",
    "FrozenState",
    "HealthCheck",
    "HealthCheckError",
    "Initialize",
    "InternalError",
    "Interruption",
    "InterruptionRecord",
    "MaxActiveWorldSize",
    "Mode",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
    "RankShouldRestart",
    "RestartAbort",
    "RestartError",
    "RetryController",
    "ShiftRanks",
    "State",
    "Status",
    "ThreadedFinalize",
    "Wrapper",
    "WrapperConfig",
    "abort",
    "auto_restart",
    "broadcast_state",
    "compose",
    "exception",
    "finalize",
    "health_check",
    "initialize",
    "monitor_thread",
    "nested_restarter",
    "progress_watchdog",
    "rank_assignment",
    "rank_filter",
    "state",
    "tools",
    "wrap",
]
