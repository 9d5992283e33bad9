"""Several handlers in threads over the in-memory store: the real I/O loop, no sleeps."""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest

from multinode_support.waiting import wait_for
from relaunch.errors import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous.api import RendezvousInfo
from relaunch.rendezvous.handler import DynamicRendezvousHandler
from relaunch.store.memory import MemoryStore

T = TypeVar("T")


@pytest.fixture
def store() -> Iterator[MemoryStore]:
    store = MemoryStore()
    yield store
    store.close()
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("relaunch-rdzv")]
    assert leftover == []


def make(store: MemoryStore, lo: int, hi: int, **kw: float) -> DynamicRendezvousHandler:
    conf: dict[str, float] = {
        "last_call_timeout": 0.2,
        "keep_alive_interval": 0.1,
        "keep_alive_max_attempt": 10,
        "join_timeout": 30.0,
    }
    conf.update(kw)
    settings = RendezvousSettings(run_id="job", min_nodes=lo, max_nodes=hi, **conf)  # type: ignore[arg-type]
    return DynamicRendezvousHandler(
        backend="memory", store=store, settings=settings, owns_store=False
    )


def together(*calls: Callable[[], T]) -> list[T]:
    with ThreadPoolExecutor(len(calls), thread_name_prefix="test-rdzv") as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result(timeout=60) for f in futures]


def until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    wait_for(check, timeout, interval=0.01)


def shut(*handlers: DynamicRendezvousHandler) -> None:
    for h in handlers:
        assert h.shutdown()


def test_full_round_completes_with_distinct_ranks(store: MemoryStore) -> None:
    hs = [make(store, 3, 3, last_call_timeout=600.0) for _ in range(3)]
    infos = together(*(h.next_rendezvous for h in hs))
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {(i.world_size, i.round) for i in infos} == {(3, 0)}
    infos[0].store.set("x", b"1")
    assert infos[2].store.get("x") == b"1"
    assert store.get("relaunch/rdzv/job/round/0/x") == b"1"
    assert all(h.num_nodes_waiting() == 0 for h in hs)
    shut(*hs)


