"""Who runs the embedded store's etcd members: pure decisions over a member list.

The I/O (listing members, health checks, starting etcd) is in
:mod:`relaunch.rendezvous._replicated`; this module only reads what was seen.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Member", "Plan", "parse_members", "plan"]

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
    """Member ids to remove (down past the grace, or joining for too long)."""
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
) -> Plan:
    """Decide for this node.

    ``me``: this node's member name, or None when it is not a member. ``down``: member
    id -> when it was first seen unhealthy or joining. Only the *steward* removes: the
    healthy voting member with the smallest name, so one node acts. A voting member
    is removed when it has been down ``grace`` seconds, a joining one (a learner, or
    added and never started: its node died while joining) after ``join_grace``;
    never the last voting member. A node that is not a member tries to join when
    the members, less those being removed, are fewer than ``target`` and none is
    joining (one at a time).
    """
    healthy = sorted(m.name for m in members if not m.joining and m.id not in down)
    steward = healthy[0] if healthy else None
    remove: tuple[str, ...] = ()
    if me is not None and me == steward:
        gone = [
            m.id
            for m in members
            if m.id in down and now - down[m.id] >= (join_grace if m.joining else grace)
        ]
        voting = [m for m in members if not m.joining]
        if any(m.id not in gone for m in voting):
            remove = tuple(gone)
    staying = [m for m in members if m.id not in remove]
    joining = any(m.joining for m in staying)
    join = me is None and len(staying) < target and not joining and bool(healthy)
    return Plan(remove=remove, join=join)
