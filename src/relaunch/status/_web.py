"""The status page of a job document: HTML with an SVG timeline (its metrics:
:mod:`relaunch.status._metrics`)."""

from __future__ import annotations

import html
import time
from collections.abc import Mapping, Sequence

from relaunch.status._board import escape
from relaunch.status._document import JobDocument, as_document
from relaunch.status._summary import GRID, summarize
from relaunch.status._text import failure_line, snapshot_line

__all__ = ["render_html"]

_COLORS = {
    "workers_failed": "#d62728",
    "worker_hung": "#d62728",
    "worker_lost": "#d62728",
    "run_failed": "#7f0000",
    "restart": "#ff7f0e",
    "membership_changed": "#9467bd",
    "round_reopened": "#9467bd",
    "worker_respawned": "#1f77b4",
    "workers_started": "#2ca02c",
    "rendezvous_complete": "#17becf",
}
_OFFSETS = {
    "workers_failed": -7,
    "worker_hung": -7,
    "worker_lost": -7,
    "run_failed": -7,
    "workers_started": 7,
    "worker_respawned": 7,
}
_LANES = 24
"""Nodes with a lane of their own in the timeline; more share one."""
_LEGEND = (
    ("fault", "#d62728"),
    ("restart", "#ff7f0e"),
    ("membership", "#9467bd"),
    ("process replaced", "#1f77b4"),
    ("running again", "#2ca02c"),
    ("round", "#17becf"),
)

_STYLE = """
body{font-family:system-ui,-apple-system,sans-serif;margin:0;padding:12px;background:#fafafa;color:#222}
h1{font-size:1.2em;margin:0 0 6px}h2{font-size:1em;margin:16px 0 6px}
.pill{display:inline-block;padding:2px 8px;border-radius:10px;background:#e8f5e9;color:#1b5e20}
.pill.open,.pill.closed{background:#fff3e0;color:#e65100}
.grid{display:flex;flex-wrap:wrap;gap:8px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:120px}
.card b{display:block;font-size:1.4em}
.scroll{overflow-x:auto}
table{border-collapse:collapse;background:#fff;font-size:.9em;min-width:100%}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;white-space:nowrap}
th{background:#f0f0f0}
.failure{background:#ffebee;border:1px solid #ef9a9a;border-radius:6px;padding:8px;word-break:break-word}
.muted{color:#777;font-size:.85em}
svg{background:#fff;border:1px solid #ddd;border-radius:6px;max-width:100%;height:auto}
#node-grid{display:grid;grid-template-columns:repeat(auto-fill,9px);gap:1px;margin:6px 0}
#node-grid i{display:block;width:9px;height:9px}
.key i{display:inline-block;width:9px;height:9px;margin:0 3px 0 8px}
"""
_STATE_COLORS = {
    "failed": "#d62728",
    "recovering": "#ff7f0e",
    "starting": "#17becf",
    "stopped": "#8c564b",
    "silent": "#7f7f7f",
    "running": "#2ca02c",
    "succeeded": "#1f77b4",
    "joining": "#9467bd",
    "waiting": "#bcbd22",
    "spare": "#c7c7c7",
}
_GRID_STYLE = "".join(
    f"#node-grid .{c},.key .{c}{{background:{_STATE_COLORS[s]}}}" for s, c in GRID.items()
)


def _e(value: object) -> str:
    return html.escape(escape(str(value)))


def _table(headers: tuple[str, ...], rows: Sequence[Sequence[object]], cls: str) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table class="{cls}"><tr>{head}</tr>{body}</table></div>'


