"""``relaunch status``: the job's state, read from its rendezvous store, from any machine.

Read-only: it opens a client of the store (never hosts one) and reads the rendezvous
state and the agents' reports. A bad flag exits 2; a job that is not found, a store
that does not answer and a corrupt state each print one line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from relaunch.config import check_run_id, parse_rdzv_conf
from relaunch.errors import ConfigError, RelaunchError, StoreError

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["status_main"]

_USAGE = (
    "relaunch status --rdzv-endpoint HOST:PORT --rdzv-id ID "
    "[--rdzv-backend c10d|etcd] [--rdzv-conf K=V,...] [--watch] [--json] [--node ID]"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _parser() -> _Parser:
    p = _Parser(prog="relaunch status", usage=_USAGE, description=__doc__)
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="c10d", choices=("c10d", "etcd"))
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True)
    p.add_argument("--rdzv-id", "--rdzv_id", required=True)
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="")
    p.add_argument("--watch", action="store_true", help="Redraw the view live (Ctrl-C ends).")
    p.add_argument("--json", action="store_true", help="Print one JSON document.")
    p.add_argument(
        "--node", default=None, help="Show one node's whole row (its id, or its host's name)."
    )
    p.add_argument("--interval", type=float, default=1.0, help="Seconds between redraws.")
    p.add_argument("--timeout", type=float, default=5.0, help="Seconds to wait for the store.")
    return p


def _fail(message: str, code: int) -> int:
    text = message.replace("\r", "\\r").replace("\n", "\\n")
    print(f"relaunch status: error: {text}", file=sys.stderr, flush=True)
    return code


def status_main(argv: Sequence[str]) -> int:
    """Run ``relaunch status``; return the exit code."""
    from relaunch.rendezvous import RendezvousParameters
    from relaunch.rendezvous.registry import connect_store

    try:
        ns = _parser().parse_args(list(argv))
        if ns.json and ns.watch:
            raise ConfigError("--json and --watch: expected one of them, not both")
        if ns.node is not None and ns.watch:
            raise ConfigError("--node and --watch: expected one of them, not both")
        for name in ("interval", "timeout"):
            if not 0 < getattr(ns, name) < 3600:
                raise ConfigError(
                    f"--{name}: expected seconds in (0, 3600), got {getattr(ns, name)}"
                )
        run_id = check_run_id(ns.rdzv_id)
        params = RendezvousParameters(
            backend=ns.rdzv_backend,
            endpoint=ns.rdzv_endpoint,
            run_id=run_id,
            min_nodes=1,
            max_nodes=1,
            conf=parse_rdzv_conf(ns.rdzv_conf, "--rdzv-conf"),
        )
    except ConfigError as exc:
        return _fail(str(exc), 2)
    try:
        store = connect_store(params, timeout=ns.timeout)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    except RelaunchError as exc:
        return _fail(f"the rendezvous store does not answer: {exc}", 1)
    try:
        return _show(store, run_id, ns)
    finally:
        store.close()


def _show(store: object, run_id: str, ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from relaunch.status import read_job
    from relaunch.status._document import as_document

    def read() -> dict[str, object]:
        doc = read_job(store, run_id, backend=ns.rdzv_backend)  # type: ignore[arg-type]
        members = _store_members(ns)
        if members is not None:
            doc["store_members"] = members
        return doc

    try:
        doc = read()
    except StoreError as exc:
        return _fail(f"the rendezvous store does not answer: {exc}", 1)
    except RelaunchError as exc:
        return _fail(str(exc), 1)
    if ns.node is not None:
        return _show_node(doc, ns.node)
    if ns.json:
        from relaunch.status._summary import summarize

        print(json.dumps(summarize(as_document(doc)), indent=1))
        return 0
    console = Console()
    if not ns.watch:
        console.print(_render(doc))
        return 0
    try:
        with Live(_render(doc), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(ns.interval)
                try:
                    doc = read()
                except RelaunchError as exc:
                    return _fail(str(exc), 1)
                live.update(_render(doc), refresh=True)
    except KeyboardInterrupt:
        return 0


def _show_node(doc: dict[str, object], node: str) -> int:
    """One node's whole row as JSON; exit 1 when the job has no such node."""
    from relaunch.status._document import as_document
    from relaunch.status._summary import node_detail

    row = node_detail(as_document(doc), node)
    if row is None:
        return _fail(
            f"no node {node!r} in job {doc['run_id']!r} (or more than one on that host)", 1
        )
    print(json.dumps(row, indent=1))
    return 0


def _store_members(ns: argparse.Namespace) -> list[dict[str, object]] | None:
    """The embedded store's members and their health (c10d), or None (a TCP store, or
    the etcd backend: a cluster run beside the job)."""
    if ns.rdzv_backend != "c10d":
        return None
    from relaunch._endpoint import split_endpoint
    from relaunch.rendezvous._embedded_setup import read_members
    from relaunch.rendezvous.registry import DEFAULT_PORT

    host, port = split_endpoint(ns.rdzv_endpoint, DEFAULT_PORT, min_port=1)
    return read_members(host, port, ns.timeout)


def _render(doc: dict[str, object]) -> RenderableType:
    """The job's tables, and the embedded store's members when there are some."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    from relaunch.status import render_text

    members = doc.get("store_members")
    if not isinstance(members, list):
        return render_text(doc)
    table = Table(title="rendezvous store (embedded etcd)", title_justify="left")
    for column in ("member", "client", "health"):
        table.add_column(column)
    for m in members:
        starting = m["name"] == "(joining)"
        health = "healthy" if m["healthy"] else "starting" if starting else "DOWN"
        if m["learner"]:  # no vote yet: waits for a pair to be promoted with
            health += " (learner)"
        table.add_row(escape(str(m["name"])), escape(str(m["client_url"])), health)
    return Group(render_text(doc), table)
