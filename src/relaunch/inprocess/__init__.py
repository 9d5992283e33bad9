"""In-process restart: restart the training function on every healthy rank, in-process.

Usage::

    from relaunch import inprocess

    @inprocess.Wrapper(soft_timeout=timedelta(seconds=30), hard_timeout=timedelta(seconds=60))
    def train(call_wrapper: inprocess.CallWrapper | None = None):
        torch.distributed.init_process_group("gloo")
        ...
            call_wrapper.ping()

The names and parameters follow NVIDIA's resiliency extension
(``nvidia_resiliency_ext.inprocess``). This package imports torch lazily, but it is
meant to run in workers, where torch is loaded anyway.
"""

from relaunch.inprocess import rank_assignment, rank_filter
from relaunch.inprocess.abort import Abort, AbortTorchDistributed
from relaunch.inprocess.attribution import Interruption, InterruptionRecord
from relaunch.inprocess.callbacks import (
    CudaHealthCheck,
    FaultCounter,
    Finalize,
    HealthCheck,
    Initialize,
)
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
from relaunch.inprocess.peer_state import broadcast_state
from relaunch.inprocess.rank_assignment import FillGaps, RankAssignment, ShiftRanks
from relaunch.inprocess.rank_filter import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    MaxActiveWorldSize,
    RankFilter,
)
from relaunch.inprocess.state import State, Status
from relaunch.inprocess.wrapper import CallWrapper, Wrapper

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
    "HealthCheck",
    "HealthCheckError",
    "Initialize",
    "InternalError",
    "Interruption",
    "InterruptionRecord",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankFilter",
    "RankShouldRestart",
    "RestartAbort",
    "RestartError",
    "ShiftRanks",
    "State",
    "Status",
    "Wrapper",
    "WrapperConfig",
    "broadcast_state",
    "rank_assignment",
    "rank_filter",
]
