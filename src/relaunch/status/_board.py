"""The agent's status board: what its events mean to a person and to ``relaunch status``.

The agent hands every event to :meth:`StatusBoard.observe`; the board keeps the
node's counters (faults by kind, recoveries by tier, recovery times), its last
failure and a short timeline, says one human line on stderr for the events a user
must see (a failure, a restart, a node joining or leaving, a hang, the end), and
builds the :class:`~relaunch.status.NodeReport` the agent publishes. Events stay
JSON in ``events.jsonl``; this is their voice.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relaunch._text import printable
from relaunch.events import Event
from relaunch.status._report import (
    TIMELINE_LENGTH,
    FailureLine,
    NodeReport,
    TimelineEntry,
    WorkerRow,
)

__all__ = ["StatusBoard", "escape"]


def escape(text: str) -> str:
    """``text`` with control characters (ANSI escapes, carriage returns) made visible."""
    return printable(text)


def _first_line(text: object) -> str:
    lines = str(text).strip().splitlines()
    return escape(lines[0] if lines else "")[:300]


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class StatusBoard:
    """The node's status, fed with the agent's events. Not thread-safe: the agent's
    loop is its only writer; readers get immutable :class:`NodeReport` snapshots."""

    def __init__(
        self,
        *,
        node: str,
        host: str,
        role: str,
        max_restarts: int,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._say = say
        self._clock = clock
        self._report = NodeReport(
            node=node,
            host=host,
            role=role,
            group_rank=None,
            round=None,
            attempt=-1,
            state="starting",
            updated=clock(),
            max_restarts=max_restarts,
            restarts=0,
        )
        self._timeline: deque[TimelineEntry] = deque(maxlen=TIMELINE_LENGTH)
        self._fault_at: float | None = None
        self._tier: str | None = None
        self._hung: set[int] = set()
        self._world: int | None = None
        self._workers_per_node = 0

    # -- reading ----------------------------------------------------------------------
    def report(self, workers: Sequence[WorkerRow] | None = None) -> NodeReport:
        """The node report now (``workers``: the rows to publish, if changed)."""
        changes: dict[str, Any] = {"timeline": tuple(self._timeline)}
        if workers is not None:
            changes["workers"] = tuple(workers)
        return dataclasses.replace(self._report, **changes)

    def say_summary(self) -> None:
        """Say the last line of a run: outcome, restarts, faults, time lost to recovery."""
        self._say(self.summary())

    def summary(self) -> str:
        """The last line of a run: outcome, restarts, faults, time lost to recovery."""
        r = self._report
        outcome = {"succeeded": "the workers succeeded", "failed": "the job failed"}.get(
            r.state, f"the run ended ({r.state})"
        )
        faults = ", ".join(f"{n} {k}" for k, n in sorted(r.faults.items()) if n) or "none"
        tiers = ", ".join(f"{n} {k}" for k, n in sorted(r.tiers.items()) if n) or "none"
        return (
            f"summary: {outcome}; restarts used {r.restarts} of {r.max_restarts}; "
            f"faults: {faults}; recoveries: {tiers}; "
            f"{r.recovery.total:.1f} s spent recovering"
        )

    # -- feeding ----------------------------------------------------------------------
    def observe(self, event: Event) -> None:
        """Take one event: update the counters and the timeline, say what a user must hear."""
        handler = getattr(self, "_on_" + event.name, None)
        text = handler(event.metadata, event) if handler is not None else None
        restarts = max(self._report.restarts, event.restart_count)
        self._update(group_rank=event.group_rank, restarts=restarts, updated=event.timestamp)
        if text:
            self._timeline.append(TimelineEntry(time=event.timestamp, name=event.name, text=text))
            self._say(text)

    def _update(self, **changes: Any) -> None:
        self._report = dataclasses.replace(self._report, **changes)

    def _count(self, field: str, key: str) -> None:
        counts = dict(getattr(self._report, field))
        counts[key] = counts.get(key, 0) + 1
        self._update(**{field: counts})

    def _fault(self, now: float, tier: str) -> None:
        if self._fault_at is None:
            self._fault_at = now
        self._tier = tier
        self._update(state="recovering")

    def _recovered(self, now: float) -> None:
        if self._fault_at is not None and self._tier is not None:
            self._update(recovery=self._report.recovery.add(max(0.0, now - self._fault_at)))
            self._count("tiers", self._tier)
        self._fault_at = self._tier = None
        self._update(state="running")

    # -- one handler per event the board cares about --------------------------------
    def _on_rendezvous_complete(self, md: Mapping[str, Any], ev: Event) -> str | None:
        world = int(md.get("world_size", 0))
        before, self._world = self._world, world
        self._update(round=md.get("round"))
        if "replaces" in md:
            return (
                f"round {md.get('round')}: this node takes the place of lost group rank "
                f"{md.get('replaces')}; its workers join the running ones in-process (tier: node)"
            )
        if before is None:
            joins = " (joining a running job)" if int(md.get("round") or 0) > 0 else ""
            return (
                f"round {md.get('round')}: {world} node(s); this node is rank "
                f"{ev.group_rank}{joins}"
            )
        if before != world:
            verb = "joined" if world > before else "left"
            return f"round {md.get('round')}: a node {verb}; {world} node(s) now (was {before})"
        return None

    def _on_workers_started(self, md: Mapping[str, Any], ev: Event) -> str | None:
        self._update(attempt=int(md.get("attempt", 0)))
        recovering = self._fault_at is not None
        self._recovered(ev.timestamp)
        if recovering:
            return f"workers running again (attempt {md.get('attempt')})"
        return None

    def _on_workers_failed(self, md: Mapping[str, Any], ev: Event) -> str | None:
        causes: Mapping[str, Any] = md.get("causes") or {}
        lines = []
        first: FailureLine | None = None
        for rank, cause in sorted(causes.items(), key=lambda kv: kv[1].get("time", 0.0)):
            code = int(cause.get("exitcode", 1))
            if int(cause.get("local_rank", -1)) in self._hung:
                kind = None
            else:
                kind = "signal" if code < 0 else "exit"
            if kind:
                self._count("faults", kind)
            message = _first_line(cause.get("message", ""))
            line = FailureLine(
                rank=int(rank),
                host=ev.host,
                exitcode=code,
                message=message,
                time=float(cause.get("time", ev.timestamp)),
                round=self._report.round or 0,
            )
            first = first or line
            lines.append(
                f"rank {rank} (local rank {cause.get('local_rank')}, pid {cause.get('pid')}, "
                f"host {ev.host}) failed: {_how(code)}: {message}"
            )
        self._hung.clear()
        if first is not None:
            self._update(last_failure=first)
        self._fault(ev.timestamp, "group")
        return "; ".join(lines) or "workers failed"

    def _on_restart(self, md: Mapping[str, Any], ev: Event) -> str:
        used, most = md.get("restarts"), md.get("max_restarts")
        self._update(restarts=int(used or 0))
        return (
            f"restarting this node's workers (restart {used} of {most}, after a worker "
            "failure; tier: group restart)"
        )

    def _on_membership_changed(self, md: Mapping[str, Any], ev: Event) -> str:
        self._fault(ev.timestamp, "membership")
        return (
            "a new round is starting (a node joined, left, or restarts after a failure): "
            "restarting this node's workers (tier: membership restart)"
        )

    def _on_worker_hung(self, md: Mapping[str, Any], ev: Event) -> str:
        self._hung.add(int(md.get("local_rank", -1)))
        self._count("faults", "hang")
        return (
            f"local rank {md.get('local_rank')} (pid {md.get('pid')}) hung: "
            f"{_first_line(md.get('reason', ''))}"
        )

    def _on_worker_lost(self, md: Mapping[str, Any], ev: Event) -> str:
        self._count("faults", "lost")
        code = int(md.get("exitcode") or -signal.SIGKILL)
        message = _first_line(md.get("reason", ""))
        rank = int(md.get("rank", -1))
        line = FailureLine(
            rank=rank, host=ev.host, exitcode=code, message=message, time=ev.timestamp
        )
        self._update(last_failure=line)
        self._fault(ev.timestamp, "process")
        return (
            f"rank {rank} (local rank {md.get('local_rank')}) died: {_how(code)}; "
            "its in-process peers keep running"
        )

    def _on_worker_respawned(self, md: Mapping[str, Any], ev: Event) -> str:
        self._recovered(ev.timestamp)
        how = "forked" if md.get("forked") else "started"
        nth = md.get("replacement", md.get("incarnation"))
        return (
            f"local rank {md.get('local_rank')} replaced in place: pid {md.get('pid')} {how} "
            f"in {float(md.get('seconds') or 0):.2f} s (replacement {nth}); "
            "healthy processes kept running (tier: process)"
        )

    def _on_node_lost(self, md: Mapping[str, Any], ev: Event) -> str:
        self._count("faults", "node")
        self._fault(ev.timestamp, "node")
        first, last = [*list(md.get("ranks") or []), -1, -1][:2]
        return (
            f"node of group rank {md.get('group_rank')} lost (ranks {first}-{last}): this "
            "node's workers go on without them in their processes; a spare or a new node "
            "takes its place (tier: node)"
        )

    def _on_node_replaced(self, md: Mapping[str, Any], ev: Event) -> str:
        lost = "" if md.get("seen_lost", True) else " (lost moments before)"
        if not md.get("seen_lost", True):
            self._count("faults", "node")
            self._fault(float(md.get("lost_at") or ev.timestamp), "node")
        self._recovered(ev.timestamp)
        return (
            f"a new node took group rank {md.get('group_rank')}{lost}; its workers join "
            "the running ones in-process (tier: node)"
        )

    def _on_run_failed(self, md: Mapping[str, Any], ev: Event) -> str:
        self._update(state="failed")
        return f"no restarts left ({md.get('restarts')} of {self._report.max_restarts} used): the job fails"

    def _on_workers_succeeded(self, md: Mapping[str, Any], ev: Event) -> None:
        self._update(state="succeeded")

    def _on_stopped(self, md: Mapping[str, Any], ev: Event) -> str:
        self._update(state="stopped")
        try:
            name = signal.Signals(int(md.get("signal", 0))).name
        except ValueError:
            name = str(md.get("signal"))
        return f"stopping the workers ({name} received)"

    def _on_store_lost(self, md: Mapping[str, Any], ev: Event) -> None:
        self._update(state="failed")  # the launcher prints the reason itself

    def _on_rendezvous_closed(self, md: Mapping[str, Any], ev: Event) -> str:
        self._update(state="failed")
        return "another node closed the job (after its failure): stopping"

    def _on_not_needed(self, md: Mapping[str, Any], ev: Event) -> str:
        self._update(state="succeeded")
        return "this spare node was not needed: the job finished without it"

    def _on_watchdog_expired(self, md: Mapping[str, Any], ev: Event) -> str:
        return f"watchdog expired for pid {md.get('pid')} (scope {escape(str(md.get('scope')))})"
