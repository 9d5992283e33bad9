"""The agents' snapshot exchange on loopback: a real server, real sockets, real files.

A copy is kept only when whole (its manifest one, its length and CRC-32 the
manifest's); a request of another job, a malformed request or answer is one clear
error; the puller copies its ring predecessor's newest snapshot, keeps the older copies
the predecessor still has, fetches a step written again with other bytes, and never
drops a copy its source does not have.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.snapshot_files import snapshot_bytes, write_snapshot
from multinode_support.waiting import wait_for
from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint._channel import Channel
from relaunch.checkpoint._fetch_choice import fetch_targets, two_timelines
from relaunch.checkpoint._peer_client import ack, fetch_step, list_steps
from relaunch.checkpoint._peer_server import SnapshotServer, held_steps
from relaunch.checkpoint._peers import PeerCopies, PeerRecord, PeerRound
from relaunch.checkpoint._wire import WireError
from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

pytestmark = pytest.mark.timeout(60)

JOB = "peers"


_snapshot = functools.partial(write_snapshot, job=JOB)
_data = snapshot_bytes


class Ring:
    """Nodes of one round sharing a real TCP store: ``nodes[g]`` serves ``roots[g]``."""

    def __init__(self, tmp: Path, names: tuple[str, ...]) -> None:
        self.server = TCPStoreServer(host="127.0.0.1", port=0)
        self.server.start()
        self.roots = [tmp / name for name in names]
        self.nodes = [PeerCopies(str(r), JOB, bind="127.0.0.1") for r in self.roots]
        self.stores = [TCPStoreClient("127.0.0.1", self.server.port, timeout=10) for _ in names]

    def start(self, group_rank: int, ranks: tuple[int, ...], round_number: int = 0) -> None:
        self.nodes[group_rank].round_started(
            PeerRound(
                self.stores[group_rank],
                round_number=round_number,
                group_rank=group_rank,
                world_size=len(self.nodes),
                ranks=ranks,
                addr="127.0.0.1",
            )
        )

    def start_all(self, round_number: int) -> None:
        """Every node starts the round at once, each on rank ``group rank``."""
        starts = [
            threading.Thread(target=self.start, args=(g, (g,), round_number))
            for g in range(len(self.nodes))
        ]
        for t in starts:
            t.start()
        for t in starts:
            t.join(30)

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        for store in self.stores:
            store.close()
        self.server.close()


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[Ring]:
    r = Ring(tmp_path, ("node0", "node1"))
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def source(tmp_path: Path):  # type: ignore[no-untyped-def]
    root = tmp_path / "source"
    root.mkdir()
    server = SnapshotServer(str(root), JOB, "127.0.0.1")
    try:
        with Channel("127.0.0.1", server.port) as peer:
            yield root, server, peer
    finally:
        server.close()


def test_a_snapshot_is_copied_whole_and_listed(source, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, _server, peer = source
    payload = os.urandom(3 << 20)
    _snapshot(root, 1, 7, b"old")
    _snapshot(root, 1, 8, payload)
    steps = list_steps(peer, JOB).steps
    assert steps == {1: [(8, zlib.crc32(payload)), (7, zlib.crc32(b"old"))]}
    into = tmp_path / "into"
    assert fetch_step(peer, JOB, 1, 8, str(into)) == len(payload)
    assert _data(into, 1, 8) == payload
    assert held_steps(str(into)) == {1: [(8, zlib.crc32(payload))]}


def test_a_copy_that_goes_lends_its_pages_to_the_next(source, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A successor's steady state: the copy of the step its predecessor dropped becomes
    the file of the next one (received into its pages), bigger or smaller; it is gone
    whether the next copy is kept or refused."""
    root, _server, peer = source
    into = tmp_path / "into"
    first, bigger = os.urandom(1 << 20), os.urandom(3 << 20)
    _snapshot(root, 1, 7, first)
    fetch_step(peer, JOB, 1, 7, str(into))
    _snapshot(root, 1, 8, bigger)
    assert fetch_step(peer, JOB, 1, 8, str(into), reuse=7) == len(bigger)
    assert _data(into, 1, 8) == bigger
    assert held_steps(str(into)) == {1: [(8, zlib.crc32(bigger))]}
    _snapshot(root, 1, 9, b"small")
    fetch_step(peer, JOB, 1, 9, str(into), reuse=8)
    assert _data(into, 1, 9) == b"small"
    assert held_steps(str(into)) == {1: [(9, zlib.crc32(b"small"))]}
    _snapshot(root, 1, 10, b"x" * 1000)
    path = os.path.join(layout.step_dir(layout.rank_dir(str(root), 1), 10), layout.DATA)
    with open(path, "r+b") as f:  # changed after its manifest: refused
        f.write(b"y")
    with pytest.raises(WireError, match="CRC-32"):
        fetch_step(peer, JOB, 1, 10, str(into), reuse=9)
    assert held_steps(str(into)) == {}
    assert [p.name for p in into.rglob("*") if p.is_file()] == []


