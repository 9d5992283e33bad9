"""Health checks: after an interruption, does this rank take part in the next iteration?
(NVIDIA's ``inprocess.health_check``.)

A check gets the read-only state and raises if the rank is unhealthy: the rank leaves
the job (``HealthCheckError``) and the others go on. The ``Chained*`` checks read the
hardware through NVML (``pynvml``) or sysfs; where that is not available (no GPU, no
NVML, no InfiniBand) they can still be built and called: they log once that the check
is not available and pass, so a CPU job is never failed for lacking a GPU.
"""

from __future__ import annotations

import abc
import datetime
import glob
import os
import threading
from typing import Any

from relaunch.inprocess._logs import get_logger
from relaunch.inprocess.exception import HealthCheckError, RestartError, TimeoutError

__all__ = [
    "ChainedGPUHealthCheck",
    "ChainedNVLHealthCheck",
    "ChainedNicHealthCheck",
    "CudaHealthCheck",
    "FaultCounter",
    "FaultCounterExceeded",
    "HealthCheck",
    "restart_health_check",
]

log = get_logger(__name__)


class HealthCheck(abc.ABC):
    """Base class of ``health_check`` callbacks."""

    @abc.abstractmethod
    def __call__(self, state: Any) -> Any:
        """Raise if this rank cannot take part in the next iteration; return the state.

        The built-in checks also accept NVIDIA's older call ``check(state, train_ex)``.
        """


class CudaHealthCheck(HealthCheck):
    """Synchronize this rank's CUDA device (``LOCAL_RANK``, else the current one) in a
    thread; fail with ``TimeoutError`` when it does not finish within ``timeout``,
    then synchronize again to surface a corrupt context. Does nothing unless the
    process initialized CUDA."""

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=30)) -> None:
        from relaunch.errors import ConfigError

        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ConfigError(f"timeout: expected a positive datetime.timedelta, got {timeout!r}")
        self.timeout = timeout

    def __call__(self, state: Any, train_ex: BaseException | None = None) -> Any:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
            return state
        local_rank = os.environ.get("LOCAL_RANK")
        device = int(local_rank) if local_rank is not None else torch.cuda.current_device()
        thread = threading.Thread(
            target=torch.cuda.synchronize, args=(device,), name="relaunch-cuda-health", daemon=True
        )
        thread.start()
        thread.join(self.timeout.total_seconds())
        if thread.is_alive():  # a device that never finishes: the rank leaves the job
            raise TimeoutError(f"CUDA device {device} did not synchronize within {self.timeout}")
        torch.cuda.synchronize(device)
        return state


class FaultCounterExceeded(RestartError):
    """This rank caused more faults than ``FaultCounter.max_rank_faults``."""


class FaultCounter(HealthCheck):
    """Terminate this rank once it has caused more than ``max_rank_faults`` faults
    (an iteration in which its function raised counts as one)."""

    def __init__(self, max_rank_faults: int | None = None) -> None:
        from relaunch.errors import ConfigError

        if max_rank_faults is not None and (
            not isinstance(max_rank_faults, int) or max_rank_faults < 0
        ):
            raise ConfigError(
                f"max_rank_faults: expected a non-negative int or None, got {max_rank_faults!r}"
            )
        self.max_rank_faults = max_rank_faults
        self.faults_count = 0

    @property
    def faults(self) -> int:
        return self.faults_count

    def __call__(self, state: Any, train_ex: BaseException | None = None) -> Any:
        if getattr(state, "fn_exception", None) is None and train_ex is None:
            return state
        self.faults_count += 1
        if self.max_rank_faults is not None and self.faults_count > self.max_rank_faults:
            raise FaultCounterExceeded(
                f"faults_count={self.faults_count} / max_rank_faults={self.max_rank_faults}"
            )
        return state


