"""The places a rendezvous hands out, as small records nodes read instead of the state.

``assign/<r>/<node>`` holds an :class:`Assignment` (a participant's rank, the round's
size, the incarnation its workers start at, the node it watches); ``ack/<t>`` holds a
:class:`JoinAck` (what the applier of join request ``t`` decided). Pure codecs: a record
that does not parse is None, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass

from relaunch.rendezvous._state import RendezvousState, round_size

__all__ = ["Assignment", "JoinAck", "assignment_of", "successors"]


@dataclass(frozen=True)
class Assignment:
    """A participant's place in a complete round, at ``assign/<r>/<node>``."""

    rank: int
    world_size: int
    incarnation: int = 0
    """The incarnation its workers start at (a vacancy's; else 0)."""
    successor: str | None = None
    """The next participant by rank, whose lifeline this node watches (None: alone)."""

    def encode(self) -> bytes:
        return f"{self.rank} {self.world_size} {self.incarnation} {self.successor or '-'}".encode()

    @classmethod
    def parse(cls, raw: bytes) -> Assignment | None:
        parts = raw.decode(errors="replace").split()
        try:
            if len(parts) == 4:
                nxt = None if parts[3] == "-" else parts[3]
                return cls(int(parts[0]), int(parts[1]), int(parts[2]), nxt)
            if len(parts) == 2:
                return cls(int(parts[0]), int(parts[1]))
        except ValueError:
            pass
        return None


@dataclass(frozen=True)
class JoinAck:
    """What the applier of a request tells its node, at ``ack/<t>``."""

    epoch: int
    round: int
    participant: bool
    """Whether the node is a participant of ``round`` (else: read the state)."""
    complete: bool
    """Whether ``round`` was complete in the state that took the node in."""
    place: Assignment | None = None
    """The node's place when its request completed the round (no more reads)."""
    left: bool = False
    """A leave request applied: the state no longer knows the node."""

    def encode(self) -> bytes:
        where = "p" if self.participant else "l" if self.left else "-"
        head = f"a {self.epoch} {self.round} {where} {'c' if self.complete else 'o'}".encode()
        return head if self.place is None else head + b" " + self.place.encode()

    @classmethod
    def parse(cls, raw: bytes) -> JoinAck | None:
        parts = raw.split(maxsplit=5)
        if len(parts) not in (5, 6) or parts[0] != b"a":
            return None
        place = Assignment.parse(parts[5]) if len(parts) == 6 else None
        if len(parts) == 6 and place is None:
            return None
        try:
            flags = parts[3] == b"p", parts[4] == b"c"
            return cls(int(parts[1]), int(parts[2]), *flags, place, left=parts[3] == b"l")
        except ValueError:
            return None


def successors(state: RendezvousState) -> dict[str, str]:
    """Each participant -> the next by rank (the node whose lifeline it watches)."""
    order = sorted(state.participants, key=state.participants.__getitem__)
    if len(order) < 2:
        return {}
    return {n: order[(i + 1) % len(order)] for i, n in enumerate(order)}


def assignment_of(
    state: RendezvousState, node: str, ring: dict[str, str] | None = None
) -> Assignment:
    """The place of ``node``, a participant of the complete round of ``state``
    (``ring``: :func:`successors` of it, when already made)."""
    rank = state.participants[node]
    after = (successors(state) if ring is None else ring).get(node)
    return Assignment(rank, round_size(state), state.incarnations.get(rank, 0), after)