def test_a_copy_whose_bytes_do_not_match_is_not_kept(source, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, _server, peer = source
    _snapshot(root, 0, 3, b"x" * 1000)
    path = os.path.join(layout.step_dir(layout.rank_dir(str(root), 0), 3), layout.DATA)
    with open(path, "r+b") as f:  # the bytes change after the manifest was written
        f.write(b"y")
    into = tmp_path / "into"
    with pytest.raises(WireError, match="CRC-32"):
        fetch_step(peer, JOB, 0, 3, str(into))
    assert held_steps(str(into)) == {}
    assert not any(p.name.startswith(".partial") for p in into.rglob("*"))


def test_another_job_and_bad_requests_are_refused_clearly(source, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, server, peer = source
    _snapshot(root, 0, 3, b"abc")
    with pytest.raises(WireError, match="job: expected 'peers', got 'other'"):
        list_steps(peer, "other")
    with pytest.raises(WireError, match="no snapshot of rank 0 at step 4"):
        fetch_step(peer, JOB, 0, 4, str(tmp_path / "into"))
    for line, said in (
        (b"not json\n", "not JSON"),
        (b'{"v": 2, "job": "peers", "op": "list"}\n', "v: expected 1"),
        (b'{"v": 1, "job": "peers", "op": "get", "rank": -1, "step": 0}\n', "rank: expected"),
        (b'{"v": 1, "job": "peers", "op": "drop"}\n', "op: expected"),
        (b'{"v": 1, "job": "peers", "op": "ack", "rank": 0, "step": 3}\n', "crc: expected"),
        (b"x" * 5000, "longer than 4096"),
    ):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(line)
            answer = sock.makefile("rb").readline()
        assert b'"ok":false' in answer and said.encode() in answer, (line[:40], answer)
    # the server still serves
    assert list_steps(peer, JOB)[0] == {0: [(3, zlib.crc32(b"abc"))]}


def test_one_connection_carries_a_peer_s_requests_while_it_serves(tmp_path: Path) -> None:
    """A save's five questions go on one connection, not one each; a connection the
    server closed (idle past its timeout) or one whose answer was refused is never used
    again: the next request opens another."""
    root = tmp_path / "source"
    _snapshot(root, 0, 3, b"abc")
    crc = zlib.crc32(b"abc")
    server = SnapshotServer(str(root), JOB, "127.0.0.1", idle_timeout=0.5)
    try:
        with Channel("127.0.0.1", server.port) as peer:
            for _ in range(3):
                assert list_steps(peer, JOB).steps == {0: [(3, crc)]}
            assert fetch_step(peer, JOB, 0, 3, str(tmp_path / "into")) == 3
            ack(peer, JOB, 0, 3, crc)
            assert peer.connections == 1
            # quiet past the server's idle timeout: it closes its end
            wait_for(lambda: server.open_connections == 0, 20, what="the idle connection closed")
            assert list_steps(peer, JOB).steps == {0: [(3, crc)]}
            assert peer.connections == 2
            with pytest.raises(WireError, match="no snapshot of rank 0 at step 4"):
                fetch_step(peer, JOB, 0, 4, str(tmp_path / "into"))
            assert list_steps(peer, JOB).steps == {0: [(3, crc)]}
            assert peer.connections == 3
    finally:
        server.close()


def test_a_node_of_many_workers_keeps_a_connection_for_each(tmp_path: Path) -> None:
    """``--nproc-per-node cpu`` on a big machine: a hundred workers each keep their
    connection to the agent, and its successor's puller is served beside them."""
    root = tmp_path / "source"
    root.mkdir()
    server = SnapshotServer(str(root), JOB, "127.0.0.1")
    workers = [Channel("127.0.0.1", server.port) for _ in range(100)]
    try:
        for worker in workers:
            assert list_steps(worker, JOB).steps == {}
        with Channel("127.0.0.1", server.port) as puller:
            assert list_steps(puller, JOB).steps == {}
        assert server.open_connections >= 100
    finally:
        for worker in workers:
            worker.close()
        server.close()


def test_a_server_that_closes_ends_its_open_connections(tmp_path: Path) -> None:
    """The agent's end does not wait for its peers' and workers' idle connections."""
    root = tmp_path / "source"
    root.mkdir()
    server = SnapshotServer(str(root), JOB, "127.0.0.1")
    with Channel("127.0.0.1", server.port) as peer:
        assert list_steps(peer, JOB).steps == {}
        server.close()
        serving = [t for t in threading.enumerate() if t.name.startswith("relaunch-snapshot")]
        assert serving == []
        with pytest.raises(OSError):
            list_steps(peer, JOB)


def test_a_node_s_listing_says_while_it_fetches_its_ranks(source) -> None:  # type: ignore[no-untyped-def]
    """Its successor mirrors none of its snapshots meanwhile (its ranks' may be of a
    timeline the job left, the copies it is fetching the job's); the end of the fetch
    answers the successor's long poll at once."""
    root, server, peer = source
    _snapshot(root, 0, 3, b"abc")
    first = list_steps(peer, JOB)
    assert first.settled
    with server.settling():
        assert not list_steps(peer, JOB).settled
    after = list_steps(peer, JOB, since=first.version)
    assert after.settled and after.version > first.version
    assert after.steps == {0: [(3, zlib.crc32(b"abc"))]}


def test_a_corrupt_peer_record_names_its_key() -> None:
    with pytest.raises(WireError, match="k/1: port: expected 1-65535"):
        PeerRecord.from_bytes(b'{"v":1,"addr":"h","port":0,"ranks":[1]}', "k/1")
    with pytest.raises(WireError, match="k/1: ranks"):
        PeerRecord.from_bytes(b'{"v":1,"addr":"h","port":5,"ranks":[true]}', "k/1")
    assert PeerRecord.from_bytes(PeerRecord("h", 5, (2, 3)).to_bytes(), "k") == PeerRecord(
        "h", 5, (2, 3)
    )


def test_the_successor_copies_its_predecessor_s_newest(ring: Ring) -> None:
    roots, nodes = ring.roots, ring.nodes
    _snapshot(roots[0], 0, 1, b"one")
    _snapshot(roots[0], 0, 2, b"two")
    ring.start(0, (0,))
    ring.start(1, (1,))

    def mirrored(want: dict[int, bytes]) -> bool:
        held = dict(held_steps(str(roots[1])).get(0, []))
        return held == {s: zlib.crc32(d) for s, d in want.items()}

    # only the newest moves (the source reuses the older one's file for its next save)
    wait_for(lambda: mirrored({2: b"two"}), 20, what="node 1's copy")
    # a newer step: both copies stay while the source has both
    _snapshot(roots[0], 0, 3, b"three")
    layout.prune(layout.rank_dir(str(roots[0]), 0), 2)
    wait_for(lambda: mirrored({2: b"two", 3: b"three"}), 20, what="the newest copies")
    # a restore dropped step 3; the job wrote step 3 again, with other bytes
    layout.discard_newer(layout.rank_dir(str(roots[0]), 0), 2)
    _snapshot(roots[0], 0, 3, b"three, again")
    wait_for(lambda: mirrored({2: b"two", 3: b"three, again"}), 20, what="the new step 3")
    # the source loses everything (its node was replaced): the copies stay
    layout.discard_newer(layout.rank_dir(str(roots[0]), 0), None)
    seen = nodes[1].pulls
    wait_for(lambda: nodes[1].pulls >= seen + 2, 10, what="two pulls of the empty source")
    assert mirrored({2: b"two", 3: b"three, again"})


def test_a_node_fetches_the_ranks_it_lacks_before_its_workers_start(ring: Ring) -> None:
    holder, newcomer = ring.roots
    _snapshot(holder, 1, 41, b"older")
    _snapshot(holder, 1, 42, b"rank one at 42")  # a copy of a lost node's rank
    _snapshot(holder, 0, 42, b"rank zero")
    ring.start(0, (0,))
    ring.start(1, (1,))
    assert ring.nodes[1].fetched == {1: 42}
    assert _data(newcomer, 1, 42) == b"rank one at 42"


def test_a_lost_node_s_ranks_are_fetched_at_one_step(ring: Ring) -> None:
    """The lost node's ranks had their copies made one by one: rank 1's newest is a
    step ahead of rank 0's. Each rank's newest alone gave the newcomer no step in common
    between them (every rank then restored nothing, a fresh start): both come at 155."""
    holder, newcomer = ring.roots
    _snapshot(holder, 0, 154, b"r0 154")
    _snapshot(holder, 0, 155, b"r0 155")
    _snapshot(holder, 1, 155, b"r1 155")
    _snapshot(holder, 1, 156, b"r1 156")
    _snapshot(holder, 2, 156, b"the holder's own rank")
    ring.start(0, (2,))
    ring.start(1, (0, 1))
    assert ring.nodes[1].fetched == {0: 155, 1: 155}
    assert _data(newcomer, 1, 155) == b"r1 155"


def test_the_steps_fetched_are_one_every_rank_has() -> None:
    assert fetch_targets([0, 1], {}, {0: {154, 155}, 1: {155, 156}}) == {0: 155, 1: 155}
    # held here already: only what is missing moves
    assert fetch_targets([0, 1], {0: {155}}, {0: {155}, 1: {155, 156}}) == {1: 155}
    # nothing in common: each rank's newest, when newer than any here
    assert fetch_targets([0, 1], {1: {9}}, {0: {3}, 1: {7}}) == {0: 3}
    assert fetch_targets([0], {}, {}) == {}
    # the round's other ranks stopped a step behind the newest copy: the step they hold
    assert fetch_targets([0, 1], {}, {0: {163, 164}, 1: {163, 164}}, {2: {161, 162, 163}}) == {
        0: 163,
        1: 163,
    }
    # none they hold: the newest these ranks share
    assert fetch_targets([0], {}, {0: {9}}, {2: {5}}) == {0: 9}


def test_a_node_that_sat_out_a_round_fetches_its_ranks_again(ring: Ring) -> None:
    """A node runs rank 1, waits as a spare while another node runs it (round 1), and
    runs it again (round 2): its own snapshots of rank 1 are old, the holder's are the
    job's (before, the same ranks as its last round meant no fetch: every rank then
    restored nothing in common, a fresh start)."""
    holder, back = ring.roots
    _snapshot(back, 1, 5, b"rank one at 5, this node's own")
    _snapshot(holder, 0, 5, b"rank zero at 5")
    ring.start(0, (0,), round_number=0)
    ring.start(1, (1,), round_number=0)
    assert ring.nodes[1].fetched == {}
    _snapshot(holder, 0, 9, b"rank zero at 9")
    _snapshot(holder, 1, 9, b"rank one at 9, from the node that ran it in round 1")
    ring.start(0, (0,), round_number=2)
    ring.start(1, (1,), round_number=2)
    assert ring.nodes[1].fetched == {1: 9}
    assert _data(back, 1, 9) == b"rank one at 9, from the node that ran it in round 1"
    ring.start(1, (1,), round_number=3)  # the round after one it ran: its own are the newest
    assert ring.nodes[1].fetched == {}


@pytest.mark.parametrize("newest", [10, 9])
def test_a_node_that_sat_out_a_restore_drops_the_steps_the_job_wrote_again(
    tmp_path: Path, newest: int
) -> None:
    """Node "back" ran rank 1 to step 9 and sat out while the job restored step 8 (no
    copy of step 9 was made yet) and wrote step 9 again (and 10). Back on rank 1, its old
    step 9 had the step number of the job's: kept, load() restored step 9 from two
    timelines (the job's on rank 0, the old one on rank 1) once it was the newest step
    the round shared. Node "third", back's successor, mirrored back's old step 9 before
    the restore: a step two nodes hold with other bytes is fetched from neither."""
    ring = Ring(tmp_path, ("holder", "back", "third"))
    holder, back, third = ring.roots
    try:
        _snapshot(back, 1, 8, b"rank one at 8")
        _snapshot(back, 1, 9, b"rank one at 9, before the restore")
        _snapshot(third, 1, 9, b"rank one at 9, before the restore")
        ring.start_all(round_number=0)
        for step in range(8, newest + 1):
            for rank in (0, 2):
                _snapshot(holder if rank == 0 else third, rank, step, b"r%d at %d" % (rank, step))
            if step > 8:
                _snapshot(holder, 1, step, b"rank one at %d, after the restore" % step)
        ring.start_all(round_number=2)
        want = {10: {1: 10}, 9: {}}[newest]  # 9: the others' copies disagree, 8 is here
        assert ring.nodes[1].fetched == want
        held = dict(held_steps(str(back))[1])
        assert 9 not in held and 8 in held
        if newest == 10:
            assert _data(back, 1, 10) == b"rank one at 10, after the restore"
    finally:
        ring.close()


def test_a_step_of_two_timelines_is_never_taken() -> None:
    held_here = {1: {8: 0x88, 9: 0x99}, 2: {9: 0x22}}
    # rank 1 not run here in the round before: its step 9 elsewhere has other bytes
    assert two_timelines(held_here, {(1, 9): {0x10}, (2, 9): {0x10}}, ran=(2,)) == (
        {(1, 9)},
        set(),
    )
    # run here in the round before: this node's are the job's
    assert two_timelines(held_here, {(1, 9): {0x10}}, ran=(1,)) == (set(), set())
    # the others disagree: fetched from none, and this node's goes too
    assert two_timelines(held_here, {(1, 9): {0x99, 0x10}, (1, 7): {1, 2}}, ran=()) == (
        {(1, 9)},
        {(1, 9), (1, 7)},
    )
    # the same bytes elsewhere: kept
    assert two_timelines(held_here, {(1, 8): {0x88}}, ran=()) == (set(), set())


def test_a_pull_of_a_past_round_leaves_the_ranks_this_node_now_runs(ring: Ring) -> None:
    """Node 1 copied node 0's rank 0; the next round gives node 1 rank 0, and its
    worker saves step 32. A pull of the past round still in flight (its long poll
    answered before the round changed) mirrored node 0's rank 0 and deleted step 32:
    the successor never acked it and the workers waited (up to 15 s) for that ack."""
    first, second = ring.roots
    _snapshot(first, 0, 31, b"rank zero at 31")
    ring.start(0, (0,), round_number=0)
    ring.start(1, (1,), round_number=0)
    wait_for(lambda: 31 in dict(held_steps(str(second)).get(0, [])), 20, what="the copy")
    past = ring.nodes[1]._round
    assert past is not None
    source = PeerRecord("127.0.0.1", ring.nodes[0].port, (0,))
    ring.start(0, (1,), round_number=1)
    ring.start(1, (0,), round_number=1)
    _snapshot(second, 0, 32, b"rank zero at 32, this node's worker's")
    ring.nodes[1]._pull(past, source, None)
    assert 32 in dict(held_steps(str(second)).get(0, []))


def test_a_worker_s_snapshot_counts_once_its_successor_holds_a_copy(ring: Ring) -> None:
    roots, nodes = ring.roots, ring.nodes
    agent = Channel("127.0.0.1", nodes[0].port)  # as a worker asks: one connection

    def worker(op: str, step: int, crc: int = 0) -> dict[str, object]:
        doc = {"job": JOB, "op": op, "rank": 0, "step": step, "crc": crc}
        return json.loads(agent.ask(doc, 10.0))  # type: ignore[no-any-return]

    ring.start(0, (0,))
    _snapshot(roots[0], 0, 5, b"five")
    # the successor has not started its round: the worker is told to wait for it
    assert worker("saved", 5)["peer"] is True
    ring.start(1, (1,))
    wait_for(
        lambda: worker("wait_ack", 5, zlib.crc32(b"five"))["acked"] is True,
        20,
        what="node 1's ack of step 5",
    )
    assert _data(roots[1], 0, 5) == b"five"
    # the successor is gone: after a few seconds without its polls, no one waits
    nodes[1].close()
    wait_for(
        lambda: worker("wait_ack", 6, 0) == {"v": 1, "ok": True, "acked": False, "peer": False},
        20,
        what="the successor counted as gone",
    )
    agent.close()


def test_a_node_that_replaced_the_predecessor_in_its_round_is_pulled(
    ring: Ring, tmp_path: Path
) -> None:
    """Node tier: node 0 is lost and a spare takes its group rank in the running round
    (same round number). Its successor pulls the spare's new snapshots in that round,
    not only from the next one on (until then, losing the spare lost them)."""
    first, second = ring.roots
    _snapshot(first, 0, 5, b"rank zero at 5")
    ring.start(0, (0,))
    ring.start(1, (1,))
    wait_for(lambda: 5 in dict(held_steps(str(second)).get(0, [])), 20, what="the copy of 5")
    ring.nodes[0].close()  # lost: its server is gone
    spare_root = tmp_path / "spare"
    spare = PeerCopies(str(spare_root), JOB, bind="127.0.0.1")
    store = TCPStoreClient("127.0.0.1", ring.server.port, timeout=10)
    try:
        seat = PeerRound(
            store, round_number=0, group_rank=0, world_size=2, ranks=(0,), addr="127.0.0.1"
        )
        spare.round_started(seat)
        assert spare.fetched == {0: 5}  # from the successor, before its workers start
        _snapshot(spare_root, 0, 6, b"rank zero at 6, the spare's worker's")
        wait_for(lambda: 6 in dict(held_steps(str(second)).get(0, [])), 20, what="the copy of 6")
        assert _data(second, 0, 6) == b"rank zero at 6, the spare's worker's"
    finally:
        spare.close()
        store.close()


def test_the_folders_of_ranks_no_longer_run_here_go_once_this_node_saved_past_them(
    ring: Ring,
) -> None:
    """A past world's rank (the world shrank) held node memory for the rest of the job:
    it goes once this node's ranks saved past its newest step; the predecessor's copies
    stay."""
    first, second = ring.roots
    _snapshot(first, 0, 3, b"rank zero at 3")
    _snapshot(second, 5, 7, b"a past world's rank 5 at 7")
    _snapshot(second, 1, 6, b"rank one at 6, this node's own")
    ring.start(0, (0,))
    ring.start(1, (1,))
    wait_for(lambda: 3 in dict(held_steps(str(second)).get(0, [])), 20, what="the copy")
    assert 5 in held_steps(str(second))  # newer than what this node's rank saved
    _snapshot(second, 1, 8, b"rank one at 8")
    wait_for(lambda: 5 not in held_steps(str(second)), 20, what="the past rank's folder gone")
    assert sorted(held_steps(str(second))) == [0, 1]
