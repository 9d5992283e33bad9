"""The terminal view of a job's status document (``relaunch status``), drawn with rich."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from relaunch.status._board import escape

__all__ = ["render_text"]


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s ago"


def _how(code: int) -> str:
    if code < 0:
        import signal

        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def failure_line(f: dict[str, Any]) -> str:
    """``rank 3 on host-b: exit code 1: ValueError: bad batch`` (control characters escaped)."""
    return f"rank {f['rank']} on {escape(f['host'])}: {_how(f['exitcode'])}: {escape(f['message'])}"


def render_text(doc: dict[str, Any]) -> RenderableType:
    """Tables of the round, the nodes, the workers; the restart budget and last failure."""
    rnd, world, restarts = doc["round"], doc["world"], doc["restarts"]
    left = "-" if restarts["left"] is None else restarts["left"]
    most = "?" if restarts["max"] is None else restarts["max"]
    head = Text.assemble(
        ("job ", "bold"),
        (escape(doc["run_id"]), "bold cyan"),
        f" ({doc['backend']})  round {rnd['number']} ",
        (rnd["state"], "bold green" if rnd["state"] == "running" else "bold yellow"),
        f"  nodes {world['nodes']}  workers {world['workers']}"
        f"  waiting {world['nodes_waiting']}  spares {world['spares']}",
        f"\nrestarts used {restarts['used']} of {most} (left {left})",
    )
    nodes = Table(title="nodes", title_justify="left", expand=False)
    for column in ("rank", "role", "host", "address", "heartbeat", "state", "attempt"):
        nodes.add_column(column)
    workers = Table(title="workers", title_justify="left", expand=False)
    for column in ("rank", "node", "local", "pid", "state", "restarts", "iteration", "snapshot"):
        workers.add_column(column)
    for row in doc["nodes"]:
        report = row["report"] or {}
        nodes.add_row(
            "-" if row["rank"] is None else str(row["rank"]),
            row["role"],
            escape(row["host"] or "?"),
            escape(row["addr"]),
            _age(row["heartbeat_age"]),
            escape(report.get("state", "?")),
            str(report.get("attempt", "-")),
        )
        for w in report.get("workers", ()):
            iteration = "-" if w["iteration"] is None else str(w["iteration"])
            if w["active"] is False:
                iteration += " (spare)"
            workers.add_row(
                str(w["rank"]),
                escape(row["host"] or row["addr"]),
                str(w["local_rank"]),
                "-" if w["pid"] is None else str(w["pid"]),
                escape(w["state"]),
                str(w["respawns"]),
                iteration,
                "-" if w.get("snapshot") is None else f"step {w['snapshot']}",
            )
    parts: list[RenderableType] = [head, nodes, workers]
    last = doc["last_failure"]
    parts.append(
        Text.assemble(("last failure: ", "bold"), (failure_line(last), "red"))
        if last
        else Text("last failure: none")
    )
    if doc["inprocess"]:
        ip = doc["inprocess"]
        parts.append(
            Text(
                f"in-process: iteration {ip['iteration']}, active ranks {ip['active']}, "
                f"inactive {ip['inactive']}"
            )
        )
    if doc.get("snapshots"):
        parts.append(Text(snapshot_line(doc["snapshots"])))
    for problem in doc["problems"]:
        parts.append(Text(f"warning: {escape(problem)}", style="yellow"))
    parts.append(Text(time.strftime("read at %H:%M:%S", time.localtime(doc["read_at"])), "dim"))
    return Group(*parts)


def snapshot_line(snap: dict[str, Any]) -> str:
    """The job's snapshots in one line (the text view and the page)."""
    restorable = "none yet" if snap["restorable"] is None else f"step {snap['restorable']}"
    per = snap["redone_per_restore"]
    redone = f"{snap['steps_redone']} steps redone" + (
        "" if per is None else f" ({per:g} per restore)"
    )
    return f"snapshots: every rank can restore {restorable}; {snap['restores']} restores, {redone}"
