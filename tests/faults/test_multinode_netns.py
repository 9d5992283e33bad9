"""Issue 3 acceptance: real ``relaunch`` agents in network namespaces of their own.

Each agent runs in its own ``ip netns`` with a veth pair into a bridge, on its own
address (``--local-addr``); node 0 hosts the c10d store. Once both train
together, one node's link is set down: the others notice it by heartbeat and go on
at the smaller size, and the node cut off ends on its own. Needs root (CAP_NET_ADMIN); skipped with the reason otherwise.
Works from inside a loopback-only namespace (``unshare -n``). Everything created is
removed, even on failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.cluster import Cluster
from multinode_support.netns import Net, network

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]

HEARTBEAT = "keep_alive_interval=0.25,keep_alive_max_attempt=8"


@pytest.fixture
def net() -> Iterator[Net]:
    with network(2, tag="mn", octet=214) as created:
        yield created


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
        # the node cut off ends on its own: its store's host fell silent (no close ever
        # came), which its connection notices within the heartbeat timeout, not at the
        # store's 60 s read timeout; it stops its workers and says why in one line
        assert cluster.wait_exit("1", timeout=45) == 1, cluster.outputs()
        out = cluster.output("1")
        assert "the node hosting the c10d rendezvous store was lost, or this node's link" in out
    finally:
        cluster.close()
