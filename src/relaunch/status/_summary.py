"""A big job's view in brief: nodes by state, a grid of one character per node, and the
rows of the nodes worth a look instead of a row per node and per worker.

:func:`~relaunch.status.job_document` always joins every node (``summary`` counts them
and draws the grid); :func:`summarize` cuts a document of more than
:data:`DETAIL_NODES` nodes down to what a person reads (the page, ``relaunch status``,
``/status.json``), and :func:`node_detail` gives one node's whole row back
(``/status.json?node=ID``, ``relaunch status --node ID``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import cast

from relaunch.status._document import JobDocument, NodeRow, SummaryDoc

__all__ = [
    "DETAIL_NODES",
    "GRID",
    "TIMELINE_LIMIT",
    "node_detail",
    "node_state",
    "summarize",
    "summary_of",
]

DETAIL_NODES = 64
"""Up to this many nodes, every node has its row; above, only the nodes worth a look."""

TIMELINE_LIMIT = 200
"""Events a summarized document keeps (the newest)."""

GRID: Mapping[str, str] = {
    "failed": "f",
    "recovering": "c",
    "starting": "i",
    "stopped": "t",
    "silent": "n",
    "running": "r",
    "succeeded": "d",
    "joining": "j",
    "waiting": "w",
    "spare": "s",
}
"""A node's state -> its character in ``summary.grid``, the states that need a look
first (a participant with no report is ``silent``)."""

_CALM = frozenset({"running", "succeeded", "joining", "waiting", "spare"})
_CALM_WORKERS = frozenset({"running", "succeeded"})


def node_state(row: NodeRow) -> str:
    """What ``row``'s node is doing: its role when it is not in the running round, else
    its agent's state (``silent`` before its first report)."""
    if row["role"] != "participant":
        return row["role"]
    report = row["report"]
    if report is None or report["state"] not in GRID:
        return "silent"
    return report["state"]


def summary_of(rows: Sequence[NodeRow]) -> SummaryDoc:
    """Every node counted by state and drawn in the grid, in the rows' order."""
    states = [node_state(r) for r in rows]
    workers = Counter(
        w["state"] for r in rows if r["report"] is not None for w in r["report"]["workers"]
    )
    by_state = Counter(states)
    return {
        "nodes": len(rows),
        "listed": len(rows),
        "nodes_by_state": {s: by_state[s] for s in GRID if by_state[s]},
        "workers_by_state": dict(sorted(workers.items())),
        "grid": "".join(GRID[s] for s in states),
    }


def _worth_a_look(row: NodeRow, culprit: str | None) -> bool:
    report = row["report"]
    if node_state(row) not in _CALM or (report is not None and report["host"] == culprit):
        return True
    return report is not None and any(w["state"] not in _CALM_WORKERS for w in report["workers"])


def summarize(doc: JobDocument, limit: int = DETAIL_NODES) -> JobDocument:
    """``doc`` as a person reads it: unchanged up to ``limit`` nodes; above, the rows of
    the nodes worth a look (not running calmly, a worker not running, the root cause's
    host), the least calm first, at most ``limit``, and the newest events."""
    rows = doc["nodes"]
    if len(rows) <= limit:
        return doc
    last = doc["last_failure"]
    culprit = None if last is None else last["host"]
    order = {state: i for i, state in enumerate(GRID)}
    picked = sorted(
        (r for r in rows if _worth_a_look(r, culprit)), key=lambda r: order[node_state(r)]
    )[:limit]
    out = dict(doc)
    out["nodes"] = picked
    out["timeline"] = doc["timeline"][-TIMELINE_LIMIT:]
    out["summary"] = {**doc["summary"], "listed": len(picked)}
    return cast(JobDocument, out)


def node_detail(doc: JobDocument, node: str) -> NodeRow | None:
    """The whole row of ``node`` (its id, or its host's name when one node runs there)."""
    rows = doc["nodes"]
    found = [r for r in rows if r["node"] == node]
    if not found:
        found = [r for r in rows if r["host"] == node or r["addr"] == node]
    return found[0] if len(found) == 1 else None
