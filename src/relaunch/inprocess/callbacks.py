"""Base classes of the rank-local callbacks: Initialize, Finalize, HealthCheck.

Each takes this rank's :class:`~relaunch.inprocess.State` and returns it (possibly
replaced). ``Finalize`` and ``HealthCheck`` also get the exception that interrupted
the iteration (or None).
"""

from __future__ import annotations

import abc
import datetime
import logging
import threading

from relaunch.inprocess.state import State

__all__ = ["CudaHealthCheck", "FaultCounter", "Finalize", "HealthCheck", "Initialize"]

log = logging.getLogger(__name__)


class Initialize(abc.ABC):
    """Runs at the start of every iteration, before the wrapped function."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        """Prepare this rank; raise to interrupt the iteration."""


class Finalize(abc.ABC):
    """Runs after an interruption, after abort, before the health check."""

    @abc.abstractmethod
    def __call__(self, state: State, train_ex: BaseException | None) -> State:
        """Clean up this rank's resources after an interrupted iteration."""


class HealthCheck(abc.ABC):
    """Runs after an interruption; raising terminates this rank (only this one)."""

    @abc.abstractmethod
    def __call__(self, state: State, train_ex: BaseException | None) -> State:
        """Raise if this rank cannot take part in the next iteration."""


class CudaHealthCheck(HealthCheck):
    """Synchronize the current CUDA device; skipped unless CUDA was initialized.

    ``timeout`` (NVIDIA's parameter, default 30 s): a device that does not finish its
    work in time fails the check (the rank leaves). On a CPU-only machine (or when
    the job never touched CUDA) this does nothing, so a ``LOCAL_RANK`` without a GPU
    does not fail the restart.
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=30)) -> None:
        from relaunch.errors import ConfigError

        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ConfigError(f"timeout: expected a positive datetime.timedelta, got {timeout!r}")
        self.timeout = timeout

    def __call__(self, state: State, train_ex: BaseException | None) -> State:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
            return state
        done = threading.Event()

        def synchronize() -> None:
            torch.cuda.synchronize()
            done.set()

        # A daemon thread: a device that never finishes leaves it blocked, and the
        # rank, which fails this check, leaves the job.
        threading.Thread(target=synchronize, name="relaunch-cuda-health", daemon=True).start()
        if not done.wait(self.timeout.total_seconds()):
            raise TimeoutError(f"CUDA device did not synchronize within {self.timeout}")
        return state


class FaultCounter(HealthCheck):
    """Terminate this rank once it has caused more than ``max_rank_faults`` faults."""

    def __init__(self, max_rank_faults: int | None = None) -> None:
        from relaunch.errors import ConfigError

        if max_rank_faults is not None and (
            not isinstance(max_rank_faults, int) or max_rank_faults < 0
        ):
            raise ConfigError(
                f"max_rank_faults: expected a non-negative int or None, got {max_rank_faults!r}"
            )
        self.max_rank_faults = max_rank_faults
        self.faults = 0

    def __call__(self, state: State, train_ex: BaseException | None) -> State:
        if train_ex is not None:
            self.faults += 1
        if self.max_rank_faults is not None and self.faults > self.max_rank_faults:
            raise RuntimeError(
                f"rank {state.initial_rank}: {self.faults} faults > {self.max_rank_faults}"
            )
        return state
