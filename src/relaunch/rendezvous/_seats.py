"""Who runs the embedded store's etcd members: pure decisions over a member list.

The I/O (listing members, health checks, starting etcd) is in
:mod:`relaunch.rendezvous._replicated`; this module only reads what was seen.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "JoinSteps",
    "Member",
    "Plan",
    "asked_health",
    "join_steps",
    "parse_members",
    "plan",
    "quorum_gone",
    "seated",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """One etcd member as the cluster lists it."""

    id: str
    name: str
    """Empty while the member was added but has not started."""
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]
    learner: bool = False
    """Added as a learner (no vote) and not yet promoted: still joining."""

    @property
    def started(self) -> bool:
        return bool(self.name) and bool(self.client_urls)

    @property
    def joining(self) -> bool:
        """Added, not yet a voting member that runs."""
        return self.learner or not self.started


def parse_members(reply: Mapping[str, Any]) -> list[Member]:
    """The members of a ``/cluster/member/list`` (or ``/member/add``) reply; an entry
    that is not a member record is skipped with a warning (a reply is never trusted)."""
    raw = reply.get("members")
    if not isinstance(raw, list):
        return []
    found = []
    for entry in raw:
        try:
            found.append(
                Member(
                    id=str(int(entry["ID"])),
                    name=str(entry.get("name", "")),
                    peer_urls=tuple(str(u) for u in entry.get("peerURLs", ())),
                    client_urls=tuple(str(u) for u in entry.get("clientURLs", ())),
                    learner=entry.get("isLearner", False) is True,
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            log.warning("etcd member list: an entry that is not a member: %r", entry)
    return found


@dataclass(frozen=True)
class Plan:
    """What this node does now about the members."""

    remove: tuple[str, ...] = ()
    """Member ids to remove (down past the grace, or never started in time)."""
    promote: str | None = None
    """A learner to promote now (the steward, when the voting members are even)."""
    join: bool = False
    """Whether this node should try to become a member (the seat lock decides)."""


def plan(
    members: Sequence[Member],
    me: str | None,
    target: int,
    down: Mapping[str, float],
    now: float,
    grace: float,
    join_grace: float,
    refused: Collection[str] = (),
) -> Plan:
    """Decide for this node.

    ``me``: this node's member name, or None when it is not a member. ``down``: member
    id -> when it was first seen unhealthy or not started. Only the *steward* acts on
    members: the healthy voting member with the smallest name, so one node acts. It
    removes a member down ``grace`` seconds, a started one whose port ``refused`` the
    last check at once (its process is gone: no grace helps, and a second loss before
    its seat is filled again would take the quorum), or one added and never started
    (its node died while joining) after ``join_grace``, never the last voting member; and it
    promotes a learner that is up when the voting members are even (an odd count
    survives as many losses as the next even one, and never fewer). A node that is
    not a member tries to join when the members, less those being removed, are fewer
    than ``target`` and none is starting (one at a time).
    """
    voting = [m for m in members if not m.learner]
    healthy = sorted(m.name for m in voting if m.started and m.id not in down)
    steward = healthy[0] if healthy else None
    remove: tuple[str, ...] = ()
    promote: str | None = None
    if me is not None and me == steward:
        gone = [
            m.id
            for m in members
            if m.id in down
            and (
                (m.started and m.id in refused)
                or now - down[m.id] >= (grace if m.started else join_grace)
            )
        ]
        if any(m.id not in gone for m in voting):
            remove = tuple(gone)
        staying = [m for m in voting if m.id not in remove]
        ready = [m for m in members if m.learner and m.started and m.id not in down]
        if ready and len(staying) % 2 == 0:
            promote = ready[0].id
    staying_all = [m for m in members if m.id not in remove]
    starting = any(not m.started for m in staying_all)
    join = me is None and len(staying_all) < target and not starting and bool(healthy)
    return Plan(remove=remove, promote=promote, join=join)


@dataclass(frozen=True)
class JoinSteps:
    """How a node joins, decided under the seat lock from a fresh member list."""

    promote_first: str | None
    """The learner to promote before this node is added (it waited for a pair)."""
    voting: bool
    """Whether this node is added as a voting member (the count becomes odd), else as a
    learner that waits for the next node."""


def join_steps(members: Sequence[Member], target: int) -> JoinSteps | None:
    """The steps of a node joining now, or None when it should not (the seats are
    taken, or a member is still starting).

    The voting members grow in pairs: etcd holds one learner at a time, so the first
    new node waits as a learner beside an odd number of voting members (a learner
    that never starts costs no quorum), and the next one promotes it and is added as
    a voting member at once: 1 -> 3 -> 5. While that third (or fifth) member starts,
    the running ones hold the quorum, and when one of them is lost the cluster waits
    for it and goes on. An even count that one loss stops for good is left only for
    the moment between the promotion and the addition (two calls), not for the new
    member's start (seconds on a loaded machine, when it was added as a learner and
    promoted once caught up).
    """
    if len(members) >= target or any(not m.started for m in members):
        return None
    learners = [m for m in members if m.learner]
    voting = len(members) - len(learners) + len(learners[:1])
    return JoinSteps(promote_first=learners[0].id if learners else None, voting=voting % 2 == 0)


def asked_health(
    members: Sequence[Member], me: str | None, down: Collection[str], target: int, served: bool
) -> set[str]:
    """The members whose health a look of this node asks for (``me``: its member's name,
    None when it is no member: it asks for none; ``served``: the store's calls are being
    answered, so its quorum stands). Every member while one is ``down``, a seat is free,
    or the calls fail: the steward's replacements and the quorum's judgement need every
    member's health then. Else the steward (:func:`plan`) asks for every other member's,
    to see a loss, and another member for the steward's alone, to take the role over
    when it goes. Every member asking for every member's at each look cost 0.2-0.3% of
    a core per node at idle (4 nodes, 3 members: 4.5 checks a second)."""
    if me is None:
        return set()
    everyone = {m.id for m in members}
    voting = sorted((m for m in members if m.started and not m.learner), key=lambda m: m.name)
    if down or not served or seated(members) < target or not voting:
        return everyone
    if voting[0].name == me:
        return {m.id for m in members if m.name != me}
    return {voting[0].id}


def seated(members: Sequence[Member], down: Collection[str] = ()) -> int:
    """How many of ``members`` vote and run, those seen ``down`` left out."""
    return sum(1 for m in members if m.started and not m.learner and m.id not in down)


def quorum_gone(
    members: Sequence[Member],
    seen: Mapping[str, str],
    leaderless_for: float,
    *,
    refused_after: float,
    silent_after: float,
    starting_after: float,
) -> bool:
    """Whether the store lost its quorum for good, from one look at each member's health
    (``seen``: member id -> ``healthy``, ``refused`` or ``unhealthy``) and how long no
    member has been healthy. The voting members (learners have no vote; an added voter
    that has not started counts) that still run cannot form a majority: for
    ``refused_after`` seconds when the others' ports refuse (their processes are gone,
    and a member never comes back under its id), for ``silent_after`` when they are only
    silent (a machine gone without a word, or a network cut that may heal), and for
    ``starting_after`` while a voter added has not started (it may be the one missing)."""
    voters = [m for m in members if not m.learner]
    if not voters or "healthy" in seen.values():
        return False
    majority = len(voters) // 2 + 1
    refused = sum(1 for m in voters if seen.get(m.id) == "refused")
    if refused > len(voters) - majority:
        return leaderless_for >= refused_after
    if any(not m.started for m in voters):
        return leaderless_for >= max(silent_after, starting_after)
    return leaderless_for >= silent_after
