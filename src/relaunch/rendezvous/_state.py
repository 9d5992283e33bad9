"""The shared rendezvous state and its versioned JSON codec (never pickle).

A node is named by a string ``"<addr>_<pid>_<local_id>"``: the address given
with ``--local-addr`` or the host name (never a DNS lookup), the agent's pid and
a process-wide counter.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import json
import math
import os
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from relaunch.errors import RendezvousStateError
from relaunch.store.signed import is_signed

__all__ = [
    "STATE_VERSION",
    "RendezvousState",
    "decode_state",
    "encode_state",
    "new_node_id",
    "node_sort_key",
    "peer_addresses",
    "round_size",
]

STATE_VERSION = 1
"""Version of the JSON layout; a state of another version is refused."""

_counter = itertools.count()
_counter_lock = threading.Lock()


def new_node_id(local_addr: str | None = None) -> str:
    """A node id unique to this call: address (or host name), pid and a counter."""
    with _counter_lock:
        local_id = next(_counter)
    addr = local_addr or socket.gethostname()
    return f"{addr}_{os.getpid()}_{local_id}"


def node_sort_key(node: str) -> tuple[str, int, int]:
    """Sort nodes by address, then pid, then local id (the rank order)."""
    addr, _, rest = node.rpartition("_")
    addr2, _, pid = addr.rpartition("_")
    try:
        return (addr2, int(pid), int(rest))
    except ValueError:
        return (node, 0, 0)


def peer_addresses(nodes: Iterable[str]) -> frozenset[str] | None:
    """The addresses of ``nodes`` when each is an IP literal (no DNS lookup), else None."""
    try:
        return frozenset(str(ipaddress.ip_address(node_sort_key(n)[0])) for n in nodes)
    except ValueError:
        return None


@dataclass(kw_only=True)
class RendezvousState:
    """The state every node shares. Pure functions copy it (:meth:`copy`) before a change."""

    run_id: str
    seq: int = 0
    """Bumped by every write: with the bytes it is the fencing token of compare-and-set."""
    epoch: int = 0
    """Bumped by every write that waiting nodes must see (completion, a new round,
    a removal, a closed rendezvous, a new waiting node). Waiters wait on its key."""
    round: int = 0
    complete: bool = False
    closed: bool = False
    deadline: float | None = None
    """Wall-clock time at which a round with at least ``min_nodes`` completes."""
    held_until: float | None = None
    """Wall-clock time until which a round opened again holds the seats of the last
    round's nodes (``expected``, neither spares nor waiting) for them: spares and new
    nodes take only the other seats. None in a complete round."""
    participants: dict[str, int] = field(default_factory=dict)
    """Node -> rank (ranks are assigned when the round completes)."""
    wait_list: set[str] = field(default_factory=set)
    """Nodes waiting for the next round (a complete round had room)."""
    redundancy_list: set[str] = field(default_factory=set)
    """Spares: nodes beyond ``max_nodes``; they step in when a participant is lost."""
    expected: set[str] = field(default_factory=set)
    """Nodes the current round waits for before completing without a last call."""
    last_heartbeats: dict[str, float] = field(default_factory=dict)
    """Node -> wall-clock time of its last heartbeat."""
    applied: int = 0
    """Join requests (tickets) folded into this state so far."""
    restarts: int = 0
    """Failure restarts spent by the job (counted once per failed round)."""
    failed_round: int = -1
    """The last round for which a failure restart was counted."""
    inprocess: set[str] = field(default_factory=set)
    """Participants whose workers restart in-process (``relaunch.inprocess``) and may
    be replaced by rank: while every participant is one, a lost node leaves a vacancy
    in the running round instead of reopening it (tiered recovery)."""
    vacancies: dict[int, int] = field(default_factory=dict)
    """Group rank of a lost node of the complete round -> the incarnation its
    replacement's workers start at (unique, increasing); a spare or a new node fills
    it, and the other nodes' workers go on in their processes."""
    incarnations: dict[int, int] = field(default_factory=dict)
    """Group rank -> the incarnation its workers started at in this round (absent: 0)."""
    store_host: str | None = None
    """The node whose agent hosts the rendezvous store (c10d), if it takes part: it is
    rank 0 of every round, so the round's workers' store (hosted by rank 0) lives as
    long as the job can; a lost node is then never the one the others depend on."""

    def copy(self) -> RendezvousState:
        """A copy with maps and sets of its own (their items are immutable)."""
        fresh = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict | set):
                setattr(fresh, f.name, value.copy())
        return fresh

    def knows(self, node: str) -> bool:
        """Whether ``node`` appears anywhere in the state."""
        return (
            node in self.participants
            or node in self.wait_list
            or node in self.redundancy_list
            or node in self.last_heartbeats
        )

    def known(self) -> set[str]:
        """Every node that appears in the state."""
        return {*self.participants, *self.wait_list, *self.redundancy_list,
                *self.last_heartbeats}  # fmt: skip