class _ReadsRecorded(MemoryStore):
    """The in-memory store, recording the keys read one at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[str] = []

    def get(self, key: str) -> bytes | None:
        self.read.append(key)
        return super().get(key)


def test_nodes_that_start_together_learn_their_places_from_their_acks() -> None:
    # the node with the first ticket waits (a tenth of a keep-alive interval at a time)
    # for the requests that come while its batch cannot complete the round: one batch,
    # whose acks carry every node's place; nobody reads its assignment
    # (2 s slices: a thread that starts late on a loaded machine still makes it)
    store = _ReadsRecorded()
    hs = [make(store, 4, 4, keep_alive_interval=20.0, last_call_timeout=600.0) for _ in range(4)]
    try:
        infos = together(*(h.next_rendezvous for h in hs))
        assert sorted(i.rank for i in infos) == [0, 1, 2, 3]
        assert [k for k in store.read if "/assign/" in k] == []
    finally:
        try:
            shut(*hs)
        finally:
            store.close()
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("relaunch-rdzv")]
    assert leftover == []


def test_the_applier_writes_a_joining_node_s_heartbeat_before_placing_it(
    store: MemoryStore,
) -> None:
    # on a store without leases a node does not write its heartbeat before it joins:
    # the applier of its request does, in one call for its batch, before the state
    # holds it, so a look at the dead between the two never drops it
    from relaunch.rendezvous._backend import StateBackend
    from relaunch.rendezvous._queue import RequestQueue

    settings = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=1)
    backend = StateBackend(store, settings, clock=lambda: 1000.0)
    backend.announce("n")
    assert store.get(backend.liveness.hb_key("n")) is None
    assert RequestQueue(backend).request("n") is not None
    state, _ = backend.load()
    assert list(state.participants) == ["n"]
    assert store.get(backend.liveness.hb_key("n")) == b"1000000"
    assert backend.remove_dead(state, 1000.0) == (state, [])


def _behind_gone_nodes(gone: int) -> tuple[int, int]:
    """Tickets 1..``gone`` taken by nodes that never wrote their requests; a node takes
    the next one and waits (its ack wait timing out every 0.05 s) until the stalls make
    it the head, which skips the missing requests and places it. Returns how many times
    the node read the ``applied`` hint and how many times the state."""
    from relaunch.rendezvous._backend import StateBackend
    from relaunch.rendezvous._queue import RequestQueue

    store = _ReadsRecorded()
    try:
        settings = RendezvousSettings(
            run_id="job", min_nodes=1, max_nodes=1, heartbeat_timeout=0.05,
            keep_alive_interval=0.05,
        )  # fmt: skip
        backend = StateBackend(store, settings, clock=lambda: 1000.0)
        hint = backend.prefix + "applied"
        store.set(hint, b"0")
        store.add(backend.prefix + "req", gone)
        ack = RequestQueue(backend).request("n")
        assert ack is not None and ack.participant and ack.place is not None
        reads = store.read.count(hint), store.read.count(backend.state_key)
        assert store.get(hint) == str(gone + 1).encode()
        return reads
    finally:
        store.close()


def test_a_node_waiting_in_a_stalled_queue_reads_the_applied_hint_not_the_state() -> None:
    # tickets 1 and 2 were taken by nodes that never wrote their requests (gone): the
    # node with ticket 3 times out waiting for its ack again and again; each time it
    # reads the few bytes of the ``applied`` hint, not the state, until the stalls make
    # it the head, which loads the state once, skips the two requests and places it
    hint_reads, state_reads = _behind_gone_nodes(2)
    assert hint_reads >= 2
    assert state_reads == 1


def test_a_node_far_from_the_head_reads_the_applied_hint_once_every_few_stalls() -> None:
    # tickets 1-9 were taken by nodes that never wrote their requests: the node with
    # ticket 10 becomes the head after ten timeouts (nine stalled periods), as a node
    # reading the hint every period does, but reads it four times on the way (after 1,
    # 5, 9 and 10 timeouts), not ten: thousands of nodes waiting on a slow round read it
    # a quarter as often. Two reads more as the head (the hint it corrects, the first
    # ticket of a state never written): twelve in all when every timeout read it.
    assert _behind_gone_nodes(9) == (6, 1)


def test_the_applied_hint_is_corrected_after_an_applier_lost_before_its_acks() -> None:
    # the applier of tickets 1-5 commits the state and fails before it writes the acks
    # and the hint (its node lost): the hint still says 0; the node holding ticket 2 takes
    # the queue over after a stall, finds its ticket applied and corrects the hint to 5,
    # so a node that takes ticket 6 later is the head at once (not after five stalls)
    from relaunch.errors import StoreConnectionError
    from relaunch.rendezvous._backend import StateBackend
    from relaunch.rendezvous._queue import RequestQueue

    class LostBeforeAcks(MemoryStore):
        def set(self, key: str, value: bytes) -> None:
            if "/ack/" in key:
                raise StoreConnectionError("the applier's node is lost")
            super().set(key, value)

    store = LostBeforeAcks()
    settings = RendezvousSettings(
        run_id="job", min_nodes=5, max_nodes=5, heartbeat_timeout=0.1,
        keep_alive_interval=30.0,
    )  # fmt: skip
    backend = StateBackend(store, settings, clock=lambda: 1000.0)
    hint = backend.prefix + "applied"
    try:
        with ThreadPoolExecutor(5) as pool:
            lost = pool.submit(RequestQueue(backend).request, "a")
            wait_for(lambda: store.get(hint) == b"0", 30, what="the first head")
            others = [pool.submit(RequestQueue(backend).request, n) for n in "bcde"]
            with pytest.raises(StoreConnectionError):
                lost.result(timeout=60)
            assert [f.result(timeout=60) for f in others] == [None] * 4
        assert backend.load()[0].applied == 5
        assert store.get(hint) == b"5"
    finally:
        store.close()


def test_an_applier_whose_write_lost_to_another_writes_again_at_once() -> None:
    # between the first applier's read of the state and its compare-and-set, another
    # node writes the state (it claims the store's host, as an agent does at its start):
    # the applier folds its batch into the state now and writes again at once. Before,
    # it wrote nothing, not even its acks, and the queue stood still for a stall's
    # timeout (2 s by default) before anyone looked again. Later appliers were handed
    # the queue (``ack/<t>`` is "h"), so they tried again at once already
    from relaunch.errors import StoreTimeoutError
    from relaunch.rendezvous._backend import StateBackend
    from relaunch.rendezvous._queue import RequestQueue
    from relaunch.rendezvous._writes import claim_store_host

    class Collides(MemoryStore):
        armed = False
        stalls = 0

        def wait(self, keys: list[str], timeout: float) -> None:
            try:
                super().wait(keys, timeout)
            except StoreTimeoutError:
                self.stalls += 1
                raise

        def compare_set(
            self, key: str, expected: bytes | None, desired: bytes
        ) -> tuple[bytes, bool]:
            if self.armed and key.endswith("/state"):
                self.armed = False
                claim_store_host(backend, "host", settings, lambda: 1000.0)
            return super().compare_set(key, expected, desired)

    store = Collides()
    settings = RendezvousSettings(
        run_id="job", min_nodes=1, max_nodes=1, heartbeat_timeout=2.0,
        keep_alive_interval=0.2, keep_alive_max_attempt=30,
    )  # fmt: skip
    backend = StateBackend(store, settings, clock=lambda: 1000.0)
    try:
        store.armed = True
        ack = RequestQueue(backend).request("a")
        assert ack is not None and ack.participant and ack.place is not None
        assert store.stalls == 0
        state, _ = backend.load()
        assert state.complete and list(state.participants) == ["a"]
        assert state.store_host == "host" and state.applied == 1
        assert store.get(backend.prefix + "applied") == b"1"
    finally:
        store.close()


class _StateWrites(MemoryStore):
    """The in-memory store, counting the compare-and-sets of the rendezvous state."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bytes, bool]:
        if key == "relaunch/rdzv/job/state":
            self.writes += 1
        return super().compare_set(key, expected, desired)


