"""The static backend's store, hosted by node 0: once node 0 is gone, a call of another
node fails at once, every time, whichever of the node's threads met the break first."""

from __future__ import annotations

import pytest

from multinode_support.ports import free_port
from relaunch.errors import StoreError
from relaunch.rendezvous.static import StaticRendezvousHandler


@pytest.mark.timeout(60)
def test_after_node_0_is_gone_no_call_of_another_node_waits_for_the_join_timeout() -> None:
    # A node's snapshot puller met the broken connection first; the agent's next call
    # then retried connecting for the join timeout (600 s) while the job was ending:
    # seen in CI (test_restart_budget_is_the_jobs_and_every_node_reports_the_root_cause).
    port = free_port()
    common = {"run_id": "job", "host": "127.0.0.1", "port": port, "num_nodes": 2}
    node0 = StaticRendezvousHandler(node_rank=0, bind_host="127.0.0.1", **common)
    node1 = StaticRendezvousHandler(node_rank=1, **common)
    try:
        assert node1.num_nodes_waiting() == 0
        node0.shutdown()
        for _ in range(2):  # the first meets the break, the second reconnects, in vain
            with pytest.raises(StoreError):
                node1.num_nodes_waiting()
    finally:
        node1.shutdown()
        node0.shutdown()
