"""The job's status document: the rendezvous state and every node's report, joined.

:func:`read_job` reads them from the rendezvous store (read-only: it never writes)
and returns the document that ``relaunch status --json`` prints and the status page
shows; its shape is documented in ``docs/status.md`` (version :data:`JOB_VERSION`).
"""

from __future__ import annotations

import signal
import time
from typing import cast

from relaunch.errors import RendezvousStateError, StatusError
from relaunch.rendezvous._backend import key_prefix
from relaunch.rendezvous._liveness import heartbeat_times
from relaunch.rendezvous._state import RendezvousState, decode_state, node_sort_key
from relaunch.status._document import (
    FailureDoc,
    InprocessDoc,
    JobDocument,
    NodeRow,
    Phase,
    RecoverySeconds,
    ReportDoc,
    RestartsDoc,
    Role,
    SnapshotsDoc,
    TimelineDoc,
    WorkerDoc,
)
from relaunch.status._report import (
    FAULT_KINDS,
    RECOVERY_BUCKETS,
    TIERS,
    FailureLine,
    NodeReport,
    WorkerRow,
    decode_report,
)
from relaunch.status._summary import summary_of
from relaunch.store import Store, get_many, has_scan

__all__ = ["JOB_VERSION", "job_document", "local_document", "read_job", "status_key"]

JOB_VERSION = 1


def status_key(run_id: str, node: str) -> str:
    """Where ``node`` publishes its report."""
    return f"{key_prefix(run_id)}status/{node}"


def _read_many(store: Store, prefix: str, nodes: list[str]) -> list[bytes | None]:
    """The values of ``prefix + node`` for ``nodes``, in one round trip where the store
    can (etcd: a range over the prefix; the TCP store: one multi-get)."""
    if has_scan(store):
        found = store.items_with_prefix(prefix)
        return [found.get(prefix + n) for n in nodes]
    return get_many(store, [prefix + n for n in nodes])


def read_job(store: Store, run_id: str, *, backend: str) -> dict[str, object]:
    """The status document of job ``run_id`` (a :class:`JobDocument`, as a plain dict for
    the callers that hold it as one). Raises StatusError when the job is not found or its
    state is corrupt, StoreError when the store does not answer."""
    key = key_prefix(run_id) + "state"
    raw = store.get(key)
    if raw is None:
        raise StatusError(f"no job {run_id!r} in this rendezvous store (no key {key!r})")
    try:
        state = decode_state(raw, key=key, run_id=run_id)
    except RendezvousStateError as exc:
        raise StatusError(f"the job's rendezvous state is corrupt: {exc}") from exc
    nodes = _members(state)
    reports: dict[str, NodeReport] = {}
    problems: list[str] = []
    beats = heartbeat_times(nodes, _read_many(store, key_prefix(run_id) + "hb/", nodes))
    for node, blob in zip(nodes, _read_many(store, status_key(run_id, ""), nodes), strict=True):
        if blob is None:
            continue
        try:
            reports[node] = decode_report(blob, key=status_key(run_id, node))
        except StatusError as exc:
            problems.append(str(exc))
    return dict(job_document(state, reports, backend=backend, problems=problems, heartbeats=beats))


def _members(state: RendezvousState) -> list[str]:
    """Every node the rendezvous knows (participants, waiting, spares, and the nodes of
    the last round a round started again holds seats for), in rank order."""
    known = set(state.participants) | state.wait_list | state.redundancy_list
    return sorted(known | state.expected, key=node_sort_key)


def _node_row(
    node: str, state: RendezvousState, report: NodeReport | None, beat: float | None, now: float
) -> NodeRow:
    """The row of ``node``: its place in the round (its role), its heartbeat (``beat``:
    its time), its report."""
    role: Role
    if node in state.participants:
        role = "participant" if state.complete else "joining"
    elif node in state.redundancy_list:
        role = "spare"
    elif node in state.wait_list:
        role = "waiting"
    else:
        role = "joining"  # expected back in the round started again, not back yet
    addr = node_sort_key(node)[0] or node
    return {
        "node": node,
        "rank": state.participants.get(node) if state.complete else None,
        "role": role,
        "addr": addr,
        "host": report.host if report else None,
        "heartbeat_age": None if beat is None else round(max(0.0, now - beat), 3),
        "report": None if report is None else _report_doc(report),
    }


def _worker_doc(w: WorkerRow) -> WorkerDoc:
    """A worker's row as the document shows it (its fields, in their order)."""
    return cast(WorkerDoc, dict(vars(w)))


def _failure_doc(f: FailureLine) -> FailureDoc:
    """A failure as the document shows it (its fields, in their order)."""
    return cast(FailureDoc, dict(vars(f)))


def _report_doc(report: NodeReport) -> ReportDoc:
    """A node's report as the document shows it (its timeline goes to the job's)."""
    last = report.last_failure
    return {
        "node": report.node,
        "host": report.host,
        "role": report.role,
        "group_rank": report.group_rank,
        "round": report.round,
        "attempt": report.attempt,
        "state": report.state,
        "updated": report.updated,
        "max_restarts": report.max_restarts,
        "restarts": report.restarts,
        "workers": [_worker_doc(w) for w in report.workers],
        "faults": dict(report.faults),
        "tiers": dict(report.tiers),
        "recovery": {
            "count": report.recovery.count,
            "total": report.recovery.total,
            "buckets": list(report.recovery.buckets),
        },
        "last_failure": None if last is None else _failure_doc(last),
        "restores": report.restores,
        "steps_redone": report.steps_redone,
    }


