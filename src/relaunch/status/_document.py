"""The job's status document (version 1) as types: what ``/status.json`` serves.

:func:`~relaunch.status.job_document` builds a :class:`JobDocument`; the views
(:func:`~relaunch.status.render_text`, :func:`~relaunch.status.render_html`,
:func:`~relaunch.status.render_metrics`) draw one. Its fields are documented in
``docs/status.md`` and pinned by ``docs/status.schema.json``; the order of the keys
here is the order they are written in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, TypedDict, cast

if TYPE_CHECKING:  # (in typing from Python 3.11; a string here, never evaluated)
    from typing_extensions import NotRequired

__all__ = [
    "FailureDoc",
    "InprocessDoc",
    "JobDocument",
    "NodeRow",
    "Phase",
    "RecoveryDoc",
    "RecoverySeconds",
    "ReportDoc",
    "RestartsDoc",
    "Role",
    "RoundDoc",
    "SnapshotsDoc",
    "StoreMemberDoc",
    "SummaryDoc",
    "TimelineDoc",
    "WorkerDoc",
    "WorldDoc",
    "as_document",
]


class WorkerDoc(TypedDict):
    """One worker of a node (a :class:`~relaunch.status.WorkerRow`)."""

    local_rank: int
    rank: int
    pid: int | None
    state: str
    respawns: int
    iteration: int | None
    active: bool | None
    snapshot: int | None


class FailureDoc(TypedDict):
    """A failure in one line (a :class:`~relaunch.status.FailureLine`)."""

    rank: int
    host: str
    exitcode: int
    message: str
    time: float
    round: int


class RecoveryDoc(TypedDict):
    """A node's recovery times (a :class:`~relaunch.status.Recovery`)."""

    count: int
    total: float
    buckets: list[int]


class ReportDoc(TypedDict):
    """A node's report (a :class:`~relaunch.status.NodeReport`, less its timeline)."""

    node: str
    host: str
    role: str
    group_rank: int | None
    round: int | None
    attempt: int
    state: str
    updated: float
    max_restarts: int
    restarts: int
    workers: list[WorkerDoc]
    faults: dict[str, int]
    tiers: dict[str, int]
    recovery: RecoveryDoc
    last_failure: FailureDoc | None
    restores: int
    steps_redone: int


Role = Literal["participant", "joining", "spare", "waiting"]
"""A node's place: in the complete round, in the round being gathered (or expected back
in it: a round started again holds its nodes' seats), a spare, waiting for the next round."""
Phase = Literal["open", "running", "closed"]
"""A round gathering nodes, running, or closed (the job ended)."""


class NodeRow(TypedDict):
    """One node of the job, as the rendezvous state and its report show it."""

    node: str
    rank: int | None
    role: Role
    addr: str
    host: str | None
    heartbeat_age: float | None
    report: ReportDoc | None


class RoundDoc(TypedDict):
    number: int
    state: Phase


class WorldDoc(TypedDict):
    nodes: int
    workers: int
    nodes_waiting: int
    spares: int


class RestartsDoc(TypedDict):
    used: int
    max: int | None
    left: int | None


class RecoverySeconds(TypedDict):
    """The job's recovery-time histogram: per bucket, the last above every bound."""

    count: int
    sum: float
    bounds: list[float]
    buckets: list[int]


class InprocessDoc(TypedDict):
    iteration: int
    active: list[int]
    inactive: list[int]


class SnapshotsDoc(TypedDict):
    restorable: int | None
    newest: int | None
    restores: int
    steps_redone: int
    redone_per_restore: float | None


class TimelineDoc(TypedDict):
    time: float
    node: str
    host: str
    name: str
    text: str


class StoreMemberDoc(TypedDict):
    name: str
    client_url: str
    learner: bool
    healthy: bool


class SummaryDoc(TypedDict):
    """Every node in brief (``relaunch.status._summary``)."""

    nodes: int
    listed: int
    """How many of them ``nodes`` holds (all up to 64; above, those worth a look)."""
    nodes_by_state: dict[str, int]
    workers_by_state: dict[str, int]
    grid: str
    """One character per node, in the order of the rows (rank order, then the rest)."""


class JobDocument(TypedDict):
    version: int
    run_id: str
    backend: str
    read_at: float
    round: RoundDoc
    world: WorldDoc
    nodes: list[NodeRow]
    restarts: RestartsDoc
    last_failure: FailureDoc | None
    faults: dict[str, int]
    recoveries: dict[str, int]
    recovery_seconds: RecoverySeconds
    inprocess: InprocessDoc | None
    snapshots: SnapshotsDoc | None
    timeline: list[TimelineDoc]
    problems: list[str]
    summary: SummaryDoc
    store_members: NotRequired[list[StoreMemberDoc]]
    """With the embedded store: added by its readers (``relaunch status``, the page)."""


def as_document(doc: Mapping[str, object]) -> JobDocument:
    """``doc`` as the :class:`JobDocument` it is. :func:`~relaunch.status.read_job` and
    :func:`~relaunch.status.local_document` hand the document out as a plain dict (the
    launcher's page source and ``relaunch status`` hold it as one) and the views take it
    back here: the one place that trusts a document to be what this package built."""
    return cast(JobDocument, doc)
