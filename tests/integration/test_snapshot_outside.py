"""A fetch before the workers start reaches the last round's nodes outside this one.

The case seen in ``bench/goodput.py``: a node's workers finished and waited at the exit
barrier when the other node was lost; the two spares took both places of the next
round, and the node at the barrier, which held the only copies of every rank's newest
steps, waited outside it (since, a round started again holds its nodes' seats for
``last_call_timeout``: a node back later still finds the spares in them). Asked only,
the round's nodes had nothing: every rank started afresh. Real servers and sockets on
loopback, a real TCP store.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.snapshot_files import snapshot_bytes, write_snapshot
from relaunch.checkpoint._fetch import OUTSIDE_MOST, _Seen
from relaunch.checkpoint._fetch_choice import short_of
from relaunch.checkpoint._peers import PeerCopies, PeerRecord, PeerRound
from relaunch.store import PrefixStore
from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

pytestmark = pytest.mark.timeout(60)

JOB = "outside"


_snapshot = functools.partial(write_snapshot, job=JOB)
_data = snapshot_bytes


class Job:
    """Nodes sharing a real TCP store: each a :class:`PeerCopies` serving its folder."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server = TCPStoreServer(host="127.0.0.1", port=0)
        self.server.start()
        self.store = TCPStoreClient("127.0.0.1", self.server.port, timeout=10)
        self.nodes: dict[str, PeerCopies] = {}

    def root(self, name: str) -> Path:
        return self.tmp / name

    def node(self, name: str) -> PeerCopies:
        if name not in self.nodes:
            self.nodes[name] = PeerCopies(str(self.root(name)), JOB, bind="127.0.0.1")
        return self.nodes[name]

    def round_store(self, number: int) -> PrefixStore:
        return PrefixStore(self.store, f"round/{number}/")

    def round(self, number: int, seats: dict[str, tuple[int, ...]]) -> None:
        """Every node of ``seats`` (in group-rank order) starts round ``number`` at once."""
        store = self.round_store(number)
        earlier = tuple(self.round_store(n) for n in (number - 1, number - 2) if n >= 0)

        def start(g: int, name: str, ranks: tuple[int, ...]) -> None:
            seat = PeerRound(store, number, g, len(seats), ranks, "127.0.0.1", earlier=earlier)
            self.node(name).round_started(seat)

        threads = [
            threading.Thread(target=start, args=(g, name, ranks))
            for g, (name, ranks) in enumerate(seats.items())
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    def lose(self, name: str) -> None:
        """The node's machine is gone: its server with it."""
        self.nodes.pop(name).close()

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()
        self.store.close()
        self.server.close()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path)
    try:
        yield j
    finally:
        j.close()


@pytest.mark.parametrize("copied", [9, 8])
def test_the_spares_fetch_every_rank_from_the_node_at_the_barrier(job: Job, copied: int) -> None:
    """Round 0: "done" runs rank 0, "lost" rank 1; "done" holds its own steps 8 and 9
    and the copies of rank 1 up to ``copied``. "lost" goes (its server too), and the two
    spares take both places of round 1 while "done" waits outside it: each fetches its
    rank from "done", at the step both ranks have (8 when the copy of 9 was not made)."""
    job.round(0, {"done": (0,), "lost": (1,)})
    done = job.root("done")
    for step in (8, 9):
        _snapshot(done, 0, step, b"rank 0 at %d" % step)
    for step in range(copied - 1, copied + 1):
        _snapshot(done, 1, step, b"rank 1 at %d" % step)
    job.lose("lost")  # a node of round 0 whose server no longer answers
    job.round(1, {"spare1": (0,), "spare2": (1,)})
    want = min(9, copied)
    assert job.nodes["spare1"].fetched == {0: want}
    assert job.nodes["spare2"].fetched == {1: want}
    assert _data(job.root("spare1"), 0, want) == b"rank 0 at %d" % want
    assert _data(job.root("spare2"), 1, want) == b"rank 1 at %d" % want