def round_size(state: RendezvousState) -> int:
    """Nodes of the round: its participants and its vacancies (``GROUP_WORLD_SIZE``)."""
    return len(state.participants) + len(state.vacancies)


def encode_state(state: RendezvousState) -> bytes:
    """The JSON bytes of ``state`` (sorted lists, so equal states encode equally)."""
    doc = {
        "version": STATE_VERSION,
        "run_id": state.run_id,
        "seq": state.seq,
        "epoch": state.epoch,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "deadline": state.deadline,
        "participants": state.participants,
        "wait_list": sorted(state.wait_list),
        "redundancy_list": sorted(state.redundancy_list),
        "expected": sorted(state.expected),
        # Integer milliseconds: half the decoding time of floats for a large state.
        "last_heartbeats_ms": {n: round(t * 1000) for n, t in state.last_heartbeats.items()},
        "applied": state.applied,
        "restarts": state.restarts,
        "failed_round": state.failed_round,
    }
    if state.store_host is not None:
        doc["store_host"] = state.store_host
    if state.held_until is not None:
        doc["held_until"] = state.held_until
    if state.inprocess or state.vacancies or state.incarnations:
        doc["inprocess"] = sorted(state.inprocess)
        doc["vacancies"] = {str(r): i for r, i in sorted(state.vacancies.items())}
        doc["incarnations"] = {str(r): i for r, i in sorted(state.incarnations.items())}
    return json.dumps(doc, separators=(",", ":")).encode()


class _Bad(Exception):
    pass


def _int(doc: dict[str, Any], name: str) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Bad(f"field {name!r} must be an integer, got {value!r}")
    return value


def _bool(doc: dict[str, Any], name: str) -> bool:
    value = doc.get(name)
    if not isinstance(value, bool):
        raise _Bad(f"field {name!r} must be a boolean, got {value!r}")
    return value


def _nodes(doc: dict[str, Any], name: str) -> set[str]:
    value = doc.get(name)
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise _Bad(f"field {name!r} must be a list of node ids")
    return set(value)


def _mapping(doc: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> dict[str, Any]:
    value = doc.get(name)
    if not isinstance(value, dict):
        raise _Bad(f"field {name!r} must be an object")
    for item in value.values():
        if not isinstance(item, kind) or isinstance(item, bool):
            raise _Bad(f"field {name!r} holds a value of the wrong type: {item!r}")
    return dict(value)


_FIELDS = frozenset(
    {"version", "run_id", "seq", "epoch", "round", "complete", "closed", "deadline",
     "participants", "wait_list", "redundancy_list", "expected", "last_heartbeats_ms",
     "applied", "restarts", "failed_round", "inprocess", "vacancies", "incarnations",
     "store_host", "held_until"}
)  # fmt: skip
LATEST_BEAT = 1e11
"""The latest heartbeat time (seconds; the year 5138) a state may hold; beyond: corrupt.
Not a bound relative to this host's clock: another host's may be any amount ahead
(one 5 minutes ahead made the state corrupt for every other node, and the job end)."""


def _time(doc: dict[str, Any], name: str) -> float | None:
    """An optional wall-clock time (a number or null)."""
    value = doc.get(name)
    if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
        raise _Bad(f"field {name!r} must be a number or null, got {value!r:.80}")
    return None if value is None else float(value)


def _host(doc: dict[str, Any]) -> str | None:
    value = doc.get("store_host")
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 300):
        raise _Bad(f"field 'store_host' must be a node id or null, got {value!r:.80}")
    return value


def _by_rank(doc: dict[str, Any], name: str) -> dict[int, int]:
    """An optional object of group rank -> incarnation (both integers >= 0)."""
    if name not in doc:
        return {}
    out: dict[int, int] = {}
    for key, value in _mapping(doc, name, int).items():
        if not key.isdigit() or int(key) >= 2**31 or value < 0 or value >= 2**53:
            raise _Bad(f"field {name!r} maps {key[:20]!r} to {value!r}, not a rank to a count")
        out[int(key)] = value
    return out


