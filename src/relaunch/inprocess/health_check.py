"""Health checks: after an interruption, does this rank take part in the next iteration?
(NVIDIA's ``inprocess.health_check``.)

A check gets the read-only state and raises if the rank is unhealthy: the rank leaves
the job (``HealthCheckError``) and the others go on. The ``Chained*`` checks read the
hardware through NVML (``pynvml``) or sysfs; where that is not available (no GPU, no
NVML, no InfiniBand) they can still be built and called: they log once that the check
is not available and pass, so a CPU job is never failed for lacking a GPU.

After an interruption the wrapper runs :func:`restart_health_check`'s chain, as
NVIDIA's 0.7 does: with ``LOCAL_RANK`` set, first the NIC, NVLink and GPU checks of
device ``LOCAL_RANK``, in that order, then the user's ``health_check``.
"""

from __future__ import annotations

import abc
import asyncio
import datetime
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from relaunch.inprocess._core import _nic
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess.exception import HealthCheckError, RestartError, TimeoutError

__all__ = [
    "ChainedGPUHealthCheck",
    "ChainedNVLHealthCheck",
    "ChainedNicHealthCheck",
    "CudaHealthCheck",
    "FaultCounter",
    "FaultCounterExceeded",
    "HealthCheck",
    "NicHealthCheck",
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


class NicHealthCheck:
    """NVIDIA's ``shared_utils.health_check.NicHealthCheck``: watches the InfiniBand
    ports of the NIC nearest to GPU ``device_index`` (NVIDIA's pairing: in the PCI tree,
    or in ``pci_topo_file``, an XML topology for clouds that hide the PCI tree; the
    GPUs' bus ids come from NVML), or of every InfiniBand device when ``device_index``
    is None. A port is unhealthy when it was ``ACTIVE`` and is not
    (or is gone), or when its ``link_downed`` counter (at ``link_down_path_template``,
    ``{nic}`` and ``{port}`` filled in) grew since the last healthy reading; the first
    reading is taken here. Where there is no such NIC (no InfiniBand, no NVML to pair
    the GPU) nothing is watched (``nics`` is empty, ``reason`` says why) and every
    check passes. Calling it returns True when healthy.

    ``sysfs_root`` (not NVIDIA's) is where sysfs is read (``/sys``, or a test's tree).
    ``interval`` and ``on_failure`` serve :meth:`async_check`, as NVIDIA's.
    """

    def __init__(
        self,
        device_index: int | None = None,
        interval: int = 60,
        pci_topo_file: str | None = None,
        link_down_path_template: str | None = None,
        on_failure: Callable[[], Awaitable[Any]] | None = None,
        *,
        sysfs_root: str = "/sys",
    ) -> None:
        self.interval = interval
        self.pci_topo_file = pci_topo_file
        self.on_failure = on_failure
        self.sysfs_root = sysfs_root
        self.link_down_path_template = link_down_path_template or os.path.join(
            sysfs_root, "class", "infiniband", "{nic}", "ports", "{port}", "counters", "link_downed"
        )
        self.nic_name: str | None = None
        self.nics: tuple[str, ...] = ()
        self.reason = ""
        self._accepted: dict[tuple[str, str], _nic.PortReading] = {}
        if device_index is None:
            self._watch(tuple(_nic.infiniband_devices(sysfs_root)), "no InfiniBand device")
        else:
            self.set_nic_device(device_index)

    def set_nic_device(self, local_rank: int) -> None:
        """Watch the NIC nearest to GPU ``local_rank`` (none if it cannot be told)."""
        self.nic_name = None
        if not _nic.infiniband_devices(self.sysfs_root):
            self._watch((), "no InfiniBand device")
            return
        gpus, name = _nvml_gpus()
        if not gpus:
            self._watch((), f"no GPU bus ids from NVML to pair GPU {local_rank} with a NIC")
            return
        self.nic_name = _nic.nic_for_gpu(
            self.sysfs_root, local_rank, gpus, self.pci_topo_file, gb200="B200" in name.upper()
        )
        if self.nic_name is None:
            self._watch((), f"no InfiniBand device is paired with GPU {local_rank}")
        else:
            self._watch((self.nic_name,), "")

    def _watch(self, nics: tuple[str, ...], reason: str) -> None:
        self.nics, self.reason, self._accepted = nics, reason, {}
        self.check()  # the first reading

    def check(self) -> list[str]:
        """Read every watched port; what is wrong, one line a port (empty: healthy)."""
        problems = []
        for nic in self.nics:
            ports = _nic.port_names(self.sysfs_root, nic)
            ports += [p for n, p in self._accepted if n == nic and p not in ports]  # gone
            for port in ports:
                now = _nic.read_port(self.sysfs_root, nic, port, self.link_down_path_template)
                accepted = self._accepted.get((nic, port))
                problem = _nic.compare(accepted, now) if accepted is not None else None
                if problem is None:
                    self._accepted[nic, port] = now
                else:  # stays unhealthy: the reading is not accepted
                    problems.append(f"{nic} port {port}: {problem}")
        return problems

    def __call__(self) -> bool:
        return not self.check()

    async def async_check(self) -> None:
        """Check every ``interval`` seconds, forever; await ``on_failure()`` on a failure."""
        while True:
            await asyncio.sleep(self.interval)
            if self.check() and self.on_failure is not None:
                await self.on_failure()


def _nvml_gpus() -> tuple[dict[int, str], str]:
    """Each GPU's PCI bus id by NVML index (``0000:05:00.0``) and GPU 0's name; nothing
    where NVML is not available."""
    available, _ = _nvml()
    if not available:
        return {}, ""
    import pynvml

    try:
        gpus = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            bus_id = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).busId
            bus_id = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
            gpus[index] = bus_id.lower()[-12:]  # NVML's 8-digit domain, sysfs's 4
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception as exc:
        log.info("GPU PCI bus ids not available from NVML (%s)", exc)
        return {}, ""
    return gpus, name.decode() if isinstance(name, bytes) else str(name)