def _timeline(doc: JobDocument) -> str:
    """The timeline as an SVG chart: a lane per node, a dot per event, a legend."""
    events = doc["timeline"]
    if not events:
        return '<p class="muted">no events yet</p>'
    hosts = sorted({e["node"] for e in events})
    together = len(hosts) > _LANES
    if together:  # a big job: one lane for every node
        hosts = ["*"]
    width, left, lane = 720, 150, 34
    height = 30 + lane * len(hosts) + 24
    t0 = events[0]["time"]
    t1 = max(doc["read_at"], events[-1]["time"], t0 + 1.0)
    scale = (width - left - 20) / (t1 - t0)
    parts = [
        f'<svg id="timeline" viewBox="0 0 {width} {height}" width="{width}" '
        f'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="timeline of events">'
    ]
    ranks = {row["node"]: row["rank"] for row in doc["nodes"]}
    for i, node in enumerate(hosts):
        y = 30 + lane * i
        label = next((e["host"] for e in events if e["node"] == node), node)
        if ranks.get(node) is not None:
            label = f"{label} (node {ranks[node]})"
        if together:
            label = f"{len({e['node'] for e in events})} nodes"
        parts.append(f'<text x="6" y="{y + 5}" font-size="12">{_e(label)[:22]}</text>')
        parts.append(f'<line x1="{left}" y1="{y}" x2="{width - 10}" y2="{y}" stroke="#ccc"/>')
    # Faults above the lane, recoveries below it: a fault and the restart a moment
    # later stay apart; faults are drawn last, on top.
    for e in sorted(events, key=lambda e: _OFFSETS.get(e["name"], 0) < 0):
        x = left + (e["time"] - t0) * scale
        y = 30 + lane * (0 if together else hosts.index(e["node"])) + _OFFSETS.get(e["name"], 0)
        color = _COLORS.get(e["name"], "#888")
        parts.append(
            f'<circle cx="{x:.1f}" cy="{y}" r="6" fill="{color}">'
            f"<title>{_e(time.strftime('%H:%M:%S', time.localtime(e['time'])))} "
            f"{_e(e['text'])}</title></circle>"
        )
    y = height - 8
    x = left
    for name, color in _LEGEND:
        parts.append(f'<circle cx="{x}" cy="{y - 4}" r="5" fill="{color}"/>')
        parts.append(f'<text x="{x + 8}" y="{y}" font-size="11">{name}</text>')
        x += 16 + 7 * len(name)
    parts.append(f'<text x="6" y="14" font-size="11" fill="#777">{_e(f"{t1 - t0:.0f} s")}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(doc: Mapping[str, object], *, refresh: float = 2.0) -> str:
    """The whole page: refreshes itself every ``refresh`` seconds, fits a phone. A big
    job's page (more than 64 nodes) draws every node as a square of the grid, and
    the rows of the nodes worth a look (``_summary``)."""
    full = as_document(doc)
    job = summarize(full)
    return (
        _head(job, refresh)
        + _cards(job)
        + "<h2>last failure</h2>"
        + _last_failure(job)
        + "<h2>nodes</h2>"
        + _node_grid(full, job["summary"]["listed"])
        + _node_table(job)
        + _store_table(job)
        + "<h2>workers</h2>"
        + _worker_table(job)
        + _snapshots(job)
        + "<h2>timeline</h2>"
        + _timeline(job)
        + _footer(job)
        + "</body></html>"
    )


def _head(doc: JobDocument, refresh: float) -> str:
    """The page's head (it refreshes itself, fits a phone) and its title line."""
    state = _e(doc["round"]["state"])
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f'<meta http-equiv="refresh" content="{refresh:g}">'
        f"<title>relaunch: {_e(doc['run_id'])}</title><style>{_STYLE}{_GRID_STYLE}</style>"
        "</head><body>"
        f"<h1>relaunch job <code>{_e(doc['run_id'])}</code> "
        f'<span class="pill {state}">{state}</span></h1>'
    )


def _cards(doc: JobDocument) -> str:
    """The cards at the top: the round, the world, the restart budget."""
    rnd, world, restarts = doc["round"], doc["world"], doc["restarts"]
    most = "?" if restarts["max"] is None else restarts["max"]
    cards = (
        ("round", rnd["number"]),
        ("nodes", world["nodes"]),
        ("workers", world["workers"]),
        ("restarts", f"{restarts['used']} / {most}"),
        ("waiting", world["nodes_waiting"]),
        ("spares", world["spares"]),
    )
    body = "".join(f'<div class="card">{_e(k)}<b>{_e(v)}</b></div>' for k, v in cards)
    return f'<div class="grid">{body}</div>'


def _last_failure(doc: JobDocument) -> str:
    """The job's root cause, or that there is none."""
    last = doc["last_failure"]
    if last:
        return f'<div class="failure" id="last-failure">{_e(failure_line(last))}</div>'
    return '<p id="last-failure" class="muted">no failure</p>'


