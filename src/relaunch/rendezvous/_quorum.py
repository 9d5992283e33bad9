"""The embedded store's quorum, watched: the verdict that it is lost for good, and the
line that ends the job.

A store without a quorum answers no call until a majority of its voting members runs
again, and when their processes are gone that is never. Without a verdict each call of
an agent waited its whole timeout before it failed (the client's 30 s; etcd's own
request timeout for a write in flight), call after call, the leave and the lease's
revoke included: a 3-node job whose two member nodes were SIGKILLed ended 73 s after the
fault. With one, the client is given up (:meth:`~relaunch.store.etcd.EtcdStore.give_up`)
once the loss is certain, and every call after it fails at once.

The members look at each other's health at each of their keeper thread's looks; a node
that is not a member looks only once its own calls have failed for 2 s (no traffic at
idle, none from a thousand nodes while the members elect a leader).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from relaunch.rendezvous._member_calls import answers
from relaunch.rendezvous._seats import Member, quorum_gone
from relaunch.store._etcd_member import Health, is_etcd, member_health

__all__ = ["QuorumWatch", "health_now", "quorum_lost_line"]

REFUSED_AFTER = 0.5
"""Seconds a majority of the voting members' ports must refuse (two looks or more: a
member looks every 0.5 s while one is down)."""


class QuorumWatch:
    """The verdict of the looks at the members' health (:meth:`look`, one per look)."""

    def __init__(
        self,
        *,
        silent_after: float,
        starting_after: float,
        refused_after: float = REFUSED_AFTER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._silent_after = silent_after
        self._starting_after = starting_after
        self._refused_after = refused_after
        self._clock = clock
        self._since: float | None = None
        """When a look first found no member healthy (None: the last one found one)."""

    def clear(self) -> None:
        """The store answers: whatever was seen before does not count."""
        self._since = None

    def look(self, members: Sequence[Member], seen: Mapping[str, Health]) -> str | None:
        """The line that ends the job once the quorum is lost for good
        (:func:`~relaunch.rendezvous._seats.quorum_gone`), confirmed by a patient check
        of each member through its leader (a loaded machine's slow answers are no loss);
        None until then."""
        now = self._clock()
        if "healthy" in seen.values():
            self._since = None
            return None
        if self._since is None:
            self._since = now
        gone = quorum_gone(members, seen, now - self._since, refused_after=self._refused_after,
                           silent_after=self._silent_after, starting_after=self._starting_after)  # fmt: skip
        if not gone:
            return None
        if any(answers(m.client_urls) for m in members if m.started):
            self._since = None
            return None
        return quorum_lost_line(members, seen)


def health_now(members: Sequence[Member]) -> dict[str, Health]:
    """Each member's health, checked now (one not started: unhealthy)."""
    return {m.id: member_health(m.client_urls) for m in members}


def quorum_lost_line(
    members: Sequence[Member], seen: Mapping[str, Health], cause: str | None = None
) -> str:
    """The line that ends the job: the voting members unreachable by name, how many still
    run (their process answers, without a leader) of how many a quorum needs."""
    voters = [m for m in members if not m.learner]
    running = [
        m for m in voters
        if seen.get(m.id) == "healthy"
        or (seen.get(m.id) == "unhealthy" and any(is_etcd(u, 0.5) for u in m.client_urls))
    ]  # fmt: skip
    down = [m.name or "(never started)" for m in voters if m not in running]
    because = f" ({cause})" if cause else ""
    # none answers: this node's own link may be what is gone (a cable pulled here)
    alone = "" if running else ", or this node can reach none of its members"
    return (
        f"the embedded rendezvous store lost its quorum{alone}: members "
        f"{', '.join(down) or '?'} unreachable; {len(running)} of {len(voters)} voting "
        f"members run, a quorum needs {len(voters) // 2 + 1}{because}"
    )
