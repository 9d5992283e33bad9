"""The terminal view of a job's status document (``relaunch status``), drawn with rich."""

from __future__ import annotations

import time
from collections.abc import Mapping

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from relaunch.status._board import escape
from relaunch.status._document import (
    FailureDoc,
    JobDocument,
    SnapshotsDoc,
    WorkerDoc,
    as_document,
)
from relaunch.status._summary import GRID, summarize

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


def failure_line(f: FailureDoc) -> str:
    """``rank 3 on host-b: exit code 1: ValueError: bad batch`` (control characters escaped)."""
    return f"rank {f['rank']} on {escape(f['host'])}: {_how(f['exitcode'])}: {escape(f['message'])}"


def render_text(doc: Mapping[str, object]) -> RenderableType:
    """The round, the restart budget and the last failure; the nodes by state (a
    character per node); tables of the nodes and the workers: of every node up to 64
    nodes, of the nodes worth a look above (``_summary``)."""
    job = summarize(as_document(doc))
    nodes, workers = _tables(job)
    last, *notes = _notes(job)
    return Group(_head(job), last, _states(job), nodes, workers, *notes)


_STYLES = {
    "failed": "bold red",
    "recovering": "yellow",
    "starting": "cyan",
    "stopped": "magenta",
    "silent": "dim",
    "running": "green",
    "succeeded": "blue",
    "joining": "magenta",
    "waiting": "yellow",
    "spare": "dim",
}


def _states(job: JobDocument) -> Text:
    """The nodes by state, then the grid: a character per node (``GRID``), colored."""
    summary = job["summary"]
    counts = ", ".join(f"{s} {n} ({GRID[s]})" for s, n in summary["nodes_by_state"].items())
    workers = ", ".join(f"{s} {n}" for s, n in summary["workers_by_state"].items())
    text = Text(f"{summary['nodes']} nodes: {counts}; workers: {workers or 'none'}\n")
    styles = {char: _STYLES[state] for state, char in GRID.items()}
    grid = summary["grid"]
    start = 0
    for i in range(1, len(grid) + 1):  # one span per run of the same state
        if i == len(grid) or grid[i] != grid[start]:
            text.append(grid[start:i], style=styles.get(grid[start], ""))
            start = i
    if summary["listed"] < summary["nodes"]:
        text.append(f"\nthe tables: the {summary['listed']} nodes worth a look "
                    "(relaunch status --node ID shows one node)", style="dim")  # fmt: skip
    return text


def _head(job: JobDocument) -> Text:
    """The job's lines: its round and world, its restart budget."""
    rnd, world, restarts = job["round"], job["world"], job["restarts"]
    left = "-" if restarts["left"] is None else restarts["left"]
    most = "?" if restarts["max"] is None else restarts["max"]
    return Text.assemble(
        ("job ", "bold"),
        (escape(job["run_id"]), "bold cyan"),
        f" ({job['backend']})  round {rnd['number']} ",
        (rnd["state"], "bold green" if rnd["state"] == "running" else "bold yellow"),
        f"  nodes {world['nodes']}  workers {world['workers']}"
        f"  waiting {world['nodes_waiting']}  spares {world['spares']}",
        f"\nrestarts used {restarts['used']} of {most} (left {left})",
    )


def _tables(job: JobDocument) -> tuple[Table, Table]:
    """The nodes' table and the workers' table (each worker under its node's host)."""
    nodes = Table(title="nodes", title_justify="left", expand=False)
    for column in ("rank", "role", "host", "address", "heartbeat", "state", "attempt"):
        nodes.add_column(column)
    workers = Table(title="workers", title_justify="left", expand=False)
    for column in ("rank", "node", "local", "pid", "state", "restarts", "iteration", "snapshot"):
        workers.add_column(column)
    for row in job["nodes"]:
        report = row["report"]
        cells = (
            "-" if row["rank"] is None else str(row["rank"]),
            escape(row["role"]),
            escape(row["host"] or "?"),
            escape(row["addr"]),
            _age(row["heartbeat_age"]),
            escape("?" if report is None else report["state"]),
            "-" if report is None else str(report["attempt"]),
        )
        # Text, not str: a report's "[/]" or "[link=...]" is shown, not read as markup
        nodes.add_row(*map(Text, cells))
        for w in () if report is None else report["workers"]:
            workers.add_row(*map(Text, _worker_cells(w, escape(row["host"] or row["addr"]))))
    return nodes, workers


def _worker_cells(w: WorkerDoc, node: str) -> tuple[str, ...]:
    """A worker's row of the workers' table (``node``: where it runs, escaped)."""
    iteration = "-" if w["iteration"] is None else str(w["iteration"])
    if w["active"] is False:
        iteration += " (spare)"
    return (
        str(w["rank"]),
        node,
        str(w["local_rank"]),
        "-" if w["pid"] is None else str(w["pid"]),
        escape(w["state"]),
        str(w["respawns"]),
        iteration,
        "-" if w["snapshot"] is None else f"step {w['snapshot']}",
    )


def _notes(job: JobDocument) -> list[RenderableType]:
    """The lines under the tables: the last failure, the in-process restarts, the
    snapshots, the reports that could not be read, when the document was read."""
    last = job["last_failure"]
    parts: list[RenderableType] = [
        Text.assemble(("last failure: ", "bold"), (failure_line(last), "red"))
        if last
        else Text("last failure: none")
    ]
    ip = job["inprocess"]
    if ip:
        active = ip["active"] if len(ip["active"]) <= 32 else f"{len(ip['active'])} ranks"
        parts.append(
            Text(
                f"in-process: iteration {ip['iteration']}, active {active}, inactive {ip['inactive']}"
            )
        )
    snap = job["snapshots"]
    if snap:
        parts.append(Text(snapshot_line(snap)))
    for problem in job["problems"]:
        parts.append(Text(f"warning: {escape(problem)}", style="yellow"))
    parts.append(Text(time.strftime("read at %H:%M:%S", time.localtime(job["read_at"])), "dim"))
    return parts


def snapshot_line(snap: SnapshotsDoc) -> str:
    """The job's snapshots in one line (the text view and the page)."""
    restorable = "none yet" if snap["restorable"] is None else f"step {snap['restorable']}"
    per = snap["redone_per_restore"]
    redone = f"{snap['steps_redone']} steps redone" + (
        "" if per is None else f" ({per:g} per restore)"
    )
    return f"snapshots: every rank can restore {restorable}; {snap['restores']} restores, {redone}"