def _node_grid(doc: JobDocument, listed: int) -> str:
    """Every node by state: the counts with a key, a square per node (rank order), and
    which rows the tables below hold (``listed`` of them)."""
    summary = doc["summary"]
    key = "".join(
        f'<span><i class="{GRID[state]}"></i>{_e(state)} {count}</span>'
        for state, count in summary["nodes_by_state"].items()
    )
    workers = ", ".join(f"{k} {v}" for k, v in summary["workers_by_state"].items())
    whole = summary["listed"] == summary["nodes"]
    ranks = [row["rank"] for row in doc["nodes"]] if whole else []
    squares = []
    for i, char in enumerate(summary["grid"]):
        rank = ranks[i] if i < len(ranks) else None
        label = f"node {i}" if rank is None else f"rank {rank}"
        squares.append(f'<i class="{char}" title="{label}"></i>')
    note = ""
    if listed < summary["nodes"]:
        note = (
            f'<p class="muted" id="listed">below: the {listed} nodes worth a look '
            f"of {summary['nodes']} (not running calmly, a worker not running, the root "
            "cause's host); one node's whole row: <code>status.json?node=ID</code></p>"
        )
    return (
        f'<p class="key" id="node-states">{summary["nodes"]} nodes:{key}'
        f'<span class="muted"> · workers: {_e(workers or "none")}</span></p>'
        f'<div id="node-grid">{"".join(squares)}</div>{note}'
    )


def _node_table(doc: JobDocument) -> str:
    """A row per node: its rank and role, where it is, its heartbeat, its agent's state."""
    rows = []
    for row in doc["nodes"]:
        report, age = row["report"], row["heartbeat_age"]
        rows.append(
            (
                "-" if row["rank"] is None else row["rank"],
                row["role"],
                row["host"] or "?",
                row["addr"],
                "-" if age is None else f"{age:.1f} s",
                "?" if report is None else report["state"],
                "-" if report is None else report["attempt"],
            )
        )
    headers = ("rank", "role", "host", "address", "heartbeat", "state", "attempt")
    return _table(headers, rows, "nodes")


def _store_table(doc: JobDocument) -> str:
    """The embedded store's etcd members and their health, when the job has some."""
    members = doc.get("store_members")
    if not members:
        return ""
    rows = []
    for m in members:
        health = "healthy" if m["healthy"] else "starting" if m["name"] == "(joining)" else "DOWN"
        rows.append((m["name"], m["client_url"], health + (" (learner)" if m["learner"] else "")))
    return "<h2>rendezvous store (embedded etcd)</h2>" + _table(
        ("member", "client", "health"), rows, "store"
    )


def _worker_table(doc: JobDocument) -> str:
    """A row per worker, under its node's host: its process, restarts, iteration, snapshot."""
    rows = []
    for row in doc["nodes"]:
        for w in () if row["report"] is None else row["report"]["workers"]:
            it = "-" if w["iteration"] is None else w["iteration"]
            rows.append(
                (w["rank"], row["host"] or row["addr"], w["local_rank"], w["pid"] or "-",
                 w["state"], w["respawns"], it if w["active"] is not False else f"{it} (spare)",
                 "-" if w["snapshot"] is None else w["snapshot"])
            )  # fmt: skip
    headers = ("rank", "host", "local", "pid", "state", "restarts", "iteration", "snapshot")
    return _table(headers, rows, "workers")


def _snapshots(doc: JobDocument) -> str:
    """The snapshots' line, when a rank took one."""
    snap = doc["snapshots"]
    return f'<p id="snapshots">{_e(snapshot_line(snap))}</p>' if snap else ""


def _footer(doc: JobDocument) -> str:
    """The counts of faults and recoveries, the unreadable reports, where it was read."""
    faults = ", ".join(f"{k} {v}" for k, v in doc["faults"].items())
    tiers = ", ".join(f"{k} {v}" for k, v in doc["recoveries"].items())
    problems = "".join(f'<p class="failure">{_e(p)}</p>' for p in doc["problems"])
    read_at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["read_at"]))
    return (
        f'<p class="muted">faults: {_e(faults)}; recoveries: {_e(tiers)}</p>'
        + problems
        + f'<p class="muted">read at {_e(read_at)} from the {_e(doc["backend"])} rendezvous; '
        '<a href="status.json">status.json</a> · <a href="metrics">metrics</a></p>'
    )