class _ResentWrites(MemoryStore):
    """The in-memory store answering every compare-and-set of the rendezvous state and
    of the steward's key as one sent again would after its first send was applied (the
    etcd client resends to another member when one is slow): written, yet "not written"
    with the key's bytes now, the caller's own."""

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bytes, bool]:
        current, written = super().compare_set(key, expected, desired)
        if written and key.endswith(("/state", "/steward")):
            return current, False
        return current, written


def test_a_write_applied_before_its_resend_counts_as_written() -> None:
    from relaunch.rendezvous._corrupt import CorruptWatch
    from relaunch.rendezvous._liveness import Liveness

    store = _ResentWrites()
    hs = [make(store, 2, 2, last_call_timeout=600.0) for _ in range(2)]
    try:
        infos = together(*(h.next_rendezvous for h in hs))
        assert sorted(i.rank for i in infos) == [0, 1]
        # the write that completed the round published each node's place
        assert all(store.get(f"relaunch/rdzv/job/assign/0/{h.node_id}") for h in hs)
        now = [1000.0]
        settings = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=2)
        a, b = (Liveness(store, "p/", settings, lambda: now[0]) for _ in range(2))
        watch_a, watch_b = CorruptWatch("job", 3.0), CorruptWatch("job", 3.0)
        for _ in range(3):  # a holds the role it took, beat after beat; b never takes it
            assert a.steward("a", watch_a) and not b.steward("b", watch_b)
            now[0] += 1
    finally:
        shut(*hs)
        store.close()


def test_nodes_leaving_at_once_leave_in_one_write_of_the_state() -> None:
    # a job's end: seven of eight nodes shut down at once, behind a ticket whose node is
    # gone (so that every leave request is queued before the queue moves): the node
    # that takes the queue over folds the seven leaves into one write of the state
    # (each node rewrote the state itself before, retrying on every conflict: 976 of
    # 1,024 nodes leaving at once had not left after 30 s), and each learns it from its
    # ack. They beat until then: none is taken for dead, and the eighth node's round
    # stays complete (it trains on)
    store = _StateWrites()  # (a 0.5 s wait for an ack; dead after 5 s: slow threads live)
    kw = {"last_call_timeout": 600.0, "heartbeat_timeout": 0.5, "keep_alive_max_attempt": 50}
    hs = [make(store, 8, 8, **kw) for _ in range(8)]
    try:
        together(*(h.next_rendezvous for h in hs))
        store.add("relaunch/rdzv/job/req", 1)
        before = store.writes
        assert together(*(h.shutdown for h in hs[1:])) == [True] * 7
        assert store.writes - before <= 3
        state = json.loads(store.get("relaunch/rdzv/job/state") or b"")
        assert state["complete"] and list(state["participants"]) == [hs[0].node_id]
        assert hs[0].num_nodes_waiting() == 0
        beating = [h for h in hs if store.get(f"relaunch/rdzv/job/hb/{h.node_id}") is not None]
        assert beating == hs[:1]  # the leavers' heartbeats went after their leaves
    finally:
        try:
            shut(hs[0])
        finally:
            store.close()


def test_a_leave_the_queue_does_not_confirm_is_made_on_the_state(store: MemoryStore) -> None:
    # an applier of an older version refuses the leave request (version 2) and acks it
    # as "not a participant"; the node then leaves by compare-and-set on the state
    # itself: it is gone, and its round stays complete for the other node
    from relaunch.rendezvous import _queue

    a, b = make(store, 2, 2), make(store, 2, 2)
    together(a.next_rendezvous, b.next_rendezvous)
    real = _queue.RequestQueue._parse_request

    def older(self: _queue.RequestQueue, key: str, raw: bytes | None) -> _queue.Request | None:
        if raw is not None and json.loads(raw).get("version") != 1:
            return None  # what an older applier makes of it: refused, acked
        return real(self, key, raw)

    try:
        _queue.RequestQueue._parse_request = older  # type: ignore[method-assign]
        assert a.shutdown()
    finally:
        _queue.RequestQueue._parse_request = real  # type: ignore[method-assign]
    state = json.loads(store.get("relaunch/rdzv/job/state") or b"")
    assert state["complete"] and list(state["participants"]) == [b.node_id]
    assert b.num_nodes_waiting() == 0
    shut(b)


