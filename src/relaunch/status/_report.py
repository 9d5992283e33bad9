"""What one agent publishes about its node: the node report, a small versioned JSON.

Written by the agent to ``relaunch/rdzv/<run_id>/status/<node id>`` on its state
changes (at most once a second), read by ``relaunch status`` and the status page.
It is bounded (:data:`MAX_REPORT_BYTES`: the oldest timeline entries go first), and
decoding is strict: a record that is not what this module writes is a
:class:`~relaunch.errors.StatusError` naming the key and the field, never a crash.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from relaunch._json import loads as json_loads
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


_MOST_INT = 2**53
"""The largest integer a report holds (a float holds it exactly: /metrics' values)."""
_MOST_NUMBER = 1e11
"""The largest number (seconds: a time up to the year 5138, a duration): what the page
and ``relaunch status`` turn into a date without failing."""


def _bounded(value: object) -> float | None:
    """``value`` as a float when it is a number within :data:`_MOST_NUMBER` (NaN, the
    infinities and an int too big for a float are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if -_MOST_NUMBER <= value <= _MOST_NUMBER else None


class _Reader:
    """Checks one JSON object's fields; every refusal names the key and the field."""

    def __init__(self, key: str, doc: object, where: str = "") -> None:
        if not isinstance(doc, dict):
            raise StatusError(f"{key}: expected a JSON object{where}, got {type(doc).__name__}")
        self.key, self.where = key, where
        self.doc: dict[str, object] = doc

    def fail(self, name: str, expected: str) -> StatusError:
        value = repr(self.doc.get(name))[:80]
        return StatusError(
            f"{key_field(self.key, self.where, name)}: expected {expected}, got {value}"
        )

    def integer(self, name: str, *, low: int = 0) -> int:
        value = self.doc.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and low <= value <= _MOST_INT:
            return value
        raise self.fail(name, f"an integer in {low}..2**53")

    def optional_integer(self, name: str, *, low: int = 0) -> int | None:
        value = self.doc.get(name)
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool) and low <= value <= _MOST_INT:
            return value
        raise self.fail(name, f"an integer in {low}..2**53 or null")

    def number(self, name: str) -> float:
        value = self.doc.get(name)
        number = _bounded(value)
        if number is not None:
            return number
        raise self.fail(name, f"a number within +-{_MOST_NUMBER:.0e}")

    def text(self, name: str) -> str:
        value = self.doc.get(name)
        if not isinstance(value, str):
            raise self.fail(name, "a string")
        return value[:_TEXT]

    def flag(self, name: str) -> bool | None:
        value = self.doc.get(name)
        if value is None or isinstance(value, bool):
            return value
        raise self.fail(name, "true, false or null")

    def items(self, name: str, limit: int) -> list[object]:
        value = self.doc.get(name)
        if not isinstance(value, list) or len(value) > limit:
            raise self.fail(name, f"a list of at most {limit} items")
        return value

    def rows(self, name: str, limit: int) -> Iterator[_Reader]:
        """A reader for each object of list ``name``, in turn (each is checked when its
        turn comes: the first fault in the list is the one named)."""
        for i, item in enumerate(self.items(name, limit)):
            yield _Reader(self.key, item, f"{self.where}.{name}[{i}]")

    def counts(self, name: str, names: tuple[str, ...]) -> dict[str, int]:
        value = self.doc.get(name)
        if not isinstance(value, dict) or not set(value) <= set(names):
            raise self.fail(name, "an object with keys among " + ", ".join(names))
        inner = _Reader(self.key, value, f"{self.where}.{name}")
        return {k: inner.integer(k) for k in value}

    def sub(self, name: str) -> _Reader:
        return _Reader(self.key, self.doc.get(name), f"{self.where}.{name}")


def key_field(key: str, where: str, name: str) -> str:
    return f"{key}: field {(where + '.' + name).lstrip('.')}"


def decode_report(raw: bytes, *, key: str) -> NodeReport:
    """Decode a node report; raises StatusError naming ``key`` and the field at fault."""
    r = _Reader(key, _load(raw, key))
    if r.doc.get("version") != REPORT_VERSION:
        raise r.fail("version", f"{REPORT_VERSION}")
    workers = tuple(_worker(w) for w in r.rows("workers", 4096))
    timeline = tuple(_timeline_entry(t) for t in r.rows("timeline", 10_000))
    rec = r.sub("recovery")
    buckets = _buckets(rec)
    last = None if r.doc.get("last_failure") is None else _failure(r.sub("last_failure"))
    return NodeReport(
        node=r.text("node"),
        host=r.text("host"),
        role=r.text("role"),
        group_rank=r.optional_integer("group_rank"),
        round=r.optional_integer("round"),
        attempt=r.integer("attempt", low=-1),
        state=r.text("state"),
        updated=r.number("updated"),
        max_restarts=r.integer("max_restarts"),
        restarts=r.integer("restarts"),
        workers=workers,
        faults=r.counts("faults", FAULT_KINDS),
        tiers=r.counts("tiers", TIERS),
        recovery=Recovery(count=rec.integer("count"), total=rec.number("total"), buckets=buckets),
        last_failure=last,
        timeline=timeline,
        # absent from the reports of agents older than the snapshots: none
        restores=r.optional_integer("restores") or 0,
        steps_redone=r.optional_integer("steps_redone") or 0,
    )


def _load(raw: bytes, key: str) -> object:
    """The JSON in ``raw``, refused when it is larger than a report may be or not JSON."""
    if len(raw) > MAX_REPORT_BYTES:
        raise StatusError(f"{key}: {len(raw)} bytes, expected at most {MAX_REPORT_BYTES}")
    try:
        return json_loads(raw)
    except ValueError as exc:
        raise StatusError(f"{key}: not JSON ({exc})") from exc


def _worker(w: _Reader) -> WorkerRow:
    """One worker's row (``snapshot``: absent from the reports of older agents)."""
    return WorkerRow(
        local_rank=w.integer("local_rank"),
        rank=w.integer("rank"),
        pid=w.optional_integer("pid", low=1),
        state=w.text("state"),
        respawns=w.integer("respawns"),
        iteration=w.optional_integer("iteration"),
        active=w.flag("active"),
        snapshot=w.optional_integer("snapshot"),
    )


def _timeline_entry(t: _Reader) -> TimelineEntry:
    """One entry of the node's timeline."""
    return TimelineEntry(time=t.number("time"), name=t.text("name"), text=t.text("text"))


def _buckets(rec: _Reader) -> tuple[int, ...]:
    """The recovery histogram's counts: one per bound and one above them all."""
    want = len(RECOVERY_BUCKETS) + 1
    counts = tuple(
        b
        for b in rec.items("buckets", want)
        if isinstance(b, int) and not isinstance(b, bool) and b >= 0
    )
    if len(counts) != want:  # too few, or some not a count
        raise rec.fail("buckets", f"{want} counts")
    return counts


def _failure(f: _Reader) -> FailureLine:
    """The node's last failure (``exitcode`` negative: killed by that signal)."""
    return FailureLine(
        rank=f.integer("rank"),
        host=f.text("host"),
        exitcode=f.integer("exitcode", low=-255),
        message=f.text("message"),
        time=f.number("time"),
        round=f.integer("round"),
    )
