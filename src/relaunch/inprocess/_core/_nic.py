"""What sysfs says about a GPU's InfiniBand NIC: which NIC is nearest to the GPU
(NVIDIA's assignment), and the state and ``link_downed`` counter of its ports.

Every path is under a sysfs root given by the caller (``/sys`` on a host), so a test
builds a directory tree of its own. Nothing here raises for a missing or unreadable
file: a NIC that is not there is not watched, a port that cannot be read reads None.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import NamedTuple
from xml.etree import ElementTree

__all__ = [
    "GB200_NICS",
    "Pair",
    "PortReading",
    "assign",
    "compare",
    "infiniband_devices",
    "nic_for_gpu",
    "pairs_by_pci",
    "pairs_by_topology",
    "parse_topology",
    "pci_chain",
    "port_names",
    "read_port",
]

_PCI = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_HOST_BRIDGE = re.compile(r"pci[0-9a-f]{4,}:[0-9a-f]{2}")

GB200_NICS = {0: "mlx5_0", 1: "mlx5_1", 2: "mlx5_3", 3: "mlx5_4"}
"""NVIDIA's fixed GPU -> NIC table of GB200 nodes, used when the PCI tree pairs none."""


def pci_chain(path: str) -> list[str]:
    """The PCI devices from a sysfs device up to its host bridge (``pci0000:00``, last),
    closest first: the components of the resolved path. Empty for a virtual device."""
    parts = os.path.realpath(path).split(os.sep)
    return [p for p in reversed(parts) if _PCI.fullmatch(p) or _HOST_BRIDGE.fullmatch(p)]


def infiniband_devices(root: str) -> dict[str, list[str]]:
    """Each device of ``<root>/class/infiniband`` (sorted by name) and its PCI chain."""
    base = os.path.join(root, "class", "infiniband")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return {}
    return {name: pci_chain(os.path.join(base, name)) for name in names}


class Pair(NamedTuple):
    """A GPU and a NIC, ``hops`` apart in the PCI tree (fewer is nearer)."""

    hops: int
    gpu: int
    nic: str


def pairs_by_pci(gpus: dict[int, list[str]], nics: dict[str, list[str]]) -> list[Pair]:
    """Every GPU/NIC pair with a common PCI ancestor, nearest first: the hops from each
    to their lowest common ancestor, added (GPUs and NICs by their PCI chains). Unlike
    NVIDIA's walk, the host bridge counts as an ancestor, so a GPU and a NIC on two
    root ports of one host bridge are paired too (after every nearer pair)."""
    pairs = []
    for gpu, gpu_chain in gpus.items():
        for nic, nic_chain in nics.items():
            common = next((node for node in gpu_chain if node in nic_chain), None)
            if common is not None:
                pairs.append(Pair(gpu_chain.index(common) + nic_chain.index(common), gpu, nic))
    return sorted(pairs, key=lambda pair: pair.hops)  # stable: GPU order, then NIC name


def parse_topology(path: str) -> dict[str, list[str]]:
    """NVIDIA's ``pci_topo_file`` (an XML topology, as some clouds give it): each PCI
    bridge's bus id and its children's. Empty (said by the caller) when unreadable."""
    try:
        tree = ElementTree.parse(path)
    except (OSError, ElementTree.ParseError):
        return {}
    children: dict[str, list[str]] = {}
    for bridge in tree.getroot().iter("pci"):
        parent = (bridge.get("busid") or "").lower()
        below = [(c.get("busid") or "").lower() for c in bridge.findall("pci")]
        if parent and any(below):
            children.setdefault(parent, []).extend(b for b in below if b)
    return children