class _Beats(MemoryStore):
    """The in-memory store, keeping each node's heartbeat writes (seconds: until when
    the node is alive by them, a leaving node's ``<ms>+<span ms>``: the sum)."""

    def __init__(self) -> None:
        super().__init__()
        self.beats: collections.defaultdict[str, list[float]] = collections.defaultdict(list)

    def set(self, key: str, value: bytes) -> None:
        if key.startswith("relaunch/rdzv/job/hb/"):
            self.beats[key.rsplit("/", 1)[1]].append(sum(map(int, value.split(b"+"))) / 1000)
        super().set(key, value)


def test_a_leaving_node_is_alive_until_its_deadline_without_beating() -> None:
    # its leave waits behind a ticket whose node is gone for longer than the dead-node
    # delay (0.3 s), and the other node's steward looks for the dead every 0.1 s: the
    # leaving node, which no longer beats (16,384 nodes beating while their leaves
    # waited kept the store's host from applying them), dated its heartbeat once to
    # its deadline, so it leaves and is not taken for dead: the other node's round
    # stays complete
    store = _Beats()
    kw = {"last_call_timeout": 600.0, "keep_alive_max_attempt": 3}
    a, b = make(store, 2, 2, **kw), make(store, 2, 2, **kw)
    try:
        together(a.next_rendezvous, b.next_rendezvous)
        store.add("relaunch/rdzv/job/req", 1)
        before = len(store.beats[a.node_id])
        asked = time.time()
        assert a.shutdown()
        # (a beat under way as it stopped may land first): one write, dated to its
        # deadline (close_timeout, 30 s), and none after it
        writes = store.beats[a.node_id][before:]
        assert len(writes) <= 2 and writes[-1] > asked + 20, writes
        assert all(t < asked + 1 for t in writes[:-1]), writes
        state = json.loads(store.get("relaunch/rdzv/job/state") or b"")
        assert state["complete"] and list(state["participants"]) == [b.node_id]
        assert b.num_nodes_waiting() == 0
        assert store.get("relaunch/rdzv/job/hb/" + a.node_id) is None  # its last call
    finally:
        try:
            shut(b)
        finally:
            store.close()


