"""Issue 3 acceptance, c10d TCP store: real ``relaunch`` agents as separate processes.

Each node is ``python -m relaunch`` with its own log dir; its workers are small gloo
all_reduce jobs that write one line per step (see ``tests/multinode_support``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.cluster import Cluster, free_port
from multinode_support.ports import ipv6_loopback

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def c10d(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"127.0.0.1:{free_port()}")
    try:
        yield cluster
    finally:
        cluster.close()


def test_two_nodes_train_at_world_four(c10d: Cluster) -> None:
    c10d.start("a", "steps=3", conf="is_host=1")
    c10d.start("b", "steps=3", conf="is_host=0")
    assert c10d.wait_exit("a") == 0, c10d.outputs()
    assert c10d.wait_exit("b") == 0, c10d.outputs()
    rows = c10d.steps()
    assert {r.world for r in rows} == {4}
    assert {r.total for r in rows} == {1 + 2 + 3 + 4}  # every rank 0..3 in the all_reduce
    ranks = {r.rank for r in rows}
    assert ranks == {0, 1, 2, 3}
    by_node = {n: {r.rank for r in rows if r.node == n} for n in ("a", "b")}
    assert len(by_node["a"]) == len(by_node["b"]) == 2
    assert not by_node["a"] & by_node["b"]
    # the ranks of one node are contiguous (group rank * 2 + local rank)
    assert all(max(s) - min(s) == 1 and min(s) % 2 == 0 for s in by_node.values())
    assert {r.restart for r in rows} == {0}


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_two_nodes_on_ipv6_addresses_train(tmp_path: Path) -> None:
    """Nodes whose addresses are IPv6: the workers' store and the snapshot server listen
    on ``::`` (before: on 0.0.0.0, IPv4 only, while the IPv6 address was published, and
    the workers waited for a store they could not reach until they timed out)."""
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"[::1]:{free_port()}")
    try:
        cluster.start("a", "steps=3", conf="is_host=1", local_addr="::1")
        cluster.start("b", "steps=3", conf="is_host=0", local_addr="::1")
        assert cluster.wait_exit("a") == 0, cluster.outputs()
        assert cluster.wait_exit("b") == 0, cluster.outputs()
        rows = cluster.steps()
        assert {r.world for r in rows} == {4}
        assert {r.total for r in rows} == {1 + 2 + 3 + 4}
        assert "cannot list" not in cluster.outputs()  # the peers' snapshot servers answer
    finally:
        cluster.close()


def test_late_node_admitted_at_the_next_round_without_a_restart(c10d: Cluster) -> None:
    c10d.start("a", "until_world=4", "steps=3", nnodes="1:2", conf="is_host=1")
    c10d.wait_for("node a training alone", lambda: len(c10d.steps("a")) >= 4)
    alone = c10d.steps("a")
    assert {r.world for r in alone} == {2}  # 1 node x 2 workers
    assert {r.total for r in alone} == {1 + 2}
    c10d.start("b", "until_world=4", "steps=3", nnodes="1:2", conf="is_host=0")
    assert c10d.wait_exit("a") == 0, c10d.outputs()
    assert c10d.wait_exit("b") == 0, c10d.outputs()
    rows = c10d.steps()
    big = [r for r in rows if r.world == 4]
    assert {r.node for r in big} == {"a", "b"}
    assert {r.rank for r in big} == {0, 1, 2, 3}
    assert {r.total for r in big} == {10}
    # admitted without spending a restart: TORCHELASTIC_RESTART_COUNT stays 0 everywhere
    assert {r.restart for r in rows} == {0}
    assert not [e for e in c10d.events("a") if e.get("event") in ("restart", "workers_failed")]
