"""Issue 3 acceptance: real ``relaunch`` agents in network namespaces of their own.

Each agent runs in its own ``ip netns`` with a veth pair into a bridge, on its own
address (``--local-addr``); node 0 hosts the c10d store. Once both train
together, one node's link is set down: the others notice it by heartbeat and go on
at the smaller size. Needs root (CAP_NET_ADMIN); skipped with the reason otherwise.
Works from inside a loopback-only namespace (``unshare -n``). Everything created is
removed, even on failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from multinode_support.cluster import Cluster

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]

HEARTBEAT = "keep_alive_interval=0.25,keep_alive_max_attempt=8"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


class Net:
    """A bridge and ``n`` namespaces, each with a veth pair into the bridge."""

    def __init__(self, n: int) -> None:
        tag = f"{os.getpid() % 100000}"
        self.subnet = f"10.214.{os.getpid() % 250}"
        self.bridge = f"mnbr{tag}"
        self.spaces = [f"mnns{tag}_{i}" for i in range(n)]
        self.links = [f"mnv{tag}{i}" for i in range(n)]
        self.created: list[tuple[str, str]] = []
        try:
            self._build()
        except BaseException:
            self.remove()
            raise

    def _build(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.created.append(("link", self.bridge))
        sh("ip", "link", "set", self.bridge, "up")
        for i, (ns, link) in enumerate(zip(self.spaces, self.links, strict=True)):
            sh("ip", "netns", "add", ns)
            self.created.append(("netns", ns))
            sh("ip", "link", "add", link, "type", "veth", "peer", "name", self.inner(i))
            self.created.append(("link", link))
            sh("ip", "link", "set", self.inner(i), "netns", ns)
            sh("ip", "link", "set", link, "master", self.bridge)
            sh("ip", "link", "set", link, "up")
            run = ("ip", "netns", "exec", ns)
            sh(*run, "ip", "addr", "add", f"{self.addr(i)}/24", "dev", self.inner(i))
            sh(*run, "ip", "link", "set", self.inner(i), "up")
            sh(*run, "ip", "link", "set", "lo", "up")

    def inner(self, i: int) -> str:
        return f"{self.links[i]}p"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def cut(self, i: int) -> None:
        sh("ip", "link", "set", self.links[i], "down")

    def remove(self) -> None:
        for kind, name in reversed(self.created):
            cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(cmd, capture_output=True, timeout=30)
        self.created.clear()


@pytest.fixture
def net() -> Iterator[Net]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    probe = f"mnprobe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {result.stderr.decode().strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    network = Net(2)
    try:
        yield network
    finally:
        network.remove()


def test_cut_off_node_noticed_and_the_others_go_on_smaller(net: Net, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"{net.addr(0)}:29433")
    go = tmp_path / "go"  # workers train on until it exists, then 3 more steps
    try:
        for i, ns in enumerate(net.spaces):
            cluster.start(
                str(i), f"go={go}", "steps=3", nnodes="1:2", nproc=1, max_restarts=2,
                conf=f"is_host={int(i == 0)},{HEARTBEAT}", local_addr=net.addr(i),
                prefix=("ip", "netns", "exec", ns),
                extra_env={"GLOO_SOCKET_IFNAME": net.inner(i)},
            )  # fmt: skip
        cluster.wait_for(
            "both nodes training together",
            lambda: {r.node for r in cluster.steps() if r.world == 2} == {"0", "1"},
        )
        net.cut(1)  # node 0 hosts the store: node 1 is cut off from it and from node 0
        cluster.wait_for("node 0 training alone", lambda: cluster.steps("0")[-1].world == 1)
        go.touch()
        assert cluster.wait_exit("0") == 0, cluster.outputs()
        last = cluster.steps("0")[-1]
        assert (last.world, last.rank, last.total) == (1, 0, 1)
        names = [e.get("name") for e in cluster.events("0")]
        assert names.count("rendezvous_complete") >= 2, names
    finally:
        cluster.close()