class _NvmlCheck(HealthCheck):
    """A check that needs NVML; passes (saying so once) where NVML is not available."""

    what = "GPU"

    def __init__(self, device_index: int | None = None) -> None:
        self.device_index = device_index
        self.available, self.reason = _nvml()
        self._told = False

    def _devices(self, nvml: Any) -> list[int]:
        if self.device_index is not None:
            return [self.device_index]
        return list(range(nvml.nvmlDeviceGetCount()))

    def __call__(self, state: Any, train_ex: BaseException | None = None) -> Any:
        if not self.available:
            if not self._told:
                log.info("%s health check not available: %s", self.what, self.reason)
                self._told = True
            return state
        import pynvml  # type: ignore[import-not-found]

        problems = self.check(pynvml)
        if problems:
            self.failed(problems)
        return state

    def check(self, nvml: Any) -> list[str]:
        raise NotImplementedError

    def failed(self, problems: list[str]) -> None:
        raise HealthCheckError(f"{self.what} health check failed: " + "; ".join(problems))


def _nvml() -> tuple[bool, str]:
    try:
        import pynvml
    except ImportError:
        return False, "pynvml is not installed"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:
        return False, f"NVML cannot be initialized ({exc})"
    return (True, "") if count > 0 else (False, "no GPU")


class ChainedGPUHealthCheck(_NvmlCheck):
    """Each GPU (or ``device_index``) answers NVML queries (handle, memory)."""

    def check(self, nvml: Any) -> list[str]:
        problems = []
        for index in self._devices(nvml):
            try:
                nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
            except Exception as exc:
                problems.append(f"GPU {index}: {exc}")
        return problems


class ChainedNVLHealthCheck(_NvmlCheck):
    """NVLink links that are down are logged (as NVIDIA's: they do not fail the rank)."""

    what = "NVLink"

    def check(self, nvml: Any) -> list[str]:
        down = []
        for index in self._devices(nvml):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link) == 0:
                        down.append(f"GPU {index} link {link} down")
                except Exception:
                    break  # no more links on this device
        return down

    def failed(self, problems: list[str]) -> None:
        log.warning("NVLink health: %s", "; ".join(problems))


class ChainedNicHealthCheck(HealthCheck):
    """Every InfiniBand/RoCE port (sysfs) is ACTIVE; not available without any."""

    what = "NIC"

    def __init__(self, device_index: int | None = None) -> None:
        self.device_index = device_index
        self._told = False

    def __call__(self, state: Any, train_ex: BaseException | None = None) -> Any:
        ports = sorted(glob.glob("/sys/class/infiniband/*/ports/*/state"))
        if not ports:
            if not self._told:
                log.info("NIC health check not available: no InfiniBand port in sysfs")
                self._told = True
            return state
        down = []
        for path in ports:
            try:
                with open(path) as f:
                    if "ACTIVE" not in f.read():
                        down.append(path.split("/")[4] + " port " + path.split("/")[6])
            except OSError as exc:
                down.append(f"{path}: {exc}")
        if down:
            raise HealthCheckError("NIC health check failed - link down: " + ", ".join(down))
        return state


def restart_health_check(user: Any) -> Any:
    """The checks run after an interruption: the user's (a list runs in its order; a
    Compose as composed), then NVIDIA's GPU and NVLink checks of ``LOCAL_RANK``. As
    one :class:`~relaunch.inprocess.Compose`, or None when there is nothing to run."""
    from relaunch.inprocess import wrap  # NVIDIA's tests patch the check classes there
    from relaunch.inprocess.compose import Compose

    if user is None:
        items: list[Any] = []
    elif isinstance(user, list | tuple):
        items = list(reversed(user))  # Compose runs the last first
    elif isinstance(user, Compose):
        items = list(user.instances)
    else:
        items = [user]
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and local_rank.strip().isdigit():
        device = int(local_rank)
        items += [
            wrap.ChainedGPUHealthCheck(device_index=device),
            wrap.ChainedNVLHealthCheck(device_index=device),
        ]
    return Compose(*items) if items else None
