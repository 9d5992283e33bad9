"""The snapshot exchange between agents: versioned JSON lines, then raw bytes (no pickle).

Requests follow one another on a connection (:class:`~._channel.Channel`), each a JSON
line of at most 4 KiB::

    {"v": 1, "job": J, "op": "list"}                      what the node holds
    {"v": 1, "job": J, "op": "list", "since": V}          the same, once the node's
                                                          snapshots changed after V (≤ 1 s)
    {"v": 1, "job": J, "op": "get", "rank": R, "step": S}  one snapshot's bytes
    {"v": 1, "job": J, "op": "ack", "rank": R, "step": S, "crc": C}
                                                          the ring successor holds it
    {"v": 1, "job": J, "op": "saved", "rank": R, "step": S}
                                                          a local worker made it
    {"v": 1, "job": J, "op": "wait_ack", "rank": R, "step": S, "crc": C}
                                                          a local worker waits (≤ 1 s)

The answer is a JSON line of at most 1 MiB, and for ``get`` the snapshot's data::

    {"v": 1, "ok": true, "ranks": {"3": [[step, crc32], ...]}, "version": V,
     "settled": B}             (newest first; B false while the node fetches its ranks)
    {"v": 1, "ok": true, "manifest": "<manifest.json>", "nbytes": N}  + N bytes
    {"v": 1, "ok": true, "peer": true}        (saved: a successor copies this node's)
    {"v": 1, "ok": true, "acked": true, "peer": true}                     (wait_ack)
    {"v": 1, "ok": false, "error": "..."}

Every reader here checks every field and raises WireError naming the one that is
wrong; the receiver of a snapshot checks its length and CRC-32 against its manifest
before it keeps it. Standard library only (the agent never imports torch).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any, NamedTuple

from relaunch._json import loads as json_loads
from relaunch.errors import SnapshotError

__all__ = [
    "MAX_ANSWER",
    "MAX_REQUEST",
    "VERSION",
    "Ack",
    "Get",
    "ListSteps",
    "Listing",
    "Saved",
    "Steps",
    "WaitAck",
    "WireError",
    "check_ok",
    "decode_answer",
    "decode_listing",
    "decode_request",
    "encode",
    "flag",
    "next_line",
    "read_line",
]

VERSION = 1
MAX_REQUEST = 4096
MAX_ANSWER = 1 << 20


class WireError(SnapshotError):
    """A message of the snapshot exchange that is not what the protocol says."""


@dataclass(frozen=True)
class Get:
    rank: int
    step: int


@dataclass(frozen=True)
class ListSteps:
    """A request for the ``(step, crc32)`` of every complete snapshot the peer holds
    (with ``since``: once its snapshots changed after that version, or a second passed)."""

    since: int | None = None


@dataclass(frozen=True)
class Ack:
    """The ring successor holds ``rank``'s snapshot of ``step`` (whose CRC is ``crc``)."""

    rank: int
    step: int
    crc: int


@dataclass(frozen=True)
class Saved:
    """A worker of this node completed its snapshot of ``step``."""

    rank: int
    step: int


@dataclass(frozen=True)
class WaitAck:
    """A worker of this node waits until its snapshot of ``step`` has a peer copy."""

    rank: int
    step: int
    crc: int


Steps = dict[int, list[tuple[int, int]]]
"""Global rank -> ``(step, crc32)`` of its complete snapshots, newest first."""


class Listing(NamedTuple):
    """What a node holds (a list answer)."""

    steps: Steps
    version: int
    """The version of the node's snapshots these are."""
    settled: bool
    """False while the node fetches the snapshots of the ranks it runs this round (what
    it holds of them may be of a timeline the job left: no successor mirrors it yet)."""


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps({"v": VERSION, **doc}, separators=(",", ":")).encode() + b"\n"


def read_line(sock: socket.socket, limit: int) -> bytes:
    """One line (without its newline), read byte-exactly so what follows stays unread.
    WireError past ``limit`` bytes or when the peer closes first."""
    line = next_line(sock, limit)
    if line is None:
        raise WireError("the peer closed the connection after 0 bytes")
    return line


