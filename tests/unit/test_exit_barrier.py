"""The exit barrier's ends, on an in-memory store (pure logic: the multi-node behaviour
is tested with real agents in tests/faults/test_multinode_faults.py)."""

from __future__ import annotations

import pytest

from relaunch.agent._round import BarrierEnd, exit_barrier
from relaunch.rendezvous import RendezvousInfo
from relaunch.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(30)

COUNT = "relaunch/exit_barrier/count"


def _info(store: MemoryStore, world_size: int = 3) -> RendezvousInfo:
    return RendezvousInfo(store=store, rank=1, world_size=world_size, round=0)


def test_every_node_arrived_passes() -> None:
    store = MemoryStore()
    store.add(COUNT, 2)
    assert exit_barrier(_info(store), 5.0) is BarrierEnd.PASSED


@pytest.mark.parametrize("end", [BarrierEnd.ROUND_ENDED, BarrierEnd.CLOSED])
def test_a_round_over_without_the_others_ends_the_wait(end: BarrierEnd) -> None:
    store = MemoryStore()
    assert exit_barrier(_info(store), 30.0, over=lambda: end) is end


def test_the_last_node_arriving_as_the_job_closes_is_a_pass() -> None:
    # The last node arrives and rank 0, past the barrier, closes the job, between this
    # node's look at the count and its look at the rendezvous: it passes, too.
    store = MemoryStore()
    store.add(COUNT, 1)

    def closed_meanwhile() -> BarrierEnd:
        store.add(COUNT, 1)
        return BarrierEnd.CLOSED

    assert exit_barrier(_info(store), 30.0, over=closed_meanwhile) is BarrierEnd.PASSED


def test_no_answer_within_the_timeout() -> None:
    assert exit_barrier(_info(MemoryStore()), 0.2) is BarrierEnd.TIMED_OUT
