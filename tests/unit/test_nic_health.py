"""The NIC health check reads InfiniBand ports from sysfs: here a sysfs tree of the
test's own (``sysfs_root``), built as the kernel lays it out (devices under their PCI
bridges, ``class/infiniband`` and ``bus/pci/devices`` as links to them)."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest

from relaunch.inprocess._core import _nic
from relaunch.inprocess.exception import HealthCheckError
from relaunch.inprocess.health_check import ChainedNicHealthCheck, NicHealthCheck
from relaunch.inprocess.state import State

# Host bridge 0: GPU 0 and mlx5_0 behind one switch, GPU 1 on a root port of its own.
# Host bridge 0x80: GPU 2 and mlx5_1 behind one switch.
GPUS = {0: "0000:05:00.0", 1: "0000:07:00.0", 2: "0000:85:00.0"}
GPU_PATHS = {
    0: ("pci0000:00", "0000:00:01.0", "0000:05:00.0"),
    1: ("pci0000:00", "0000:00:02.0", "0000:07:00.0"),
    2: ("pci0000:80", "0000:80:01.0", "0000:85:00.0"),
}
NIC_PATHS = {
    "mlx5_0": ("pci0000:00", "0000:00:01.0", "0000:06:00.0"),
    "mlx5_1": ("pci0000:80", "0000:80:01.0", "0000:86:00.0"),
}


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def _port(root: Path, nic: str, port: str, state: str, link_downed: int) -> None:
    path = root / "class" / "infiniband" / nic / "ports" / port
    (path / "counters").mkdir(parents=True, exist_ok=True)
    (path / "state").write_text(state + "\n")
    (path / "counters" / "link_downed").write_text(f"{link_downed}\n")


def _sysfs(root: Path) -> Path:
    for index, chain in GPU_PATHS.items():
        device = root.joinpath("devices", *chain)
        device.mkdir(parents=True)
        _link(root / "bus" / "pci" / "devices" / GPUS[index], device)
    for nic, chain in NIC_PATHS.items():
        device = root.joinpath("devices", *chain, "infiniband", nic)
        device.mkdir(parents=True)
        _link(root / "class" / "infiniband" / nic, device)
        _port(root, nic, "1", "4: ACTIVE", 0)
    _port(root, "mlx5_0", "2", "1: DOWN", 0)  # an unused port: down from the start
    return root


def test_the_nic_check_takes_nvidias_parameters() -> None:
    names = list(inspect.signature(NicHealthCheck).parameters)
    assert names[:5] == [
        "device_index",
        "interval",
        "pci_topo_file",
        "link_down_path_template",
        "on_failure",
    ]
    assert list(inspect.signature(ChainedNicHealthCheck).parameters) == [
        "device_index",
        "sysfs_root",
    ]


def test_a_port_that_went_down_fails_the_check(tmp_path: Path) -> None:
    root = _sysfs(tmp_path)
    state = State(0, 1).freeze()
    check = NicHealthCheck(sysfs_root=str(root))
    chained = ChainedNicHealthCheck(sysfs_root=str(root))
    assert check.nics == ("mlx5_0", "mlx5_1")
    assert check() is True
    assert chained(state) is state  # port 2 of mlx5_0 was never up: not a fault

    _port(root, "mlx5_1", "1", "1: DOWN", 0)
    assert check.check() == ["mlx5_1 port 1: ACTIVE -> DOWN"]
    with pytest.raises(HealthCheckError, match="mlx5_1 port 1: ACTIVE -> DOWN"):
        chained(state)
    _port(root, "mlx5_1", "1", "4: ACTIVE", 1)  # up again: the kernel counted the down
    assert check.check() == ["mlx5_1 port 1: link_downed 0 -> 1"]
    assert check() is False  # and it stays unhealthy (NVIDIA's)


def test_a_link_that_flapped_or_a_port_that_is_gone_fails_the_check(tmp_path: Path) -> None:
    root = _sysfs(tmp_path)
    check = NicHealthCheck(sysfs_root=str(root))
    _port(root, "mlx5_0", "1", "4: ACTIVE", 1)  # down and up again since the last check
    _port(root, "mlx5_0", "2", "1: DOWN", 7)  # a link that was never up flaps too
    for name in ("state", "counters/link_downed"):
        (root / "class/infiniband/mlx5_1/ports/1" / name).unlink()
    assert check.check() == [
        "mlx5_0 port 1: link_downed 0 -> 1",
        "mlx5_0 port 2: link_downed 0 -> 7",
        "mlx5_1 port 1: ACTIVE -> gone",
    ]


def test_nvidias_counter_path_template_is_followed(tmp_path: Path) -> None:
    root = _sysfs(tmp_path)
    counters = tmp_path / "counters"
    counters.mkdir()
    for nic in NIC_PATHS:
        (counters / nic).write_text("3\n")
    check = NicHealthCheck(sysfs_root=str(root), link_down_path_template=str(counters / "{nic}"))
    assert check() is True
    (counters / "mlx5_1").write_text("4\n")
    assert check.check() == ["mlx5_1 port 1: link_downed 3 -> 4"]


def test_without_infiniband_or_a_pairing_the_check_passes(tmp_path: Path) -> None:
    state = State(0, 1).freeze()
    for device_index in (None, 0):
        empty = ChainedNicHealthCheck(device_index, sysfs_root=str(tmp_path / "none"))
        assert empty._nic_checker.nics == ()
        assert empty._nic_checker.reason == "no InfiniBand device"
        assert empty(state) is state
    # NICs but no NVML (or GPUs that are not in this tree) to say which is GPU 0's
    unpaired = NicHealthCheck(0, sysfs_root=str(_sysfs(tmp_path / "sys")))
    assert unpaired.nics == () and unpaired.nic_name is None
    assert "GPU 0" in unpaired.reason
    assert unpaired() is True


def test_each_gpu_is_paired_with_its_nearest_nic(tmp_path: Path) -> None:
    root = str(_sysfs(tmp_path / "sys"))
    assert _nic.pci_chain(f"{root}/class/infiniband/mlx5_0") == [
        "0000:06:00.0",
        "0000:00:01.0",
        "pci0000:00",
    ]
    # GPU 1 shares no switch with a NIC: it shares the nearest one of its host bridge
    assert [_nic.nic_for_gpu(root, gpu, GPUS) for gpu in GPUS] == ["mlx5_0", "mlx5_0", "mlx5_1"]
    assert _nic.nic_for_gpu(root, 3, GPUS) is None
    nearest_first = _nic.pairs_by_pci(
        {gpu: _nic.pci_chain(f"{root}/bus/pci/devices/{bus}") for gpu, bus in GPUS.items()},
        _nic.infiniband_devices(root),
    )
    assert nearest_first == [
        _nic.Pair(2, 0, "mlx5_0"),
        _nic.Pair(2, 2, "mlx5_1"),
        _nic.Pair(4, 1, "mlx5_0"),
    ]


def test_a_topology_file_or_the_gb200_table_pairs_instead(tmp_path: Path) -> None:
    root = str(_sysfs(tmp_path / "sys"))
    topology = tmp_path / "topo.xml"
    topology.write_text(
        '<system><cpu><pci busid="0000:80:01.0"><pci busid="0000:85:00.0"/>'
        '<pci busid="0000:86:00.0"/></pci></cpu></system>'
    )
    paired = [_nic.nic_for_gpu(root, gpu, GPUS, str(topology)) for gpu in GPUS]
    assert paired == [None, None, "mlx5_1"]
    nowhere = {0: "0000:41:00.0", 1: "0000:42:00.0", 2: "0000:43:00.0"}
    assert _nic.nic_for_gpu(root, 1, nowhere) is None
    assert _nic.nic_for_gpu(root, 1, nowhere, gb200=True) == "mlx5_1"
    assert _nic.nic_for_gpu(root, 2, nowhere, gb200=True) is None  # no mlx5_3 here
    assert _nic.parse_topology(str(tmp_path / "missing.xml")) == {}


def test_async_check_calls_on_failure(tmp_path: Path) -> None:
    root = _sysfs(tmp_path)
    failures: list[int] = []

    class Stop(Exception):
        pass

    async def on_failure() -> None:
        failures.append(1)
        raise Stop

    check = NicHealthCheck(interval=0, on_failure=on_failure, sysfs_root=str(root))
    _port(root, "mlx5_0", "1", "1: DOWN", 0)
    with pytest.raises(Stop):
        asyncio.run(check.async_check())
    assert failures == [1]