def pairs_by_topology(
    topology: dict[str, list[str]], gpus: dict[int, str], nics: dict[str, str]
) -> list[Pair]:
    """Pairs of a GPU and a NIC under the same bridge of a topology file (0 hops);
    GPUs and NICs by their bus ids."""
    parent_of = {child: parent for parent, below in topology.items() for child in below}
    pairs = []
    for gpu, bus_id in gpus.items():
        parent = parent_of.get(bus_id.lower())
        if parent is None:
            continue
        for nic, nic_bus_id in nics.items():
            if nic_bus_id.lower() in topology[parent]:
                pairs.append(Pair(0, gpu, nic))
    return pairs


def assign(pairs: Iterable[Pair]) -> dict[int, str]:
    """NVIDIA's greedy assignment over pairs nearest first: each GPU takes the nearest
    NIC no other GPU has taken; a GPU left without one shares its nearest NIC."""
    pairs = list(pairs)
    nic_of: dict[int, str] = {}
    taken: set[str] = set()
    for pair in pairs:
        if pair.gpu not in nic_of and pair.nic not in taken:
            nic_of[pair.gpu] = pair.nic
            taken.add(pair.nic)
    for pair in pairs:
        nic_of.setdefault(pair.gpu, pair.nic)
    return nic_of


def nic_for_gpu(
    root: str,
    device_index: int,
    gpus: dict[int, str],
    topology_file: str | None = None,
    gb200: bool = False,
) -> str | None:
    """The InfiniBand device nearest to GPU ``device_index`` (None when there is none).
    ``gpus`` maps each GPU index to its PCI bus id (``0000:05:00.0``); with a
    ``topology_file`` the pairs come from it, else from the PCI tree under ``root``.
    ``gb200``: fall back to NVIDIA's GB200 table when nothing is paired."""
    nics = infiniband_devices(root)
    if topology_file is not None:
        own = {nic: chain[0] for nic, chain in nics.items() if chain and _PCI.fullmatch(chain[0])}
        pairs = pairs_by_topology(parse_topology(topology_file), gpus, own)
    else:
        devices = os.path.join(root, "bus", "pci", "devices")
        chains = {gpu: pci_chain(os.path.join(devices, bus)) for gpu, bus in gpus.items()}
        pairs = pairs_by_pci(chains, nics)
    nic_of = assign(pairs)
    if not nic_of and gb200:
        nic_of = {gpu: nic for gpu, nic in GB200_NICS.items() if nic in nics}
    return nic_of.get(device_index)


class PortReading(NamedTuple):
    """A port's state (``ACTIVE``, ``DOWN``, ...) and ``link_downed`` counter; None
    where the file is missing or unreadable."""

    state: str | None
    link_downed: int | None


def port_names(root: str, nic: str) -> list[str]:
    """The port numbers of an InfiniBand device, sorted."""
    try:
        names = os.listdir(os.path.join(root, "class", "infiniband", nic, "ports"))
    except OSError:
        return []
    return sorted(names, key=lambda name: (len(name), name))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def read_port(root: str, nic: str, port: str, link_down_path_template: str) -> PortReading:
    """Read a port's ``state`` (``4: ACTIVE`` reads ``ACTIVE``) and its ``link_downed``
    counter, at the template's path (``{nic}`` and ``{port}`` filled in)."""
    state = _read(os.path.join(root, "class", "infiniband", nic, "ports", port, "state"))
    if state is not None:
        state = state.split(":", 1)[-1].strip()
    counter = _read(link_down_path_template.format(nic=nic, port=port))
    try:
        link_downed = int(counter) if counter is not None else None
    except ValueError:
        link_downed = None
    return PortReading(state, link_downed)


def compare(accepted: PortReading, now: PortReading) -> str | None:
    """What is wrong with a port now against its last accepted reading, None if nothing:
    it was ACTIVE and is not (or is gone), or its ``link_downed`` counter grew."""
    if accepted.state == "ACTIVE" and now.state != "ACTIVE":
        return f"ACTIVE -> {now.state or 'gone'}"
    if (
        accepted.link_downed is not None
        and now.link_downed is not None
        and now.link_downed > accepted.link_downed
    ):
        return f"link_downed {accepted.link_downed} -> {now.link_downed}"
    return None