class ChainedNicHealthCheck(HealthCheck):
    """NVIDIA's NIC check after a fault: :class:`NicHealthCheck` of GPU ``device_index``
    (every InfiniBand device when None) fails the rank with ``HealthCheckError`` when a
    port went down or its ``link_downed`` counter grew since the check was built. Where
    there is no such NIC it says so once and passes. ``sysfs_root``: as NicHealthCheck's."""

    what = "NIC"

    def __init__(self, device_index: int | None = None, *, sysfs_root: str = "/sys") -> None:
        self.device_index = device_index
        self._nic_checker = NicHealthCheck(device_index=device_index, sysfs_root=sysfs_root)
        self._told = False

    def __call__(self, state: Any, train_ex: BaseException | None = None) -> Any:
        checker = self._nic_checker
        if not checker.nics:
            if not self._told:
                log.info("NIC health check not available: %s", checker.reason)
                self._told = True
            return state
        problems = checker.check()
        if problems:
            raise HealthCheckError(
                "NIC health check failed - link down detected: " + "; ".join(problems)
            )
        return state


def restart_health_check(user: Any) -> Any:
    """The checks run after an interruption, as one :class:`~relaunch.inprocess.Compose`
    (None when there is nothing to run), built as NVIDIA's 0.7 builds it:
    ``Compose(*user, ChainedGPUHealthCheck, ChainedNVLHealthCheck,
    ChainedNicHealthCheck)``, the three of device ``LOCAL_RANK`` (left out without it).
    A Compose runs its last instance first, so the hardware runs first, NIC, NVLink,
    GPU, then the user's checks (a list in its order; a Compose as composed)."""
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
            wrap.ChainedNicHealthCheck(device_index=device),
        ]
    return Compose(*items) if items else None
