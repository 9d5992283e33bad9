"""The validated parameters of :class:`~relaunch.inprocess.Wrapper`."""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable
from typing import Any

from relaunch.errors import ConfigError
from relaunch.inprocess.abort import AbortTorchDistributed
from relaunch.inprocess.compose import Compose
from relaunch.inprocess.rank_assignment import ActivateAllRanks, ShiftRanks

__all__ = ["WrapperConfig"]

Callback = Callable[..., Any]

_TIMEDELTAS = (
    "monitor_thread_interval",
    "monitor_process_interval",
    "progress_watchdog_interval",
    "soft_timeout",
    "hard_timeout",
    "heartbeat_timeout",
    "barrier_timeout",
    "completion_timeout",
    "last_call_wait",
    "termination_grace_time",
)


_S0_05 = datetime.timedelta(seconds=0.05)
_S0_25 = datetime.timedelta(seconds=0.25)
_S0_1 = datetime.timedelta(seconds=0.1)
_S60 = datetime.timedelta(seconds=60)
_S90 = datetime.timedelta(seconds=90)
_S30 = datetime.timedelta(seconds=30)
_S120 = datetime.timedelta(seconds=120)
_S0 = datetime.timedelta(seconds=0)
_S5 = datetime.timedelta(seconds=5)


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def _check_callback(name: str, value: object) -> None:
    if value is None or callable(value):
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            if not callable(item):
                raise ConfigError(f"{name}[{index}]: expected a callable, got {item!r}")
        return
    raise ConfigError(f"{name}: expected a callable, a list of callables or None, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WrapperConfig:
    """Parameters of the wrapper; every check names the parameter it refuses."""

    store_factory: Callable[..., Any] | None = None
    """Builds a torch ``Store`` *client* from ``store_kwargs``; None: the agent's store
    (``TORCHELASTIC_USE_AGENT_STORE``) or, standalone, one hosted by rank 0's monitor process."""
    store_kwargs: dict[str, Any] | None = None
    """Keyword arguments of ``store_factory`` (default store: ``host``, ``port``)."""
    initialize: Callback | list[Callback] | None = None
    """Rank-local initialization at the start of each iteration."""
    abort: Callback | list[Callback] | None = dataclasses.field(
        default_factory=AbortTorchDistributed
    )
    """Asynchronous abort of what the function is blocked in (process groups)."""
    finalize: Callback | list[Callback] | None = None
    """Rank-local cleanup after an interruption."""
    health_check: Callback | list[Callback] | None = None
    """Rank-local health check after an interruption; raising terminates the rank."""
    rank_assignment: Callback = dataclasses.field(
        default_factory=lambda: Compose(ActivateAllRanks(), ShiftRanks())
    )
    """New ranks and active ranks for the next iteration, called with a
    ``RankAssignmentCtx`` (default: shift down over the gaps, activate every rank)."""
    rank_filter: Callback | list[Callback] | None = None
    """Deprecated (as in NVIDIA's): which ranks are active, called with the state after
    the rank assignment; use ``rank_assignment`` filters instead."""
    monitor_thread_interval: datetime.timedelta = _S0_05
    """How often the monitor thread reads the store."""
    monitor_process_interval: datetime.timedelta = _S0_25
    """How often the monitor process checks this rank's progress and the others' heartbeats."""
    heartbeat_interval: datetime.timedelta | None = None
    """How often the monitor process writes this rank's heartbeat (None: every
    ``monitor_process_interval``)."""
    progress_watchdog_interval: datetime.timedelta = _S0_1
    """How often the automatic progress timestamp is taken."""
    soft_timeout: datetime.timedelta = _S60
    """No progress for this long: the rank aborts and restarts with the others."""
    hard_timeout: datetime.timedelta = _S90
    """No progress for this long: the monitor process kills the rank."""
    heartbeat_timeout: datetime.timedelta = _S30
    """A rank whose monitor process did not heartbeat for this long is declared missing."""
    barrier_timeout: datetime.timedelta = _S120
    """Timeout of the initial, iteration and termination barriers."""
    completion_timeout: datetime.timedelta = _S120
    """Timeout of the completion barrier (after this rank's function returned)."""
    last_call_wait: datetime.timedelta = _S0
    """After a rank was lost, time left to the others to report concurrent losses."""
    termination_grace_time: datetime.timedelta = _S5
    """Time between SIGTERM and SIGKILL when the monitor process kills its rank."""
    monitor_process_logfile: str | None = None
    """Absolute path of the monitor process's log; may contain ``{rank}``."""
    monitor_process_pidfile: str | None = None
    """Absolute path where the monitor process's pid is written; may contain ``{rank}``."""
    enabled: bool = True
    """False: the decorator returns the function unchanged."""

    def __post_init__(self) -> None:
        if self.store_factory is not None and not callable(self.store_factory):
            raise ConfigError(f"store_factory: expected a callable, got {self.store_factory!r}")
        if self.store_kwargs is not None and not isinstance(self.store_kwargs, dict):
            raise ConfigError(f"store_kwargs: expected a dict or None, got {self.store_kwargs!r}")
        for name in ("initialize", "finalize", "health_check", "rank_filter"):
            _check_callback(name, getattr(self, name))
        _check_callback("abort", self.abort)
        if not callable(self.rank_assignment):
            raise ConfigError(
                f"rank_assignment: expected a RankAssignment, got {self.rank_assignment!r}"
            )
        for name in _TIMEDELTAS:
            value = getattr(self, name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                value = _seconds(value)
                object.__setattr__(self, name, value)
            if not isinstance(value, datetime.timedelta):
                raise ConfigError(f"{name}: expected a datetime.timedelta, got {value!r}")
            if value < datetime.timedelta(0) or (
                value == datetime.timedelta(0) and name != "last_call_wait"
            ):
                raise ConfigError(f"{name}: expected a positive duration, got {value}")
        if self.heartbeat_interval is not None:
            value = self.heartbeat_interval
            if isinstance(value, int | float) and not isinstance(value, bool):
                value = _seconds(value)
                object.__setattr__(self, "heartbeat_interval", value)
            if not isinstance(value, datetime.timedelta) or not (
                datetime.timedelta(0) < value < self.heartbeat_timeout
            ):
                raise ConfigError(
                    f"heartbeat_interval: expected a positive duration below heartbeat_timeout "
                    f"({self.heartbeat_timeout}), got {value!r}"
                )
        self._check_order()
        for name in ("monitor_process_logfile", "monitor_process_pidfile"):
            path = getattr(self, name)
            if path is not None and (not isinstance(path, str) or not os.path.isabs(path)):
                raise ConfigError(f"{name}: expected an absolute path, got {path!r}")
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"enabled: expected a bool, got {self.enabled!r}")

    def _check_order(self) -> None:
        pairs = (
            ("soft_timeout", "hard_timeout"),
            ("hard_timeout", "barrier_timeout"),
            ("monitor_thread_interval", "soft_timeout"),
            ("progress_watchdog_interval", "soft_timeout"),
            ("monitor_process_interval", "heartbeat_timeout"),
            ("monitor_process_interval", "hard_timeout"),
            ("heartbeat_timeout", "barrier_timeout"),
        )
        for low, high in pairs:
            if not getattr(self, low) < getattr(self, high):
                raise ConfigError(
                    f"{low}: expected less than {high} ({getattr(self, high)}), "
                    f"got {getattr(self, low)}"
                )

    def seconds(self, name: str) -> float:
        """A duration parameter in seconds."""
        value: datetime.timedelta = getattr(self, name)
        return value.total_seconds()