def _snapshots(live: list[NodeReport], workers: list[WorkerRow]) -> SnapshotsDoc | None:
    """The job's snapshots: the step every rank can restore (the oldest of the ranks'
    newest), and the restores and steps redone (each node records every restore its
    ranks took part in: the most any node saw). None when no rank took a snapshot."""
    steps = [w.snapshot for w in workers]
    restores = max((r.restores for r in live), default=0)
    if all(s is None for s in steps) and not restores:
        return None
    redone = max((r.steps_redone for r in live), default=0)
    return {
        "restorable": None if None in steps else min(s for s in steps if s is not None),
        "newest": max((s for s in steps if s is not None), default=None),
        "restores": restores,
        "steps_redone": redone,
        "redone_per_restore": round(redone / restores, 3) if restores else None,
    }


def _root_cause(live: list[NodeReport]) -> FailureLine | None:
    """The job's root cause: the first failure of the latest round that had failures
    (the others are usually its peers' collectives breaking). A process killed by a
    signal (not our SIGTERM) comes first: it wrote no time of its own, only when its
    agent saw it, which can be after a peer already reported the broken connection."""
    failures = [r.last_failure for r in live if r.last_failure is not None]
    latest = max((f.round for f in failures), default=0)
    pool = [f for f in failures if f.round == latest]
    killed = [f for f in pool if f.exitcode < 0 and -f.exitcode != signal.SIGTERM]
    return min(killed or pool, key=lambda f: f.time, default=None)


def _restarts(state: RendezvousState, live: list[NodeReport]) -> RestartsDoc:
    """The job's restart budget: used (the rendezvous counts), the most (the nodes say)."""
    max_restarts = max((r.max_restarts for r in live), default=None)
    return {
        "used": state.restarts,
        "max": max_restarts,
        "left": None if max_restarts is None else max(0, max_restarts - state.restarts),
    }


def _recovery_seconds(live: list[NodeReport]) -> RecoverySeconds:
    """The nodes' recovery-time histograms, added up."""
    buckets = [sum(r.recovery.buckets[i] for r in live) for i in range(len(RECOVERY_BUCKETS) + 1)]
    return {
        "count": sum(r.recovery.count for r in live),
        "sum": round(sum(r.recovery.total for r in live), 6),
        "bounds": list(RECOVERY_BUCKETS),
        "buckets": buckets,
    }


def _inprocess(workers: list[WorkerRow]) -> InprocessDoc | None:
    """The in-process restarts' view (the highest iteration, the active and inactive
    ranks); None when no worker restarts in-process."""
    if not any(w.iteration is not None for w in workers):
        return None
    return {
        "iteration": max(w.iteration or 0 for w in workers),
        "active": sorted(w.rank for w in workers if w.active),
        "inactive": sorted(w.rank for w in workers if w.active is False),
    }


def _timeline(live: list[NodeReport]) -> list[TimelineDoc]:
    """The nodes' timelines merged, oldest first."""
    entries = sorted(((e, r) for r in live for e in r.timeline), key=lambda er: er[0].time)
    return [
        {"time": e.time, "node": r.node, "host": r.host, "name": e.name, "text": e.text}
        for e, r in entries
    ]


def _phase(state: RendezvousState) -> Phase:
    """The round's phase: open (gathering nodes), running, closed (the job ended)."""
    if state.closed:
        return "closed"
    if state.complete:
        return "running"
    return "open"


def job_document(
    state: RendezvousState,
    reports: dict[str, NodeReport],
    *,
    backend: str,
    problems: list[str] | None = None,
    now: float | None = None,
    heartbeats: dict[str, float] | None = None,
) -> JobDocument:
    """Join the rendezvous state, the node reports and the nodes' ``heartbeats`` (their
    times; None: as the state has them, when each node was placed) into the status
    document."""
    now = time.time() if now is None else now
    beats = state.last_heartbeats if heartbeats is None else heartbeats
    nodes = _members(state)
    rows = [_node_row(n, state, reports.get(n), beats.get(n), now) for n in nodes]
    rows.sort(key=lambda r: (r["rank"] is None, r["rank"] or 0, node_sort_key(r["node"])))
    live = [reports[n] for n in nodes if n in reports]
    last = _root_cause(live)
    workers = [w for r in live for w in r.workers]
    return {
        "version": JOB_VERSION,
        "run_id": state.run_id,
        "backend": backend,
        "read_at": now,
        "round": {"number": state.round, "state": _phase(state)},
        "world": {
            "nodes": len(state.participants) if state.complete else 0,
            "workers": len(workers),
            "nodes_waiting": len(state.wait_list),
            "spares": len(state.redundancy_list),
        },
        "nodes": rows,
        "restarts": _restarts(state, live),
        "last_failure": None if last is None else _failure_doc(last),
        "faults": {k: sum(r.faults.get(k, 0) for r in live) for k in FAULT_KINDS},
        "recoveries": {k: sum(r.tiers.get(k, 0) for r in live) for k in TIERS},
        "recovery_seconds": _recovery_seconds(live),
        "inprocess": _inprocess(workers),
        "snapshots": _snapshots(live, workers),
        "timeline": _timeline(live),
        "problems": problems or [],
        "summary": summary_of(rows),
    }


def local_document(report: NodeReport, *, run_id: str, backend: str) -> dict[str, object]:
    """The document of a job whose nodes share no store (static): this node alone (a
    :class:`JobDocument`, as a plain dict like :func:`read_job`'s)."""
    state = RendezvousState(
        run_id=run_id,
        round=report.round or 0,
        complete=True,
        participants={report.node: report.group_rank or 0},
        restarts=report.restarts,
    )
    return dict(job_document(state, {report.node: report}, backend=backend))
