"""What one agent publishes about its node: the node report, a small versioned JSON.

Written by the agent to ``relaunch/rdzv/<run_id>/status/<node id>`` on its state
changes (at most once a second), read by ``relaunch status`` and the status page.
It is bounded (:data:`MAX_REPORT_BYTES`: the oldest timeline entries go first), and
decoding is strict: a record that is not what this module writes is a
:class:`~relaunch.errors.StatusError` naming the key and the field, never a crash.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from relaunch.errors import StatusError

__all__ = [
    "FAULT_KINDS",
    "MAX_REPORT_BYTES",
    "RECOVERY_BUCKETS",
    "REPORT_VERSION",
    "TIERS",
    "FailureLine",
    "NodeReport",
    "Recovery",
    "TimelineEntry",
    "WorkerRow",
    "decode_report",
    "encode_report",
]

REPORT_VERSION = 1
MAX_REPORT_BYTES = 64 * 1024
TIMELINE_LENGTH = 40
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds (seconds) of the recovery-time histogram; a last bucket is +Inf."""
FAULT_KINDS = ("exit", "signal", "hang", "lost", "node")
"""A worker that exited non-zero, was killed by a signal, hung, or died in-process; a
node of the round lost while this node's in-process workers went on."""
TIERS = ("process", "node", "group", "membership")
"""How the agent recovered: replaced one process (peers kept running), took a lost
node's ranks back in (a spare or a new node; peers kept running), restarted the node's
workers after a failure, or restarted them for a membership change."""
_TEXT = 300  # characters kept of a free-text field


@dataclass(frozen=True, kw_only=True)
class WorkerRow:
    local_rank: int
    rank: int
    pid: int | None
    state: str
    """``running``, ``succeeded``, ``failed``, ``lost`` (died, peers went on) or ``stopped``."""
    respawns: int = 0
    iteration: int | None = None
    """The in-process restart iteration the worker is in (in-process jobs only)."""
    active: bool | None = None
    """Whether the in-process rank calls the training function (False: a spare)."""
    snapshot: int | None = None
    """The step of the rank's newest complete snapshot on this node (``relaunch.checkpoint``)."""


@dataclass(frozen=True, kw_only=True)
class FailureLine:
    """The root cause of the node's last failure, in one line."""

    rank: int
    host: str
    exitcode: int
    """Negative: killed by signal ``-exitcode``."""
    message: str
    """The exception's first line, or what killed the process."""
    time: float
    round: int = 0
    """The rendezvous round it failed in (the job's root cause is the earliest failure of
    the latest round that had one)."""


@dataclass(frozen=True, kw_only=True)
class TimelineEntry:
    time: float
    name: str
    text: str


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """Seconds from a fault to the workers running again, as a cumulative histogram."""

    count: int = 0
    total: float = 0.0
    buckets: tuple[int, ...] = (0,) * (len(RECOVERY_BUCKETS) + 1)
    """Observations per bucket (not cumulative); the last is above every bound."""

    def add(self, seconds: float) -> Recovery:
        index = next((i for i, b in enumerate(RECOVERY_BUCKETS) if seconds <= b), -1)
        buckets = list(self.buckets)
        buckets[index] += 1
        return Recovery(count=self.count + 1, total=self.total + seconds, buckets=tuple(buckets))


@dataclass(frozen=True, kw_only=True)
class NodeReport:
    node: str
    host: str
    role: str
    group_rank: int | None
    round: int | None
    attempt: int
    state: str
    """The agent's: ``starting``, ``running``, ``recovering``, ``succeeded``, ``failed``, ``stopped``."""
    updated: float
    max_restarts: int
    restarts: int
    """The job's failure restarts, as this node last saw them."""
    workers: tuple[WorkerRow, ...] = ()
    faults: dict[str, int] = field(default_factory=dict)
    """Faults of this node's workers by kind (:data:`FAULT_KINDS`)."""
    tiers: dict[str, int] = field(default_factory=dict)
    """Recoveries by tier (:data:`TIERS`)."""
    recovery: Recovery = field(default_factory=Recovery)
    last_failure: FailureLine | None = None
    timeline: tuple[TimelineEntry, ...] = ()
    restores: int = 0
    """Restores from snapshots that this node's ranks took part in (a fresh start is none)."""
    steps_redone: int = 0
    """Steps done before those faults that the job did again (``newest - restored``)."""