def _check_sense(state: RendezvousState, max_nodes: int | None) -> None:
    """Refuse a well-formed state that cannot be: it was not written by our agents."""
    for name in ("seq", "epoch", "round", "applied", "restarts"):
        if getattr(state, name) < 0:
            raise _Bad(f"field {name!r} is negative ({getattr(state, name)})")
    if state.failed_round < -1:
        raise _Bad(f"field 'failed_round' is below -1 ({state.failed_round})")
    if max_nodes is not None and len(state.participants) > max_nodes:
        raise _Bad(
            f"field 'participants' has {len(state.participants)} nodes, more than "
            f"max_nodes ({max_nodes}); spares belong in 'redundancy_list'"
        )
    if any(not -1 <= r < 2**31 for r in state.participants.values()):
        raise _Bad("field 'participants' holds a rank that is not a rank")
    for node, beat in state.last_heartbeats.items():
        if not 0 <= beat <= LATEST_BEAT:
            raise _Bad(
                f"field 'last_heartbeats_ms' of node {node[:80]!r} is {beat:.0f} s, not a "
                f"time from 0 to {LATEST_BEAT:.0e} s"
            )
    for name in ("deadline", "held_until"):
        value = getattr(state, name)
        if value is not None and not math.isfinite(value):
            raise _Bad(f"field {name!r} is not finite")
    if state.held_until is not None and state.complete:
        raise _Bad("field 'held_until' is set in a round that is complete")
    if state.vacancies:
        if not state.complete:
            raise _Bad("field 'vacancies' is set in a round that is not complete")
        taken = set(state.participants.values()) & set(state.vacancies)
        if taken:
            raise _Bad(f"field 'vacancies' holds rank(s) {sorted(taken)} that a node has")


def _document(raw: bytes, run_id: str) -> dict[str, object]:
    """The JSON object of a state record of ``run_id``, of this version, with no field
    this version does not know (the fields' values are checked by the caller)."""
    if is_signed(raw):
        raise _Bad(
            "the job's records are signed with a per-job secret and this node has none "
            "(--rdzv-conf secret_file=PATH, the same file as the other nodes)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Bad(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise _Bad("not a JSON object")
    if doc.get("version") != STATE_VERSION:
        raise _Bad(f"unknown version {doc.get('version')!r} (expected {STATE_VERSION})")
    if doc.get("run_id") != run_id:
        raise _Bad(f"it belongs to run {doc.get('run_id')!r}, not {run_id!r}")
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        raise _Bad(f"unknown field(s) {', '.join(map(repr, unknown[:5]))}")
    return doc


def decode_state(
    raw: bytes,
    *,
    key: str,
    run_id: str,
    max_nodes: int | None = None,
) -> RendezvousState:
    """Decode a state read from ``key``; anything unexpected is a RendezvousStateError.

    Checked for syntax and for sense: unknown fields, negative counters, more
    participants than ``max_nodes``, ranks that are not a permutation, heartbeat times
    past :data:`LATEST_BEAT` are refused. The error names the key and the field,
    so an operator knows what to inspect or delete.
    """
    try:
        doc = _document(raw, run_id)
        deadline = _time(doc, "deadline")
        heartbeats = _mapping(doc, "last_heartbeats_ms", int)
        state = RendezvousState(
            run_id=run_id,
            seq=_int(doc, "seq"),
            epoch=_int(doc, "epoch"),
            round=_int(doc, "round"),
            complete=_bool(doc, "complete"),
            closed=_bool(doc, "closed"),
            deadline=deadline,
            held_until=_time(doc, "held_until"),
            participants=_mapping(doc, "participants", int),
            wait_list=_nodes(doc, "wait_list"),
            redundancy_list=_nodes(doc, "redundancy_list"),
            expected=_nodes(doc, "expected"),
            last_heartbeats={k: v / 1000 for k, v in heartbeats.items()},
            applied=_int(doc, "applied"),
            restarts=_int(doc, "restarts"),
            failed_round=_int(doc, "failed_round"),
            inprocess=_nodes(doc, "inprocess") if "inprocess" in doc else set(),
            vacancies=_by_rank(doc, "vacancies"),
            incarnations=_by_rank(doc, "incarnations"),
            store_host=_host(doc),
        )
        _check_sense(state, max_nodes)
        return state
    except (_Bad, ValueError, RecursionError, OverflowError) as exc:
        raise RendezvousStateError(
            f"the rendezvous state at key {key!r} is corrupt or not ours: {exc}"
        ) from exc
