"""The embedded store: an etcd cluster that the agents run among themselves.

With ``--rdzv-backend c10d`` and ``store_members`` >= 1 (``auto``: 3 for a job of
three nodes or more, 5 from five, when an etcd binary is found), the rendezvous
state lives in etcd, not in a TCP store on one node:

- The node that hosts the endpoint (as for the TCP store: ``--local-addr`` or the
  host name, or ``is_host=1``) starts the first member, its client port on the
  endpoint's port. Every other node first asks the endpoint, then knows every
  member: the endpoint's node can go, and any member's ``address:port`` works as the
  endpoint of a node that joins later. Its calls go to its own member, or to the one
  its name picks (:func:`client_endpoints`), and fail over to the others.
- The next nodes let into the job (their program and secret checked) join as
  members, one at a time (a lock key under the node's lease), each first a learner
  (no vote: a member that never starts cannot cost the quorum), until there are
  ``store_members`` (3; 5 from five nodes). The voting members grow in pairs, 1 -> 3
  -> 5 (:func:`~relaunch.rendezvous._seats.join_steps`): the next node promotes the
  learner and joins as a voting member at once; two voting members would survive
  the loss of neither. etcd's own consensus keeps the state while a
  majority lives.
- Every 2 s the steward (the healthy member with the smallest name) checks the other
  members' health, the others its own (all, while one is down or calls fail). It
  removes a member down for ``grace`` seconds (at once when its port refuses: its
  process is gone), and a node that is not a member, woken by the seats key the
  steward sets, takes the seat: the next loss is survived too.
- Quorum lost (a majority gone at once): once it is certain (:mod:`._quorum`: their
  ports refuse at two looks, or they are silent for 10 s, 30 s while a voting member
  added starts, and none answers a patient check), the client is given up, every call fails at once, and the agent ends the
  job with one line naming the members unreachable.
- A member that leaves with its node removes the members down now, then itself, so
  the nodes still running keep their quorum (etcd's own reconfiguration check is off:
  it refuses any removal in a cluster younger than 5 s). The members leave one at a
  time (under the lock the joiners take), and only to a member up that every node's
  client knows of; the last one stays until the other nodes' clients have closed
  (a job's end: every node leaves at once, and their last calls need a member).

The members' decisions are pure (:mod:`relaunch.rendezvous._seats`); this module is
their I/O: the member list, health checks, the etcd process (through its keeper).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time

from relaunch._endpoint import port_free
from relaunch.errors import StoreConnectionError, StoreError
from relaunch.rendezvous._member_calls import (
    Leave,
    await_others,
    client_endpoints,
    join_cluster,
    leave_in_turn,
    list_members,
    members_lock,
    promote_once,
    reach,
    remove_member,
)
from relaunch.rendezvous._member_specs import EmbeddedSettings, bind_address, first_member
from relaunch.rendezvous._quorum import QuorumWatch, health_now, quorum_lost_line
from relaunch.rendezvous._seats import Member, asked_health, plan, seated
from relaunch.store._etcd_member import EtcdMember, Health, MemberSpec, member_health
from relaunch.store.etcd import EtcdStore

__all__ = ["EmbeddedSettings", "EmbeddedStore"]

log = logging.getLogger(__name__)

_JOIN_TIMEOUT = 30.0  # seconds a new member may take to become healthy
_LOCK_WAIT = _JOIN_TIMEOUT + 15.0  # a leaver's wait for the members' lock (a joiner's hold)
_SILENT_AFTER = 10.0  # seconds a majority of members may be silent before the store is lost
_TROUBLED_AFTER = 2.0  # seconds of failing calls before a node that is no member looks


class EmbeddedStore:
    """This node's part of the embedded store: a client of the cluster, maybe a
    member, and the thread that keeps the members whole. :meth:`close` ends both."""

    def __init__(self, settings: EmbeddedSettings) -> None:
        self._cfg = settings
        self._name = f"{settings.address}-{os.getpid()}-{settings.run_id}"
        self._lock_key = f"relaunch/embedded/{settings.run_id}/joining"
        self._keys = (self._lock_key, f"relaunch/embedded/{settings.run_id}/staying")
        self._clients = f"relaunch/embedded/{settings.run_id}/clients/"
        """Each node's key, under its client's lease: gone once its client closed."""
        self._seats_key = f"relaunch/embedded/{settings.run_id}/seats"  # set: a seat is free
        self._member: EtcdMember | None = None
        self._members: list[Member] = []
        self._down: dict[str, float] = {}
        self._seen: dict[str, Health] = {}
        """Each member's health at this node's last look (a member's look only)."""
        self._quorum = QuorumWatch(
            silent_after=max(settings.grace, _SILENT_AFTER), starting_after=_JOIN_TIMEOUT
        )
        self._listed_at = -math.inf  # when the member list was last read (monotonic)
        self._preferred: tuple[str, int] | None = None  # where the client was last moved
        self._up_since: dict[str, float] = {}
        """When this node first saw each member started (monotonic)."""
        self._left = Leave(out=False)
        self._staying = False
        """This node's member leaves last: the others' last calls come here."""
        self._leaving = False
        self._refused: set[str] = set()
        self._store: EtcdStore | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._admitted = False
        self._thread: threading.Thread | None = None
        self._view_lock = threading.Lock()

    # -- starting ----------------------------------------------------------------------

    def start(self) -> EtcdStore:
        """Start or reach the cluster, join it if seats are free, start the keeper
        thread; returns the client the rendezvous uses (closed by :meth:`close`)."""
        host, port = self._cfg.endpoint
        try:
            if self._cfg.hosts and port_free(bind_address(self._cfg), port):
                try:
                    self._launch(first_member(self._cfg, self._name, port))
                except StoreConnectionError as exc:  # another agent here took the port first
                    log.info("embedded store: not the first member (%s); joining", exc)
            # as patient as a member's start: while a voting member added to a pair
            # starts, the loss of one of the pair leaves no quorum until it runs
            store = EtcdStore([(host, port)], timeout=_JOIN_TIMEOUT)
            store.on_trouble(self._wake.set)  # (a look now: the quorum may be lost)
            self._store = store
            reach(store, self._cfg.endpoint, self._cfg.read_timeout)
            self._refresh()
            store.set_ephemeral(self._clients + self._name, b"1", self._cfg.lease_ttl)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"relaunch-embedded-store-{self._cfg.run_id}", daemon=True
        )
        self._thread.start()
        return store

    def _launch(self, spec: MemberSpec) -> None:
        """Start this node's member; return once it answers healthy (it has a leader)."""
        member = EtcdMember(self._cfg.binary, spec, self._cfg.log_dir)
        try:
            member.wait_healthy(_JOIN_TIMEOUT, cancel=self._stop)
        except BaseException:
            member.stop()
            raise
        self._member = member
        log.info("embedded store: member %s serves %s", spec.name, spec.client_url)

    # -- keeping the members whole ------------------------------------------------------

    def admitted(self) -> None:
        """This node was let into the job (its program and secret checked): it may
        take a member's seat from now on (a refused node never does). Called at each
        round: the members look now (a round may follow a member's loss)."""
        self._admitted = True
        self._wake.set()

    def _run(self) -> None:
        # judged first: a look at a store without a quorum may wait out a call's timeout
        while self._sleep() and not self._judge():
            store = self._store
            if self._member is None and store is not None and store.troubled_for() > 0:
                continue
            try:
                self._refresh()
                self._tend()
            except StoreError as exc:
                log.debug("embedded store: members not tended this time: %s", exc)
            except Exception:
                log.exception("embedded store: tending the members failed")

    def _judge(self) -> bool:
        """Give the client up once the quorum is lost for good (:mod:`._quorum`): a
        member judges by its last look; another node looks only while its calls fail.
        Whether the store is lost (the thread ends: nothing is left to tend)."""
        store = self._store
        if store is None or store.lost is not None:
            return True
        if self._leaving:  # (a job's end: the members leave one by one)
            return False
        with self._view_lock:
            members = list(self._members)
        if self._member is None and store.troubled_for() < _TROUBLED_AFTER:
            self._quorum.clear()
            return False
        seen = self._seen if self._member is not None else health_now(members)
        line = self._quorum.look(members, seen)
        if line is not None:
            log.info("embedded store: given up: %s", line)
            store.give_up(line)
        return line is not None

    def _sleep(self) -> bool:
        """Wait for the next look (:meth:`_pace`); False once stopping. A node that may
        take a seat wakes as soon as the steward frees one (it watches the seats key):
        until the seat is filled again, a second member's loss takes the quorum."""
        pace, store = self._pace(), self._store
        # (while seats are free, it looks every 0.5 s anyway)
        seating = self._member is None and self._admitted and not self._leaving
        if store is not None and seating and pace > 1.0:
            began, changed = time.monotonic(), False
            with contextlib.suppress(StoreError):  # (its look finds out what went wrong)
                changed = store.watch(self._seats_key, pace, cancel=self._stop)
            pace = 0.0 if changed else max(0.0, pace - (time.monotonic() - began))
        self._wake.wait(pace)
        self._wake.clear()
        return not self._stop.is_set()

    def _pace(self) -> float:
        """Seconds to the next look: 0.5 while seats are free or a member is down (the
        store grows a member at a time, and a job whose store host is lost before a
        majority of members run is lost), or while calls fail (the quorum may be lost);
        then the members watch each other every
        interval, and the others only look for a free seat and the members' addresses,
        less often (idle CPU of etcd)."""
        with self._view_lock:
            growing = seated(self._members, self._down) < self._cfg.target
        if growing or (self._store is not None and self._store.troubled_for() > 0):
            return min(0.5, self._cfg.interval)
        return self._cfg.interval if self._member is not None else 3 * self._cfg.interval

    def _refresh(self) -> None:
        """Read the member list (:meth:`_listed`), check the health of the members
        :func:`asked_health` names, point the client at the started members."""
        assert self._store is not None
        now = time.monotonic()
        members = self._listed(now)
        refused = set()
        self._seen = {}
        served = self._store.troubled_for() == 0
        asked = asked_health(members, self._me(), self._down, self._cfg.target, served)
        for m in members:
            seen = member_health(m.client_urls, local=True) if m.id in asked else "healthy"
            self._seen[m.id] = seen
            if m.started and seen == "healthy":
                self._down.pop(m.id, None)
            else:
                self._down.setdefault(m.id, now)
                if seen == "refused":
                    refused.add(m.id)
        self._refused = refused
        listed = {m.id for m in members}
        for gone in set(self._down) - listed:
            del self._down[gone]
        self._up_since = {m.id: self._up_since.get(m.id, now) for m in members if m.started}
        with self._view_lock:
            self._members = members
        urls = client_endpoints(members, spread=self._name, down=self._down)
        if urls:  # moved to the member it prefers when that one changed (else: failed over)
            self._store.use_endpoints(urls, move=urls[0] != self._preferred)
            self._preferred = urls[0]
        if self._member is not None and not self._member.running():
            if not self._leaving:  # (else: it left the cluster, it does not come back)
                log.warning("embedded store: this node's etcd member stopped; it may join again")
            self._member.stop()
            self._member = None

    def _listed(self, now: float) -> list[Member]:
        """The members, read from the cluster; by a member while every member is up and
        seated, once per ``3 * interval`` (a loss its health checks see at once, and a
        seat filled is read while seats are free)."""
        assert self._store is not None
        with self._view_lock:
            cached = self._members
        settled = not self._down and not self._refused and seated(cached) >= self._cfg.target
        if self._member is not None and settled and now - self._listed_at < 3 * self._cfg.interval:
            return cached
        members = list_members(self._store)
        self._listed_at = now
        return members

    def _me(self) -> str | None:
        return self._name if self._member is not None else None

    def _tend(self) -> None:
        assert self._store is not None
        decided = plan(
            self._members,
            self._me(),
            self._cfg.target,
            self._down,
            time.monotonic(),
            self._cfg.grace,
            _JOIN_TIMEOUT + 10.0,
            self._refused,
        )
        for member_id in decided.remove:
            name = next(
                (m.name or "(never started)" for m in self._members if m.id == member_id), ""
            )
            if remove_member(self._store, member_id, name):
                why = "its port refuses" if member_id in self._refused else "down past the grace"
                log.warning("embedded store: member %s removed (%s)", name, why)
        if decided.remove:  # wake the nodes that wait for a seat (they watch this key)
            with contextlib.suppress(StoreError):
                self._store.set(self._seats_key, repr(time.time()).encode())
        for learner in (m for m in self._members if m.id == decided.promote):
            promote_once(self._store, learner)  # else tried again next time
        if decided.join and self._admitted and not self._leaving:
            self._join()

    def _join(self) -> None:
        """Under the members' lock, add this node's member (:meth:`_add_member`)."""
        assert self._store is not None
        store = self._store
        with members_lock(store, self._lock_key, self._name, ttl=self._cfg.lease_ttl) as held:
            if held:
                join_cluster(store, self._cfg, self._name, launch=self._launch,
                             leaving=lambda: self._stop.is_set() or self._leaving)  # fmt: skip
        if self._member is not None:  # the client knows its own member now: it may stay last
            self._refresh()

    # -- what the others read --------------------------------------------------------------

    def endpoints(self) -> list[tuple[str, int]]:
        """The started members' client endpoints, as last listed."""
        with self._view_lock:
            return client_endpoints(self._members)

    def lost_reason(self, exc: BaseException) -> str:
        """The line that ends the job when the store cannot be reached: the verdict's
        (:meth:`_judge`), else one of each member's health checked now."""
        if self._store is not None and (line := self._store.lost) is not None:
            return line
        with self._view_lock:
            members = list(self._members)
        return quorum_lost_line(members, health_now(members), str(exc))

    # -- stopping ----------------------------------------------------------------------

    def leaving(self) -> None:
        """This node is leaving the job: it takes no seat from now on (one freed by a
        member leaving with it), and its client is pointed at every member now (those
        it last saw may leave meanwhile; one started since may be the one that stays)."""
        self._leaving = True
        if (store := self._store) is not None:
            with contextlib.suppress(StoreError):
                if urls := client_endpoints(list_members(store)):
                    store.use_endpoints(urls)

    def leave(self) -> bool:
        """Leave the cluster (the node leaves the job) unless no other member up is one
        every client surely knows (up longer than their look, ``3 * interval``, or
        staying). True when out (or never a member); False: it stays (:meth:`close`)."""
        store, member = self._store, self._member
        if member is None or not member.running() or store is None or self._left.out:
            return True  # (a member whose process ended was removed, or is removed)
        if store.lost is not None:
            return True  # no cluster is left to leave
        settled = time.monotonic() - 3 * self._cfg.interval - 1.0
        with self._view_lock:
            since = dict(self._up_since)
        known = lambda m: since.get(m.id, settled + 1.0) <= settled  # noqa: E731
        self._left = leave_in_turn(store, self._keys, self._name, ttl=self._cfg.lease_ttl,
                                   wait=_LOCK_WAIT, known=known)  # fmt: skip
        self._staying = not self._left.out
        return self._left.out

    @property
    def is_member(self) -> bool:
        """Whether this node runs a member of the cluster now."""
        return self._member is not None

    def close(self) -> None:
        """Stop tending; leave the cluster (:meth:`leave`; the last member once the
        others' clients closed); close the client; stop this node's member. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._store is not None:
            self._store.hurry()  # the members may be gone before this node
            self._store.end_watches()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self._cfg.read_timeout + 15)
        store = self._store
        lost = store is not None and store.lost is not None  # (nothing to leave, or wait for)
        try:
            if store is not None and not lost and not self._staying:
                self.leave()  # (where the node's shutdown did not get to it)
            if store is not None and not lost and self._staying and not self._left.out:
                await_others(store, self._clients, self._name, self._cfg.lease_ttl + 1.0)
                self._left = leave_in_turn(store, self._keys, self._name,
                                           ttl=self._cfg.lease_ttl, wait=_LOCK_WAIT)  # fmt: skip
        finally:
            self._store = None
            member, self._member = self._member, None
            try:
                if store is not None:
                    store.close()
            finally:
                if member is not None:
                    member.stop(at_once=self._left.gone or lost)