def test_nodes_outside_the_round_are_not_asked_when_the_round_holds_what_it_needs(
    job: Job,
) -> None:
    """A lost node's address may answer nothing for seconds (its machine is gone): the
    round's nodes hold every rank's newest step, so no node outside it is asked."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    silent.setblocking(False)
    try:
        job.round(0, {"a": (0,), "b": (1,)})
        gone = PeerRecord("127.0.0.1", silent.getsockname()[1], (2,))  # a third node's
        job.round_store(0).set("relaunch/snapshot_peer/2", gone.to_bytes())
        _snapshot(job.root("a"), 0, 5, b"rank 0 at 5")
        _snapshot(job.root("a"), 1, 5, b"rank 1 at 5, a's copy")
        job.lose("b")
        job.round(1, {"a": (0,), "spare": (1,)})
        assert job.nodes["spare"].fetched == {1: 5}
        with pytest.raises(BlockingIOError):
            silent.accept()  # nobody connected
        job.round_store(1).set("relaunch/snapshot_peer/2", gone.to_bytes())  # round 1's too
        job.round(2, {"a": (0,), "spare": (1,), "spare2": (2,)})  # rank 2: nowhere here
        assert job.nodes["spare2"].fetched == {}
        conn, _ = silent.accept()  # short: the last round's node outside this one was asked
        conn.close()
    finally:
        silent.close()


def test_a_step_held_with_other_bytes_anywhere_is_not_offered_from_outside() -> None:
    """A node outside the round may hold a step of a timeline the job left: a step of
    this node's ranks that any node (of the round, outside it, this one) holds with other
    bytes is not offered from outside; the others are. Nor is a step with two CRCs
    counted as one the round's other ranks can restore."""
    seen = _Seen()
    inside = PeerRecord("10.0.0.1", 1, (0,))
    out1, out2 = PeerRecord("10.0.0.2", 2, ()), PeerRecord("10.0.0.3", 3, ())
    seen.add(inside, {1: [(9, 0xA)], 0: [(9, 0x1), (10, 0x2)]}, mine=(1, 3))
    seen.runners[0] = set()  # rank 0's node holds none: it fetches too
    seen.hold({3: [(5, 0xF)]})  # this node's own
    seen.add_outside(
        [
            (out1, {1: [(9, 0xB), (10, 0xC)], 3: [(4, 0xD), (5, 0xE)], 0: [(10, 0x3)]}),
            (out2, {1: [(11, 0x5)], 3: [(4, 0xD)]}),
        ],
        mine=(1, 3),
    )
    assert seen.offers == {1: {9: [inside], 10: [out1], 11: [out2]}, 3: {4: [out1, out2]}}
    assert seen.others() == {0: {9}}  # step 10 of rank 0: two CRCs
    assert seen.outside == {("10.0.0.2", 2), ("10.0.0.3", 3)}


def test_the_round_is_short_when_a_rank_has_nothing_or_no_step_is_common() -> None:
    # this node's rank 0 is held in the round, the other rank's node holds step 5
    assert not short_of([0], {}, {0: {4, 5}}, {1: {5}})
    # nothing anywhere in the round for a rank of this node, or for another's
    assert short_of([0], {}, {}, {1: {5}})
    assert short_of([0], {}, {0: {5}}, {1: set()})
    # every rank has some, but no step in common
    assert short_of([0, 1], {0: {3}}, {1: {7}}, {})
    # a round with no ranks to restore
    assert not short_of([], {}, {}, {})


def test_the_nodes_that_ran_a_rank_are_asked_first_when_many_are_outside(job: Job) -> None:
    """A large round before this one: 40 nodes, of which only the one at group rank 35
    still answers, holding rank 35's snapshot. A fetch asks at most ``OUTSIDE_MOST``
    (32) nodes outside the round: the node that ran the rank (and its ring successor)
    come first, not the lowest group ranks. (The round's other node holds rank 36.)"""
    assert OUTSIDE_MOST < 35
    done = job.node("done")
    _snapshot(job.root("done"), 35, 7, b"rank 35 at 7")
    _snapshot(job.root("other"), 36, 7, b"rank 36 at 7")
    gone = socket.socket()  # a port that refuses: the machines of the others are gone
    gone.bind(("127.0.0.1", 0))
    refused = gone.getsockname()[1]
    gone.close()
    past = job.round_store(0)
    for g in range(40):
        port = done.port if g == 35 else refused
        past.set(f"relaunch/snapshot_peer/{g}", PeerRecord("127.0.0.1", port, (g,)).to_bytes())
    job.round(1, {"spare": (35,), "other": (36,)})
    assert job.nodes["spare"].fetched == {35: 7}
    assert _data(job.root("spare"), 35, 7) == b"rank 35 at 7"