def next_line(sock: socket.socket, limit: int) -> bytes | None:
    """:func:`read_line`, or None when the peer closed the connection before a byte
    of the line (between two requests: it is done)."""
    buf = bytearray()
    while True:
        chunk = sock.recv(min(4096, limit + 1 - len(buf)), socket.MSG_PEEK)
        if not chunk:
            if not buf:
                return None
            raise WireError(f"the peer closed the connection after {len(buf)} bytes")
        end = chunk.find(b"\n")
        take = len(chunk) if end < 0 else end + 1
        buf += sock.recv(take)
        if end >= 0:
            return bytes(buf[:-1])
        if len(buf) > limit:
            raise WireError(f"a line longer than {limit} bytes")


def _object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json_loads(raw)
    except ValueError as exc:
        raise WireError(f"{what}: not JSON ({exc}): {raw[:120]!r}") from exc
    if not isinstance(doc, dict):
        raise WireError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("v") != VERSION:
        raise WireError(f"{what}: v: expected {VERSION}, got {doc.get('v')!r}")
    return doc


def _count(doc: dict[str, Any], key: str, what: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WireError(f"{what}: {key}: expected a non-negative int, got {value!r}")
    return value


Request = Get | ListSteps | Ack | Saved | WaitAck


def decode_request(raw: bytes, job: str) -> Request:
    """A request for this ``job``; WireError naming what is wrong (another job too)."""
    doc = _object(raw, "request")
    if doc.get("job") != job:
        raise WireError(f"request: job: expected {job!r}, got {doc.get('job')!r}")
    op = doc.get("op")
    what = f"request {op}"
    if op == "list":
        return ListSteps(None if doc.get("since") is None else _count(doc, "since", what))
    if op not in ("get", "ack", "saved", "wait_ack"):
        raise WireError(
            f"request: op: expected 'list', 'get', 'ack', 'saved' or 'wait_ack', got {op!r}"
        )
    rank, step = _count(doc, "rank", what), _count(doc, "step", what)
    if op == "get":
        return Get(rank, step)
    if op == "saved":
        return Saved(rank, step)
    crc = _count(doc, "crc", what)
    return Ack(rank, step, crc) if op == "ack" else WaitAck(rank, step, crc)


def check_ok(raw: bytes, what: str) -> None:
    """WireError unless ``raw`` is an answer that says ok."""
    _answer(raw, what)


def flag(raw: bytes, name: str) -> bool:
    """The boolean ``name`` of an answer (saved, wait_ack)."""
    doc = _answer(raw, f"{name} answer")
    value = doc.get(name)
    if not isinstance(value, bool):
        raise WireError(f"answer: {name}: expected true or false, got {value!r}")
    return value


def _answer(raw: bytes, what: str) -> dict[str, Any]:
    doc = _object(raw, what)
    if doc.get("ok") is False:
        raise WireError(f"{what}: the peer refused: {str(doc.get('error'))[:300]}")
    if doc.get("ok") is not True:
        raise WireError(f"{what}: ok: expected true or false, got {doc.get('ok')!r}")
    return doc


def decode_listing(raw: bytes) -> Listing:
    """A list answer (``settled`` absent: true, an agent that never said)."""
    doc = _answer(raw, "list answer")
    ranks = doc.get("ranks")
    if not isinstance(ranks, dict):
        raise WireError(f"list answer: ranks: expected an object, got {type(ranks).__name__}")
    out: Steps = {}
    for key, steps in ranks.items():
        if not (key.isascii() and key.isdigit()):  # ("²" is a digit, not a number)
            raise WireError(f"list answer: ranks: expected a rank number, got {key!r}")
        if not isinstance(steps, list):
            raise WireError(f"list answer: ranks.{key}: expected a list")
        pairs = []
        for pair in steps:
            ok = isinstance(pair, list) and len(pair) == 2
            ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair)
            if not ok:
                raise WireError(f"list answer: ranks.{key}: expected [step, crc32], got {pair!r}")
            pairs.append((pair[0], pair[1]))
        out[int(key)] = pairs
    settled = doc.get("settled", True)
    if not isinstance(settled, bool):
        raise WireError(f"list answer: settled: expected true or false, got {settled!r}")
    return Listing(out, _count(doc, "version", "list answer"), settled)


def decode_answer(raw: bytes) -> tuple[str, int]:
    """A get answer: the manifest's text and the number of data bytes that follow."""
    doc = _answer(raw, "get answer")
    manifest = doc.get("manifest")
    if not isinstance(manifest, str):
        raise WireError(f"get answer: manifest: expected a string, got {type(manifest).__name__}")
    return manifest, _count(doc, "nbytes", "get answer")
