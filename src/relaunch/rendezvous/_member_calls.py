"""The embedded store's membership calls to etcd: list, promote, remove, leave.

What to do is decided in :mod:`relaunch.rendezvous._seats`; who does it, when, is
:mod:`relaunch.rendezvous._replicated`. These are the calls themselves, each
tolerant of the member list having changed under it (another node acted first).
"""

from __future__ import annotations

import contextlib
import logging
import time
import zlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from relaunch._endpoint import quiet_port
from relaunch.errors import StoreConnectionError, StoreError
from relaunch.rendezvous._member_specs import EmbeddedSettings, joining_member
from relaunch.rendezvous._seats import Member, join_steps, parse_members
from relaunch.store._etcd_member import MemberSpec, any_healthy, bracket, endpoint_of, hand_over
from relaunch.store.etcd import EtcdStore

__all__ = [
    "Leave",
    "add_member",
    "answers",
    "await_others",
    "client_endpoints",
    "join_cluster",
    "leave_cluster",
    "leave_in_turn",
    "list_members",
    "member_endpoints",
    "members_lock",
    "promote_once",
    "promote_when_in_sync",
    "reach",
    "remove_member",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Leave:
    """What a leave (:func:`leave_cluster`) came to."""

    out: bool
    """The member is out of the cluster, or taken for out (the store could not be
    reached: the others remove it once it is gone)."""
    gone: bool = False
    """It is in the cluster no more (removed by this call or before): nothing of the
    cluster is on it, it may be killed at once."""
    up: frozenset[str] = frozenset()
    """The other members up, as the leave saw them."""


def list_members(store: EtcdStore) -> list[Member]:
    return parse_members(store.request("/cluster/member/list", {}))


def add_member(store: EtcdStore, peer_url: str, *, learner: bool) -> dict[str, Any]:
    """Add a member at ``peer_url`` (the caller holds the members' lock); etcd's reply.
    When the call fails, a member at ``peer_url`` that never started is this call's,
    applied by an endpoint that did not answer (the call sent again was refused:
    "Peer URLs already exists"): it is removed before the error is raised, or it would
    hold a seat, a vote at that, until a steward removed it."""
    try:
        return store.request("/cluster/member/add", {"peerURLs": [peer_url], "isLearner": learner})
    except StoreError:
        with contextlib.suppress(StoreError):
            for m in list_members(store):
                if peer_url in m.peer_urls and not m.name:
                    remove_member(store, m.id, peer_url)
        raise


def reach(store: EtcdStore, endpoint: tuple[str, int], read_timeout: float) -> None:
    """Wait (up to ``read_timeout``) until the cluster at ``endpoint`` answers."""
    deadline = time.monotonic() + read_timeout
    while True:
        try:
            list_members(store)
            return
        except StoreConnectionError as exc:
            if time.monotonic() >= deadline:
                host, port = endpoint
                raise StoreConnectionError(
                    f"cannot reach the embedded rendezvous store at {host}:{port} within "
                    f"read_timeout={read_timeout:g} s: is a node of the job up there? ({exc})"
                ) from exc
            time.sleep(0.2)


def client_endpoints(
    members: list[Member], spread: str | None = None, down: Collection[str] = ()
) -> list[tuple[str, int]]:
    """The started members' client endpoints, the voting ones first: a learner refuses
    the rendezvous' calls (the client fails over), but may have been promoted since
    the list was read, and be all that answers once the others are lost.

    With ``spread`` (this node's member name), the voting member first is this node's
    own, else the one its name ranks highest (rendezvous hashing: a member's removal
    moves only its own clients), a member ``down`` (ids) never: the clients of a job
    spread over the members (each member's JSON gateway serves its share of the beats,
    the costliest part of etcd's work at idle), not all on the first one.
    """
    started = sorted((m for m in members if m.started), key=lambda m: m.learner)
    voting = [m for m in started if not m.learner]
    up = [m for m in voting if m.id not in down]
    if spread is not None and up:
        rank = lambda m: (m.name == spread, zlib.crc32(f"{spread}/{m.id}".encode()))  # noqa: E731
        first = max(up, key=rank)
        started = [first, *(m for m in started if m is not first)]
    return [e for m in started for u in m.client_urls if (e := endpoint_of(u))]


def member_endpoints(store: EtcdStore) -> list[tuple[str, int]]:
    """Every started member's client endpoint, as the cluster lists them."""
    return client_endpoints(list_members(store))


def promote_once(store: EtcdStore, learner: Member) -> bool:
    """Promote ``learner`` once; whether it is a voting member now."""
    try:
        store.request("/cluster/member/promote", {"ID": learner.id})
        log.info("embedded store: promoted learner %s", learner.name)
        return True
    except StoreError as exc:  # etcd refuses a learner not yet in sync
        log.debug("embedded store: learner %s not promoted: %s", learner.name, exc)
        return False


def promote_when_in_sync(store: EtcdStore, learner: Member, timeout: float) -> bool:
    """Promote ``learner``, trying again while etcd refuses it (not yet in sync with
    the leader) for up to ``timeout`` seconds; False, and no promotion, once it does
    not answer a health check. A dead learner promoted beside one voting member makes
    two, one of them dead: no quorum, for good. etcd promotes a learner that stopped
    in sync, so its health is checked before each try."""
    deadline = time.monotonic() + timeout
    while True:
        if not answers(learner.client_urls):
            return False
        try:
            store.request("/cluster/member/promote", {"ID": learner.id})
            log.info("embedded store: promoted learner %s", learner.name)
            return True
        except StoreConnectionError:
            raise
        except StoreError as exc:
            if time.monotonic() > deadline:
                raise StoreError(f"learner {learner.name} never caught up: {exc}") from exc
            time.sleep(0.1)


def remove_member(store: EtcdStore, member_id: str, name: str) -> bool:
    """Remove a member; whether the cluster removed it now. One that is gone already
    (another node removed it) is fine."""
    try:
        store.request("/cluster/member/remove", {"ID": member_id})
        return True
    except StoreError as exc:
        log.info("embedded store: member %s not removed: %s", name, exc)
        return False


def leave_cluster(
    store: EtcdStore,
    name: str,
    known: Callable[[Member], bool] = lambda m: True,
    *,
    locked: bool = True,
) -> Leave:
    """Remove the members down now, then member ``name`` (a member leaving while a
    dead one stays listed could leave the others without a quorum); a learner up
    first takes the vote it leaves. Not while no other member up is ``known`` (one that
    every node's client surely knows of): ``name`` is then the member the others
    reach, and stays (the caller stops it when they are done). With the members' lock
    held (``locked``) no member is joining: one listed but not started is a join that
    failed (its node died while the member started), removed with the members down;
    without it, one not started may be joining and counts in the quorum (with it, the
    others may have none until it runs): it stays, and so does ``name``."""
    try:
        members = list_members(store)
    except StoreError as exc:
        log.warning("embedded store: member %s did not leave the cluster (%s); the "
                    "others remove it when it is gone", name, exc)  # fmt: skip
        return Leave(out=True)
    mine = [m for m in members if m.name == name]
    others = [m for m in members if m.name != name]
    # down: twice no healthy answer in 2 s (a member that is only slow, on a loaded
    # machine, must not be removed: that could cost the others their quorum)
    up = [m for m in others if m.started and answers(m.client_urls)]
    for m in others:
        if m not in up and (m.started or locked):
            remove_member(store, m.id, m.name or "(never started)")
    names = frozenset(m.name for m in up)
    if not mine:
        return Leave(out=True, gone=True, up=names)
    # the host leaving (scaled down) with a learner beside it leaves a store of one
    voting = [
        m
        for m in up
        if known(m) and (not m.learner or (not mine[0].learner and promote_once(store, m)))
    ]
    if not voting or not (locked or all(m.started for m in others)):
        return Leave(out=False, up=names)
    # a leader's removal would leave the others none until they elect one, and etcd
    # holds the writes sent meanwhile for its request timeout (6 s)
    if mine[0].client_urls and hand_over(mine[0].client_urls[0], voting[0].id):
        log.debug("embedded store: leadership handed to %s", voting[0].name)
    gone = remove_member(store, mine[0].id, name)
    if urls := client_endpoints(up):  # its last calls go to those that stay
        store.use_endpoints(urls)
    if not gone:  # its reply lost as it left, or a hand-over that timed out under way
        time.sleep(0.5)
        gone = remove_member(store, mine[0].id, name) or not _listed(store, mine[0].id)
    return Leave(out=True, gone=gone, up=names)


def _listed(store: EtcdStore, member_id: str) -> bool:
    """Whether the cluster lists the member (True when it cannot be asked)."""
    try:
        return any(m.id == member_id for m in list_members(store))
    except StoreError:
        return True


def leave_in_turn(
    store: EtcdStore,
    keys: tuple[str, str],
    name: str,
    *,
    ttl: float,
    wait: float,
    known: Callable[[Member], bool] = lambda m: True,
) -> Leave:
    """:func:`leave_cluster` holding the members' lock (``keys``: the lock's, then the
    staying member's; :func:`members_lock`, ``wait`` and ``ttl``): members that leave
    together decide one after the other, so the last one up sees that it is the last
    (the three of a store leaving at once would each see two others up and remove
    itself: no member left). A member that stays
    (no other ``known`` member up) is named in the staying key (under its lease) unless
    another member up is: the member that the others' last calls go to, whom the next
    leaver may leave to."""
    lock_key, staying_key = keys
    with members_lock(store, lock_key, name, ttl=ttl, wait=wait) as held:
        try:
            staying = (store.get(staying_key) or b"").decode(errors="replace")
        except StoreError:
            staying = ""
        known_now = lambda m: m.name == staying or known(m)  # noqa: E731
        left = leave_cluster(store, name, known_now, locked=held)
        if not left.out and staying not in left.up:
            with contextlib.suppress(StoreError):
                store.set_ephemeral(staying_key, name.encode(), ttl)
        return left


@contextlib.contextmanager
def members_lock(
    store: EtcdStore, key: str, name: str, *, ttl: float, wait: float = 0.0
) -> Iterator[bool]:
    """Hold the members' lock ``key`` (a node adding its member holds it while the
    member starts; members that leave take it in turn): claimed under the client's
    lease (``ttl``: its length where it has none yet), tried again for up to ``wait``
    seconds while another node holds it. Yields whether it is held (not once the store
    cannot be reached: the caller's next call says so); released on exit."""
    deadline = time.monotonic() + wait
    held = False
    with contextlib.suppress(StoreError):
        while not (held := store.claim_ephemeral(key, name.encode(), ttl)):
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    try:
        yield held
    finally:
        if held:
            with contextlib.suppress(StoreError):
                store.delete(key)


def await_others(store: EtcdStore, prefix: str, name: str, seconds: float) -> None:
    """Until no key under ``prefix`` but ``prefix + name`` is left (each node's client
    keeps one under its lease: gone when it closed, its last call made), ``seconds``
    at most (a crashed node's lease expires)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(StoreError):  # (an election: it answers again)
            if not [k for k in store.keys_with_prefix(prefix) if k != prefix + name]:
                return
        time.sleep(0.05)


def answers(urls: tuple[str, ...]) -> bool:
    """Whether a member at ``urls`` answers a health check (twice 2 s: a member that
    is only slow, on a loaded machine, counts as up)."""
    return any_healthy(urls, timeout=2.0) or any_healthy(urls, timeout=2.0)


def join_cluster(
    store: EtcdStore,
    cfg: EmbeddedSettings,
    name: str,
    *,
    launch: Callable[[MemberSpec], None],
    leaving: Callable[[], bool],
) -> None:
    """Add this node (``name``) as a member and start it (``launch``: returns once it
    answers healthy), the members' lock held; one line, and the seat left to another
    node, when the member cannot start. Nothing once the node is ``leaving``."""
    added: str | None = None
    try:
        members = list_members(store)
        steps = join_steps(members, cfg.target)
        if steps is None or leaving():
            return
        learner = next((m for m in members if m.id == steps.promote_first), None)
        if learner is not None and not promote_when_in_sync(store, learner, 5.0):
            # no vote lost: the next look finds its seat free (this node a learner)
            remove_member(store, learner.id, learner.name)
            log.warning("embedded store: learner %s does not answer: removed", learner.name)
            return
        peer = quiet_port(cfg.address)
        peer_url = f"http://{bracket(cfg.address)}:{peer}"
        # the first of a pair a learner: it has no vote until promoted, so a member
        # that never starts cannot cost the quorum; the second a voting member at
        # once (the running ones hold the quorum while it starts)
        reply = add_member(store, peer_url, learner=not steps.voting)
        added = str(int(reply["member"]["ID"]))
        launch(joining_member(cfg, name, peer, added, parse_members(reply)))
        added = None  # a member now (voting, or a learner waiting for a pair): it stays
    except (StoreError, OSError, KeyError, TypeError, ValueError) as exc:
        log.log(logging.INFO if leaving() else logging.WARNING,  # (leaving: cut short)
                "embedded store: this node could not become a member (%s); another "
                "node may take the seat", exc)  # fmt: skip
    finally:
        if added is not None:
            remove_member(store, added, name)