def encode_report(report: NodeReport) -> bytes:
    """The report as JSON, within :data:`MAX_REPORT_BYTES` (oldest timeline entries dropped)."""
    doc = asdict(report)
    doc["version"] = REPORT_VERSION
    doc["recovery"]["buckets"] = list(report.recovery.buckets)
    while True:
        raw = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
        if len(raw) <= MAX_REPORT_BYTES:
            return raw
        # Too large: the oldest timeline entries go first, then workers' rows.
        key = "timeline" if doc["timeline"] else "workers"
        doc[key] = doc[key][len(doc[key]) // 4 + 1 :] if key == "timeline" else doc[key][:-1]


class _Reader:
    """Checks one JSON object's fields; every refusal names the key and the field."""

    def __init__(self, key: str, doc: object, where: str = "") -> None:
        if not isinstance(doc, dict):
            raise StatusError(f"{key}: expected a JSON object{where}, got {type(doc).__name__}")
        self.key, self.doc, self.where = key, doc, where

    def fail(self, name: str, expected: str) -> StatusError:
        value = repr(self.doc.get(name))[:80]
        return StatusError(
            f"{key_field(self.key, self.where, name)}: expected {expected}, got {value}"
        )

    def integer(self, name: str, *, optional: bool = False, low: int = 0) -> Any:
        value = self.doc.get(name)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.fail(name, f"an integer >= {low}" + (" or null" if optional else ""))
        return value

    def number(self, name: str) -> float:
        value = self.doc.get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise self.fail(name, "a finite number")
        return float(value)

    def text(self, name: str, *, optional: bool = False) -> Any:
        value = self.doc.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise self.fail(name, "a string")
        return value[:_TEXT]

    def flag(self, name: str) -> bool | None:
        value = self.doc.get(name)
        if value is not None and not isinstance(value, bool):
            raise self.fail(name, "true, false or null")
        return value

    def items(self, name: str, limit: int) -> list[Any]:
        value = self.doc.get(name)
        if not isinstance(value, list) or len(value) > limit:
            raise self.fail(name, f"a list of at most {limit} items")
        return value

    def counts(self, name: str, names: tuple[str, ...]) -> dict[str, int]:
        value = self.doc.get(name)
        if not isinstance(value, dict) or not set(value) <= set(names):
            raise self.fail(name, "an object with keys among " + ", ".join(names))
        inner = _Reader(self.key, value, f"{self.where}.{name}")
        return {k: inner.integer(k) for k in value}

    def sub(self, name: str, index: int | None = None) -> _Reader:
        value = self.doc.get(name) if index is None else self.doc[name][index]
        where = f"{self.where}.{name}" + ("" if index is None else f"[{index}]")
        return _Reader(self.key, value, where)


def key_field(key: str, where: str, name: str) -> str:
    return f"{key}: field {(where + '.' + name).lstrip('.')}"


def decode_report(raw: bytes, *, key: str) -> NodeReport:
    """Decode a node report; raises StatusError naming ``key`` and the field at fault."""
    if len(raw) > MAX_REPORT_BYTES:
        raise StatusError(f"{key}: {len(raw)} bytes, expected at most {MAX_REPORT_BYTES}")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise StatusError(f"{key}: not JSON ({exc})") from exc
    r = _Reader(key, doc)
    if doc.get("version") != REPORT_VERSION:
        raise r.fail("version", f"{REPORT_VERSION}")
    workers = []
    for i in range(len(r.items("workers", 4096))):
        w = r.sub("workers", i)
        workers.append(
            WorkerRow(
                local_rank=w.integer("local_rank"),
                rank=w.integer("rank"),
                pid=w.integer("pid", optional=True, low=1),
                state=w.text("state"),
                respawns=w.integer("respawns"),
                iteration=w.integer("iteration", optional=True),
                active=w.flag("active"),
                snapshot=w.integer("snapshot", optional=True),
            )
        )
    timeline = []
    for i in range(len(r.items("timeline", 10_000))):
        t = r.sub("timeline", i)
        timeline.append(
            TimelineEntry(time=t.number("time"), name=t.text("name"), text=t.text("text"))
        )
    rec = r.sub("recovery")
    buckets = rec.items("buckets", len(RECOVERY_BUCKETS) + 1)
    if len(buckets) != len(RECOVERY_BUCKETS) + 1 or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in buckets
    ):
        raise rec.fail("buckets", f"{len(RECOVERY_BUCKETS) + 1} counts")
    last = None
    if doc.get("last_failure") is not None:
        f = r.sub("last_failure")
        last = FailureLine(
            rank=f.integer("rank"),
            host=f.text("host"),
            exitcode=f.integer("exitcode", low=-255),
            message=f.text("message"),
            time=f.number("time"),
            round=f.integer("round"),
        )
    return NodeReport(
        node=r.text("node"),
        host=r.text("host"),
        role=r.text("role"),
        group_rank=r.integer("group_rank", optional=True),
        round=r.integer("round", optional=True),
        attempt=r.integer("attempt", low=-1),
        state=r.text("state"),
        updated=r.number("updated"),
        max_restarts=r.integer("max_restarts"),
        restarts=r.integer("restarts"),
        workers=tuple(workers),
        faults=r.counts("faults", FAULT_KINDS),
        tiers=r.counts("tiers", TIERS),
        recovery=Recovery(
            count=rec.integer("count"), total=rec.number("total"), buckets=tuple(buckets)
        ),
        last_failure=last,
        timeline=tuple(timeline),
        # absent from the reports of agents older than the snapshots: none
        restores=r.integer("restores", optional=True) or 0,
        steps_redone=r.integer("steps_redone", optional=True) or 0,
    )
