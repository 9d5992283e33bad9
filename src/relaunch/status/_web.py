"""The status page (HTML with an SVG timeline) and the Prometheus metrics of a job document."""

from __future__ import annotations

import html
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from relaunch.status._board import escape
from relaunch.status._text import failure_line, snapshot_line

__all__ = ["render_html", "render_metrics"]

_COLORS = {
    "workers_failed": "#d62728",
    "worker_hung": "#d62728",
    "worker_lost": "#d62728",
    "run_failed": "#7f0000",
    "restart": "#ff7f0e",
    "membership_changed": "#9467bd",
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
"""


def _e(value: object) -> str:
    return html.escape(escape(str(value)))


def _table(headers: tuple[str, ...], rows: Sequence[Sequence[object]], cls: str) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table class="{cls}"><tr>{head}</tr>{body}</table></div>'


def _timeline(doc: dict[str, Any]) -> str:
    events = doc["timeline"]
    if not events:
        return '<p class="muted">no events yet</p>'
    hosts = sorted({e["node"] for e in events})
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
        parts.append(f'<text x="6" y="{y + 5}" font-size="12">{_e(label)[:22]}</text>')
        parts.append(f'<line x1="{left}" y1="{y}" x2="{width - 10}" y2="{y}" stroke="#ccc"/>')
    # Faults above the lane, recoveries below it: a fault and the restart a moment
    # later stay apart; faults are drawn last, on top.
    for e in sorted(events, key=lambda e: _OFFSETS.get(e["name"], 0) < 0):
        x = left + (e["time"] - t0) * scale
        y = 30 + lane * hosts.index(e["node"]) + _OFFSETS.get(e["name"], 0)
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


def render_html(doc: dict[str, Any], *, refresh: float = 2.0) -> str:
    """The whole page: refreshes itself every ``refresh`` seconds, fits a phone."""
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
    node_rows, worker_rows = [], []
    for row in doc["nodes"]:
        report = row["report"] or {}
        age = row["heartbeat_age"]
        node_rows.append(
            (
                "-" if row["rank"] is None else row["rank"],
                row["role"],
                row["host"] or "?",
                row["addr"],
                "-" if age is None else f"{age:.1f} s",
                report.get("state", "?"),
                report.get("attempt", "-"),
            )
        )
        for w in report.get("workers", ()):
            it = "-" if w["iteration"] is None else w["iteration"]
            worker_rows.append(
                (w["rank"], row["host"] or row["addr"], w["local_rank"], w["pid"] or "-",
                 w["state"], w["respawns"], it if w["active"] is not False else f"{it} (spare)",
                 "-" if w.get("snapshot") is None else w["snapshot"])
            )  # fmt: skip
    last = doc["last_failure"]
    failure = (
        f'<div class="failure" id="last-failure">{_e(failure_line(last))}</div>'
        if last
        else '<p id="last-failure" class="muted">no failure</p>'
    )
    faults = ", ".join(f"{k} {v}" for k, v in doc["faults"].items())
    tiers = ", ".join(f"{k} {v}" for k, v in doc["recoveries"].items())
    problems = "".join(f'<p class="failure">{_e(p)}</p>' for p in doc["problems"])
    read_at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["read_at"]))
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f'<meta http-equiv="refresh" content="{refresh:g}">'
        f"<title>relaunch: {_e(doc['run_id'])}</title><style>{_STYLE}</style></head><body>"
        f"<h1>relaunch job <code>{_e(doc['run_id'])}</code> "
        f'<span class="pill {_e(rnd["state"])}">{_e(rnd["state"])}</span></h1>'
        '<div class="grid">'
        + "".join(f'<div class="card">{_e(k)}<b>{_e(v)}</b></div>' for k, v in cards)
        + "</div><h2>last failure</h2>"
        + failure
        + "<h2>nodes</h2>"
        + _table(
            ("rank", "role", "host", "address", "heartbeat", "state", "attempt"), node_rows, "nodes"
        )
        + "<h2>workers</h2>"
        + _table(
            ("rank", "host", "local", "pid", "state", "restarts", "iteration", "snapshot"),
            worker_rows,
            "workers",
        )
        + (
            f'<p id="snapshots">{_e(snapshot_line(doc["snapshots"]))}</p>'
            if doc.get("snapshots")
            else ""
        )
        + "<h2>timeline</h2>"
        + _timeline(doc)
        + f'<p class="muted">faults: {_e(faults)}; recoveries: {_e(tiers)}</p>'
        + problems
        + f'<p class="muted">read at {_e(read_at)} from the {_e(doc["backend"])} rendezvous; '
        '<a href="status.json">status.json</a> · <a href="metrics">metrics</a></p>'
        "</body></html>"
    )


class _Collector:
    def __init__(self, doc: dict[str, Any]) -> None:
        self._doc = doc

    def collect(self) -> Iterator[Metric]:
        doc = self._doc
        labels = ["run_id"]
        job = [doc["run_id"]]

        def gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, help_, labels=labels)
            g.add_metric(job, value)
            return g

        restarts = CounterMetricFamily(
            "relaunch_restarts", "Failure restarts of the job", labels=labels
        )
        restarts.add_metric(job, doc["restarts"]["used"])
        yield restarts
        if doc["restarts"]["max"] is not None:
            yield gauge("relaunch_restarts_max", "Failure restarts allowed", doc["restarts"]["max"])
        faults = CounterMetricFamily(
            "relaunch_faults", "Worker faults by kind", labels=[*labels, "kind"]
        )
        for kind, n in doc["faults"].items():
            faults.add_metric([*job, kind], n)
        yield faults
        tiers = CounterMetricFamily(
            "relaunch_recoveries", "Recoveries by tier", labels=[*labels, "tier"]
        )
        for tier, n in doc["recoveries"].items():
            tiers.add_metric([*job, tier], n)
        yield tiers
        rec = doc["recovery_seconds"]
        cumulative, buckets = 0, []
        for bound, n in zip([*rec["bounds"], float("inf")], rec["buckets"], strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", cumulative))
        hist = HistogramMetricFamily(
            "relaunch_recovery_seconds", "Seconds from a fault to workers running again",
            labels=labels,
        )  # fmt: skip
        hist.add_metric(job, buckets, rec["sum"])
        yield hist
        yield gauge("relaunch_round", "Rendezvous round", doc["round"]["number"])
        yield gauge("relaunch_world_nodes", "Nodes in the round", doc["world"]["nodes"])
        yield gauge("relaunch_world_workers", "Workers reported", doc["world"]["workers"])
        yield gauge(
            "relaunch_nodes_waiting", "Nodes waiting to join", doc["world"]["nodes_waiting"]
        )
        yield gauge("relaunch_spares", "Spare nodes", doc["world"]["spares"])
        beats = GaugeMetricFamily(
            "relaunch_heartbeat_age_seconds", "Age of a node's last heartbeat",
            labels=[*labels, "node"],
        )  # fmt: skip
        for row in doc["nodes"]:
            if row["heartbeat_age"] is not None:
                beats.add_metric([*job, row["node"]], row["heartbeat_age"])
        yield beats
        steps = GaugeMetricFamily(
            "relaunch_snapshot_step", "Step of a rank's newest complete snapshot",
            labels=[*labels, "rank"],
        )  # fmt: skip
        for row in doc["nodes"]:
            for w in (row["report"] or {}).get("workers", ()):
                if w.get("snapshot") is not None:
                    steps.add_metric([*job, str(w["rank"])], w["snapshot"])
        yield steps
        snap = doc.get("snapshots") or {"restores": 0, "steps_redone": 0}
        restores = CounterMetricFamily(
            "relaunch_snapshot_restores", "Restores from snapshots", labels=labels
        )
        restores.add_metric(job, snap["restores"])
        yield restores
        redone = CounterMetricFamily(
            "relaunch_steps_redone", "Steps the job did again after restores", labels=labels
        )
        redone.add_metric(job, snap["steps_redone"])
        yield redone


def render_metrics(doc: dict[str, Any]) -> bytes:
    """The document in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(doc))
    return generate_latest(registry)
