"""The job's status document: the rendezvous state and every node's report, joined.

:func:`read_job` reads them from the rendezvous store (read-only: it never writes)
and returns the document that ``relaunch status --json`` prints and the status page
shows; its shape is documented in ``docs/status.md`` (version :data:`JOB_VERSION`).
"""

from __future__ import annotations

import signal
import time
from typing import Any

from relaunch.errors import RendezvousStateError, StatusError
from relaunch.rendezvous._backend import key_prefix
from relaunch.rendezvous._state import RendezvousState, decode_state, node_sort_key
from relaunch.status._report import (
    FAULT_KINDS,
    RECOVERY_BUCKETS,
    TIERS,
    NodeReport,
    WorkerRow,
    decode_report,
)
from relaunch.store import BatchStore, Store

__all__ = ["JOB_VERSION", "job_document", "local_document", "read_job", "status_key"]

JOB_VERSION = 1


def status_key(run_id: str, node: str) -> str:
    """Where ``node`` publishes its report."""
    return f"{key_prefix(run_id)}status/{node}"


def _read(store: Store, keys: list[str]) -> list[bytes | None]:
    if isinstance(store, BatchStore):
        return store.multi_get(keys)
    return [store.get(k) for k in keys]


def read_job(store: Store, run_id: str, *, backend: str) -> dict[str, Any]:
    """The status document of job ``run_id``. Raises StatusError when the job is not
    found or its state is corrupt, StoreError when the store does not answer."""
    key = key_prefix(run_id) + "state"
    raw = store.get(key)
    if raw is None:
        raise StatusError(f"no job {run_id!r} in this rendezvous store (no key {key!r})")
    try:
        state = decode_state(raw, key=key, run_id=run_id)
    except RendezvousStateError as exc:
        raise StatusError(f"the job's rendezvous state is corrupt: {exc}") from exc
    nodes = sorted(
        set(state.participants) | state.wait_list | state.redundancy_list, key=node_sort_key
    )
    reports: dict[str, NodeReport] = {}
    problems: list[str] = []
    for node, blob in zip(nodes, _read(store, [status_key(run_id, n) for n in nodes]), strict=True):
        if blob is None:
            continue
        try:
            reports[node] = decode_report(blob, key=status_key(run_id, node))
        except StatusError as exc:
            problems.append(str(exc))
    return job_document(state, reports, backend=backend, problems=problems)


def _node_row(
    node: str, state: RendezvousState, report: NodeReport | None, now: float
) -> dict[str, Any]:
    if node in state.participants:
        role = "participant" if state.complete else "joining"
    elif node in state.redundancy_list:
        role = "spare"
    else:
        role = "waiting"
    beat = state.last_heartbeats.get(node)
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


def _report_doc(report: NodeReport) -> dict[str, Any]:
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
        "workers": [dict(vars(w)) for w in report.workers],
        "faults": dict(report.faults),
        "tiers": dict(report.tiers),
        "recovery": {
            "count": report.recovery.count,
            "total": report.recovery.total,
            "buckets": list(report.recovery.buckets),
        },
        "last_failure": None if last is None else dict(vars(last)),
        "restores": report.restores,
        "steps_redone": report.steps_redone,
    }


def _snapshots(live: list[NodeReport], workers: list[WorkerRow]) -> dict[str, Any] | None:
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


def job_document(
    state: RendezvousState,
    reports: dict[str, NodeReport],
    *,
    backend: str,
    problems: list[str] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """Join the rendezvous state and the node reports into the status document."""
    now = time.time() if now is None else now
    nodes = sorted(
        set(state.participants) | state.wait_list | state.redundancy_list, key=node_sort_key
    )
    rows = [_node_row(n, state, reports.get(n), now) for n in nodes]
    rows.sort(key=lambda r: (r["rank"] is None, r["rank"] or 0, node_sort_key(r["node"])))
    live = [reports[n] for n in nodes if n in reports]
    max_restarts = max((r.max_restarts for r in live), default=None)
    failures = [r.last_failure for r in live if r.last_failure is not None]
    # The root cause: the first failure of the latest round that had failures (the
    # others are usually its peers' collectives breaking). A process killed by a signal
    # (not our SIGTERM) comes first: it wrote no time of its own, only when its agent
    # saw it, which can be after a peer already reported the broken connection.
    latest = max((f.round for f in failures), default=0)
    pool = [f for f in failures if f.round == latest]
    killed = [f for f in pool if f.exitcode < 0 and -f.exitcode != signal.SIGTERM]
    last = min(killed or pool, key=lambda f: f.time, default=None)
    faults = {k: sum(r.faults.get(k, 0) for r in live) for k in FAULT_KINDS}
    tiers = {k: sum(r.tiers.get(k, 0) for r in live) for k in TIERS}
    buckets = [sum(r.recovery.buckets[i] for r in live) for i in range(len(RECOVERY_BUCKETS) + 1)]
    workers = [w for r in live for w in r.workers]
    inprocess = None
    if any(w.iteration is not None for w in workers):
        inprocess = {
            "iteration": max(w.iteration or 0 for w in workers),
            "active": sorted(w.rank for w in workers if w.active),
            "inactive": sorted(w.rank for w in workers if w.active is False),
        }
    entries = sorted(((e, r) for r in live for e in r.timeline), key=lambda er: er[0].time)
    timeline = [
        {"time": e.time, "node": r.node, "host": r.host, "name": e.name, "text": e.text}
        for e, r in entries
    ]
    if state.closed:
        phase = "closed"
    elif state.complete:
        phase = "running"
    else:
        phase = "open"
    return {
        "version": JOB_VERSION,
        "run_id": state.run_id,
        "backend": backend,
        "read_at": now,
        "round": {"number": state.round, "state": phase},
        "world": {
            "nodes": len(state.participants) if state.complete else 0,
            "workers": len(workers),
            "nodes_waiting": len(state.wait_list),
            "spares": len(state.redundancy_list),
        },
        "nodes": rows,
        "restarts": {
            "used": state.restarts,
            "max": max_restarts,
            "left": None if max_restarts is None else max(0, max_restarts - state.restarts),
        },
        "last_failure": None if last is None else dict(vars(last)),
        "faults": faults,
        "recoveries": tiers,
        "recovery_seconds": {
            "count": sum(r.recovery.count for r in live),
            "sum": round(sum(r.recovery.total for r in live), 6),
            "bounds": list(RECOVERY_BUCKETS),
            "buckets": buckets,
        },
        "inprocess": inprocess,
        "snapshots": _snapshots(live, workers),
        "timeline": timeline,
        "problems": problems or [],
    }


def local_document(report: NodeReport, *, run_id: str, backend: str) -> dict[str, Any]:
    """The document of a job whose nodes share no store (static): this node alone."""
    state = RendezvousState(
        run_id=run_id,
        round=report.round or 0,
        complete=True,
        participants={report.node: report.group_rank or 0},
        restarts=report.restarts,
    )
    return job_document(state, {report.node: report}, backend=backend)