class _StateReads(MemoryStore):
    """The in-memory store, counting the reads of the rendezvous state made by the main
    thread (not the keep-alive threads': the steward's beats read it)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def get(self, key: str) -> bytes | None:
        if (
            key == "relaunch/rdzv/job/state"
            and threading.current_thread() is threading.main_thread()
        ):
            self.reads += 1
        return super().get(key)


def test_a_leave_still_queued_at_the_close_timeout_gives_up_without_reading_the_state() -> None:
    # the queue stalls behind a ticket whose node is gone; a node whose leave is not
    # applied by its close timeout says so (shutdown: False) without reading the state,
    # which past the deadline could only say "too late": every node of a slow mass
    # leave at 16,384 nodes reading it (430 KB each) ran the nodes out of memory
    store = _StateReads()
    kw = {"last_call_timeout": 600.0, "heartbeat_timeout": 0.5, "close_timeout": 0.2,
          "keep_alive_max_attempt": 50}  # fmt: skip
    a, b = make(store, 2, 2, **kw), make(store, 2, 2, **kw)
    try:
        together(a.next_rendezvous, b.next_rendezvous)
        store.add("relaunch/rdzv/job/req", 1)
        before = store.reads
        assert not a.shutdown()
        assert store.reads == before
        assert store.get("relaunch/rdzv/job/hb/" + a.node_id) is None  # it stopped beating
    finally:
        try:
            b.shutdown()
        finally:
            store.close()


def test_late_node_admitted_at_next_round(store: MemoryStore) -> None:
    a, b = make(store, 1, 2), make(store, 1, 2)
    first = a.next_rendezvous()
    assert (first.rank, first.world_size) == (0, 1)
    with ThreadPoolExecutor(1, thread_name_prefix="test-rdzv") as pool:
        late = pool.submit(b.next_rendezvous)
        until(lambda: a.num_nodes_waiting() == 1)
        again = a.next_rendezvous()
        info_b = late.result(timeout=30)
    assert again.world_size == info_b.world_size == 2
    assert again.round == info_b.round == 1
    assert a.restart_count() == 0
    shut(a, b)


def test_dead_node_removed_survivors_continue(store: MemoryStore) -> None:
    hs = [make(store, 2, 3, keep_alive_max_attempt=3) for _ in range(3)]
    together(*(h.next_rendezvous for h in hs))
    victim = hs.pop()
    victim._keep_alive.stop()  # the node is gone: no heartbeat, no goodbye
    until(lambda: all(h.num_nodes_waiting() > 0 for h in hs))
    infos = together(*(h.next_rendezvous for h in hs))
    assert sorted(i.rank for i in infos) == [0, 1]
    assert {i.world_size for i in infos} == {2}
    shut(*hs)
    victim._shut = True  # its store is shared: do not leave on its behalf


def test_spare_takes_lost_nodes_place(store: MemoryStore) -> None:
    a, b, spare = (make(store, 2, 2, keep_alive_max_attempt=3) for _ in range(3))
    together(a.next_rendezvous, b.next_rendezvous)
    with ThreadPoolExecutor(1, thread_name_prefix="test-rdzv") as pool:
        waiting = pool.submit(spare.next_rendezvous)
        until(
            lambda: (
                spare.node_id
                in json.loads(store.get("relaunch/rdzv/job/state") or b"{}").get(
                    "redundancy_list", []
                )
            )
        )
        assert a.num_nodes_waiting() == 0  # a spare does not trigger a restart
        b._keep_alive.stop()
        until(lambda: a.num_nodes_waiting() > 0)
        info_a = a.next_rendezvous()
        info_s = waiting.result(timeout=30)
    assert info_a.world_size == info_s.world_size == 2
    assert {info_a.rank, info_s.rank} == {0, 1}
    shut(a, spare)
    b._shut = True


def test_closed_rendezvous(store: MemoryStore) -> None:
    a, spare, late = make(store, 1, 1), make(store, 1, 1), make(store, 1, 1)
    a.next_rendezvous()
    with ThreadPoolExecutor(1, thread_name_prefix="test-rdzv") as pool:
        waiting = pool.submit(spare.next_rendezvous)
        until(
            lambda: 'redundancy_list":["' in (store.get("relaunch/rdzv/job/state") or b"").decode()
        )
        assert not a.is_closed()
        a.set_closed()
        assert a.is_closed()
        with pytest.raises(RendezvousGracefulExitError):
            waiting.result(timeout=30)
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()
    shut(a, spare, late)


def test_corrupt_state_is_a_clear_error(store: MemoryStore) -> None:
    store.set("relaunch/rdzv/job/state", b"\x80\x04\x95not json")
    h = make(store, 1, 1)
    with pytest.raises(RendezvousStateError, match="relaunch/rdzv/job/state"):
        h.next_rendezvous()
    h._shut = True
    h._keep_alive.stop()


def test_a_state_corrupted_while_the_applier_waits_is_said_once_and_refused(
    store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    # the first node waits for the requests still coming (its batch cannot complete
    # the round); the state is corrupted meanwhile: its write fails on it, and the
    # node's patient read (not the queue) says so once and refuses it
    h = make(store, 2, 2, keep_alive_interval=2.0)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="test-rdzv") as pool:
            joining = pool.submit(h.next_rendezvous)
            until(lambda: store.get("relaunch/rdzv/job/req/1") is not None)
            store.set("relaunch/rdzv/job/state", b"\x00\xffnot json{")
            with pytest.raises(RendezvousStateError, match="relaunch/rdzv/job/state"):
                joining.result(timeout=30)
    finally:
        h._shut = True
        h._keep_alive.stop()
    said = [r for r in caplog.records if "goes on with the last valid state" in r.getMessage()]
    assert len(said) == 1


def test_state_of_another_run_refused(store: MemoryStore) -> None:
    other = make(store, 1, 1)
    other.next_rendezvous()
    raw = store.get("relaunch/rdzv/job/state") or b""
    store.set("relaunch/rdzv/job/state", raw.replace(b'"run_id":"job"', b'"run_id":"evil"'))
    h = make(store, 1, 1)
    with pytest.raises(RendezvousStateError, match="evil"):
        h.next_rendezvous()
    for x in (h, other):
        x._shut = True
        x._keep_alive.stop()


def test_join_request_of_another_run_is_ignored(store: MemoryStore) -> None:
    ticket = store.add("relaunch/rdzv/job/req", 1)
    request = {"version": 1, "run_id": "evil", "node": "evil_1_0"}
    store.set(f"relaunch/rdzv/job/req/{ticket}", json.dumps(request).encode())
    h = make(store, 1, 1, heartbeat_timeout=0.2)  # nobody holds ticket 1: take over soon
    info = h.next_rendezvous()
    assert info.world_size == 1
    assert b"evil" not in (store.get("relaunch/rdzv/job/state") or b"")
    shut(h)


def test_a_node_beats_once_its_first_join_request_left_the_queue(store: MemoryStore) -> None:
    # a queued node is in no state, and the applier writes its heartbeat as it places
    # it: beats before then only cost the store (at 16,384 nodes on a 5 s interval,
    # most of the round's calls). Ticket 1 is taken and never written, so this node
    # waits in the queue for two stalls (about 3 s) before it takes the queue over
    store.add("relaunch/rdzv/job/req", 1)
    h = make(store, 1, 1, heartbeat_timeout=1.5, keep_alive_interval=0.05,
             keep_alive_max_attempt=100)  # fmt: skip
    hb = f"relaunch/rdzv/job/hb/{h.node_id}"
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="test-rdzv") as pool:
            joined = pool.submit(h.next_rendezvous)
            wait_for(lambda: store.get("relaunch/rdzv/job/req/2") is not None, 30,
                     what="the join request")  # fmt: skip
            for _ in range(10):  # 20 keep-alive intervals, still queued
                assert store.get(hb) is None
                assert not joined.done()
                threading.Event().wait(0.1)
            assert joined.result(timeout=60).world_size == 1
        first = store.get(hb)
        until(lambda: store.get(hb) != first)  # it beats now
    finally:
        shut(h)


def test_join_timeout(store: MemoryStore) -> None:
    h = make(store, 2, 2, join_timeout=0.3)
    with pytest.raises(RendezvousTimeoutError, match="join_timeout"):
        h.next_rendezvous()
    assert b"_" not in (store.get("relaunch/rdzv/job/state") or b"").split(b"participants")[1][:5]
    shut(h)


def test_failure_restart_counted_once_per_round(store: MemoryStore) -> None:
    a, b = make(store, 2, 2), make(store, 2, 2)
    infos: list[RendezvousInfo] = together(a.next_rendezvous, b.next_rendezvous)
    assert a.record_failure(infos[0].round) == 1
    assert b.record_failure(infos[1].round) == 1
    together(a.next_rendezvous, b.next_rendezvous)
    assert b.record_failure(infos[0].round + 1) == 2
    assert a.restart_count() == 2
    shut(a, b)


def test_shutdown_does_not_close_for_the_others(store: MemoryStore) -> None:
    a, b = make(store, 1, 2), make(store, 1, 2)
    together(a.next_rendezvous, b.next_rendezvous)
    assert a.shutdown()
    assert not b.is_closed()
    assert b.num_nodes_waiting() == 0  # b keeps training
    info = b.next_rendezvous()  # b restarts alone: not stranded
    assert info.world_size == 1
    with pytest.raises(RendezvousClosedError):
        a.next_rendezvous()
    shut(b)


def test_interrupt_ends_a_blocked_next_rendezvous(store: MemoryStore) -> None:
    h = make(store, 2, 2)
    with ThreadPoolExecutor(1, thread_name_prefix="test-rdzv") as pool:
        blocked = pool.submit(h.next_rendezvous)
        until(lambda: b"participants" in (store.get("relaunch/rdzv/job/state") or b""))
        h.interrupt()
        with pytest.raises(RendezvousClosedError, match="interrupted"):
            blocked.result(timeout=30)
    shut(h)


def test_join_acks_and_assignments_round_trip_and_refuse_garbage() -> None:
    from relaunch.rendezvous._places import Assignment, JoinAck

    place = Assignment(3, 8, 12, "10.0.0.4_7_0")
    left = JoinAck(7, 2, False, True, left=True)
    for ack in (JoinAck(5, 2, True, False), JoinAck(6, 2, True, True, place), left):
        assert JoinAck.parse(ack.encode()) == ack
    assert left.encode() == b"a 7 2 l c"  # an older node reads "not a participant"
    assert Assignment.parse(Assignment(0, 1).encode()) == Assignment(0, 1, 0, None)
    assert Assignment.parse(b"3 8") == Assignment(3, 8)  # a record of an older agent
    for bad in (b"", b"h", b"a 1 2 p", b"a 1 2 p c 3 x 0 -", b"a x 2 p c", b"x 1 2 p c"):
        assert JoinAck.parse(bad) is None, bad
    for bad in (b"", b"3", b"3 8 1", b"a b c d", b"\xff\xfe 1"):
        assert Assignment.parse(bad) is None, bad


def test_one_steward_at_a_time_taken_over_when_it_stops(store: MemoryStore) -> None:
    from relaunch.rendezvous._corrupt import CorruptWatch
    from relaunch.rendezvous._liveness import Liveness

    now = [1000.0]
    settings = RendezvousSettings(
        run_id="job", min_nodes=1, max_nodes=2, keep_alive_interval=1.0, keep_alive_max_attempt=3
    )
    a, b = (Liveness(store, "p/", settings, lambda: now[0]) for _ in range(2))
    watch_a, watch_b = CorruptWatch("job", 3.0), CorruptWatch("job", 3.0)
    assert a.steward("a", watch_a) and not b.steward("b", watch_b)
    now[0] += 1
    assert a.steward("a", watch_a) and not b.steward("b", watch_b)  # a says so again
    a.report_corrupt(RendezvousStateError("key 'p/state': bad round"))
    now[0] += 1
    assert a.steward("a", watch_a)
    assert watch_b.expired(since=None) is False and watch_b.error() is None
    assert not b.steward("b", watch_b)  # b hears of the corruption from a's key
    assert watch_b.expired(since=-1e12)  # corrupt as b knows it now (since a moment)
    a.report_corrupt(None)
    now[0] += 1
    assert a.steward("a", watch_a) and not b.steward("b", watch_b)  # and of its end
    assert not watch_b.expired(since=None)
    now[0] += 4  # a stopped beating: b takes over once its key is older than dead_after
    assert b.steward("b", watch_b) and not a.steward("a", watch_a)
    a.beat("a")
    b.beat("b")
    now[0] += 1
    assert store.get("p/hb/a") == store.get("p/hb/b") == b"1007000"
    assert a.alive(["a", "b", "c"]) == {"a", "b"}
    store.set("p/steward", b"{not json")  # a corrupt key is taken over, not trusted
    assert a.steward("a", watch_a)


def test_a_deleted_state_is_started_afresh_past_the_spent_requests(store: MemoryStore) -> None:
    """Nodes delete their requests once applied; a state key deleted by hand (the
    ticket counter kept) starts afresh from the tickets after the last one applied,
    not from ticket 1, whose request no longer exists."""
    hs = [make(store, 2, 2, join_timeout=10.0) for _ in range(2)]
    for _ in range(4):
        together(*(h.next_rendezvous for h in hs))
    until(lambda: store.get("relaunch/rdzv/job/req/1") is None)  # spent, deleted
    store.delete("relaunch/rdzv/job/state")
    infos = together(*(h.next_rendezvous for h in hs))
    assert sorted(i.rank for i in infos) == [0, 1]
    assert {i.world_size for i in infos} == {2}
    shut(*hs)


def test_spent_keys_a_lost_store_refuses_are_kept_for_the_next_try() -> None:
    # the keep-alive's after-beat and a leaving node delete their spent keys the same
    # way: a store lost for now ends the try without an error, and keeps the keys
    from relaunch.errors import StoreConnectionError
    from relaunch.rendezvous._spent import SpentKeys

    class LostOnce(MemoryStore):
        lost = True

        def delete(self, key: str) -> bool:
            if self.lost:
                self.lost = False
                raise StoreConnectionError("the store's host is lost")
            return super().delete(key)

    store = LostOnce()
    try:
        for key in ("a", "b"):
            store.set(key, b"1")
        spent = SpentKeys()
        spent.add("a", "b")
        spent.forget(store)
        assert (store.get("a"), store.get("b")) == (b"1", b"1")
        spent.forget(store)
        assert (store.get("a"), store.get("b")) == (None, None)
    finally:
        store.close()


class Leased(MemoryStore):
    """A memory store with leases in name only (a key "expires" when a test deletes
    it): the logic that uses them is what is tested; ``reads`` counts the reads of the
    keys that end with ``counted``."""

    def __init__(self, counted: str) -> None:
        super().__init__()
        self.counted, self.reads = counted, 0

    def get(self, key: str) -> bytes | None:
        self.reads += key.endswith(self.counted)
        return super().get(key)

    def set_ephemeral(self, key: str, value: bytes, ttl: float) -> None:
        self.set(key, value)

    def keys_with_prefix(self, prefix: str) -> list[str]:
        with self._cond:
            return [k for k in self._data if k.startswith(prefix)]


def test_on_a_store_with_leases_the_steward_key_is_read_only_once_it_may_be_overdue() -> None:
    from relaunch.rendezvous._corrupt import CorruptWatch
    from relaunch.rendezvous._liveness import Liveness

    store, now = Leased("steward"), [1000.0]
    settings = RendezvousSettings(
        run_id="job", min_nodes=1, max_nodes=2, keep_alive_interval=0.5, keep_alive_max_attempt=4
    )
    a, b = (Liveness(store, "p/", settings, lambda: now[0]) for _ in range(2))
    watch = CorruptWatch("job", settings.dead_after)
    assert a.steward("a", watch) and not b.steward("b", watch)
    store.reads = 0
    for _ in range(3):  # a's key, written at 1000, cannot be overdue before 1002
        now[0] += 0.5
        assert not b.steward("b", watch)
    assert store.reads == 0
    now[0] += 0.5  # 1002: b looks (a, stopped since 1000, is not overdue yet)
    assert not b.steward("b", watch) and store.reads == 1
    now[0] += 0.5  # overdue: b takes over at its first beat past the dead-node delay
    assert b.steward("b", watch)
    assert not a.steward("a", watch)
    store.reads = 0
    now[0] += 0.5
    assert b.steward("b", watch) and b.steward("b", watch)  # said lately: no read, no write
    now[0] += 0.5
    assert b.steward("b", watch) and store.reads == 0  # says so again: a write, no read
    now[0] += 1.0  # b's key, taken by a behind its back, fails b's next write
    store.set("p/steward", json.dumps({"v": 1, "node": "a", "ms": now[0] * 1000}).encode())
    assert not b.steward("b", watch) and store.reads == 0


def test_on_a_store_with_leases_a_node_that_heard_of_a_corrupt_state_hears_of_its_end() -> None:
    from relaunch.rendezvous._corrupt import CorruptWatch
    from relaunch.rendezvous._liveness import Liveness

    store, now = Leased("steward"), [1000.0]
    settings = RendezvousSettings(
        run_id="job", min_nodes=1, max_nodes=2, keep_alive_interval=0.5, keep_alive_max_attempt=4
    )
    a, b = (Liveness(store, "p/", settings, lambda: now[0]) for _ in range(2))
    # (b's grace ends at once: error() says whether b takes the state for corrupt now)
    watch_a, watch_b = CorruptWatch("job", 2.0), CorruptWatch("job", 1e-9)
    assert a.steward("a", watch_a) and not b.steward("b", watch_b)
    now[0] += 0.5
    a.report_corrupt(RendezvousStateError("key 'p/state': bad round"))
    assert a.steward("a", watch_a)  # said at once
    now[0] += 1.5  # b's first look since: it hears of it (up to a dead-node delay late)
    assert a.steward("a", watch_a) and not b.steward("b", watch_b)
    assert watch_b.error() is not None
    now[0] += 0.2
    a.report_corrupt(None)
    assert a.steward("a", watch_a)
    store.reads = 0
    now[0] += 0.3  # and of its end at its next beat, not a dead-node delay later
    assert not b.steward("b", watch_b) and store.reads == 1
    assert watch_b.error() is None


def test_on_a_store_with_leases_the_steward_reads_the_state_when_a_lease_key_goes() -> None:
    store = Leased("/state")
    hs = [make(store, 2, 3, keep_alive_max_attempt=10) for _ in range(3)]  # 0.1 s beats
    victim = hs[-1]
    try:
        together(*(h.next_rendezvous for h in hs))
        store.reads = 0
        time.sleep(2.0)  # 20 beats of the steward: the state read once per dead-node delay
        assert store.reads <= 6
        victim._keep_alive.stop()  # the node is gone: no heartbeat, no goodbye
        store.delete(f"relaunch/rdzv/job/alive/{victim.node_id}")  # its lease expired
        until(lambda: all(h.num_nodes_waiting() > 0 for h in hs[:2]))
        infos = together(*(h.next_rendezvous for h in hs[:2]))
        assert sorted(i.rank for i in infos) == [0, 1]
    finally:
        victim._keep_alive.stop()
        victim._shut = True  # its store is shared: do not leave on its behalf
        shut(*hs[:2])
        store.close()


def test_the_steward_writes_an_epoch_key_a_lost_writer_left_out(store: MemoryStore) -> None:
    """A writer lost between its compare-and-set and its ``epoch/<n>`` key: the nodes
    that wait on that key saw no later change until their next rendezvous. The steward,
    as it reads the state, writes the keys missing up to its epoch."""
    from relaunch.rendezvous._backend import StateBackend
    from relaunch.rendezvous._state import RendezvousState

    settings = RendezvousSettings(run_id="job", min_nodes=1, max_nodes=1)
    backend = StateBackend(store, settings, clock=lambda: 1000.0)
    store.set(backend.epoch_key(1), b"1")
    store.set(backend.epoch_key(3), b"1")
    assert backend.fill_epochs(RendezvousState(run_id="job", epoch=3)) == [2]
    assert store.get(backend.epoch_key(2)) == b"1"
    assert backend.fill_epochs(RendezvousState(run_id="job", epoch=3)) == []
    assert backend.fill_epochs(RendezvousState(run_id="job", epoch=5)) == [4, 5]
    # through a node's keep-alive: it is the steward of its one-node job
    h = make(store, 1, 1)
    h.next_rendezvous()
    epoch = json.loads(store.get("relaunch/rdzv/job/state") or b"{}")["epoch"]
    assert epoch >= 1
    store.delete(f"relaunch/rdzv/job/epoch/{epoch}")
    until(lambda: store.get(f"relaunch/rdzv/job/epoch/{epoch}") is not None)
    shut(h)
