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
from collections.abc import Callable, Sequence
from typing import Any

from relaunch import events
from relaunch._never import assert_never
from relaunch._text import printable
from relaunch.events import Detail, Event
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


_AGAIN = {
    events.MembershipChanged.name: "a new round is starting (a node joined, left, or restarts "
    "after a failure): restarting this node's workers",
    events.RoundReopened.name: "another node left the round before every node finished "
    "(after a failure, or lost): the job goes on, and this node's workers run again in "
    "the next round",
}
"""Why a node's workers start again for a new round, by event."""

_EndOrQuiet = (
    events.RunFailed | events.WorkersSucceeded | events.Stopped | events.StoreLost | events.RendezvousClosed | events.NotNeeded
    | events.FinishedWithout | events.WatchdogExpired | events.ExitBarrierTimeout | events.WorkersStopped
    | events.ForkServerStarted | events.ForkServerReady | events.ForkServerRefused
)  # fmt: skip


def _signal(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


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
        timeline = tuple(self._timeline)
        if workers is None:
            return dataclasses.replace(self._report, timeline=timeline)
        return dataclasses.replace(self._report, timeline=timeline, workers=tuple(workers))

    def say_summary(self, in_process: int = 0) -> None:
        """Say the last line of a run: outcome, restarts, faults, time lost to recovery."""
        self._say(self.summary(in_process))

    def summary(self, in_process: int = 0) -> str:
        """The last line of a run: outcome, restarts, faults, time lost to recovery
        (``in_process``: the restarts of the workers' in-process wrapper, which the
        agent sees only in their iteration: the faults they recovered from in place,
        whose processes the agent never saw fail)."""
        r = self._report
        outcome = {"succeeded": "the workers succeeded", "failed": "the job failed"}.get(
            r.state, f"the run ended ({r.state})"
        )
        faults = ", ".join(f"{n} {k}" for k, n in sorted(r.faults.items()) if n) or "none"
        tiers = ", ".join(f"{n} {k}" for k, n in sorted(r.tiers.items()) if n) or "none"
        wrapper = f"in-process restarts: {in_process}; " if in_process > 0 else ""
        return (
            f"summary: {outcome}; restarts used {r.restarts} of {r.max_restarts}; "
            f"faults: {faults}; recoveries: {tiers}; {wrapper}"
            f"{r.recovery.total:.1f} s spent recovering"
        )

    # -- feeding ----------------------------------------------------------------------
    def observe(self, event: Event) -> None:
        """Take one event: update the counters and the timeline, say what a user must hear."""
        text = self._voice(event.detail, event)
        restarts = max(self._report.restarts, event.restart_count)
        self._update(group_rank=event.group_rank, restarts=restarts, updated=event.timestamp)
        if text:
            self._timeline.append(TimelineEntry(time=event.timestamp, name=event.name, text=text))
            self._say(text)

    def _voice(self, detail: Detail, ev: Event) -> str | None:
        """What ``detail`` changes on the board, and the line a user hears, if any."""
        match detail:
            case events.RendezvousComplete():
                return self._rendezvous_complete(detail, ev)
            case events.WorkersStarted():
                return self._workers_started(detail, ev)
            case events.WorkersFailed():
                return self._workers_failed(detail, ev)
            case events.Restart():
                self._update(restarts=detail.restarts)
                return (
                    f"restarting this node's workers (restart {detail.restarts} of "
                    f"{detail.max_restarts}, after a worker failure; tier: group restart)"
                )
            case events.MembershipChanged() | events.RoundReopened():
                self._fault(ev.timestamp, "membership")
                return f"{_AGAIN[detail.name]} (tier: membership restart)"
            case events.RoundWentOn():
                self._fault(ev.timestamp, "membership")
                return (
                    f"this node's workers failed after the job had gone on from round "
                    f"{detail.round} (a node joined, left or was lost: this one, if it was "
                    "silent past the dead-node delay); no restart counted, restarting them "
                    "in the next round (tier: membership restart)"
                )
            case events.WorkerHung():
                return self._worker_hung(detail)
            case events.WorkerLost():
                return self._worker_lost(detail, ev)
            case events.WorkerRespawned():
                return self._worker_respawned(detail, ev)
            case events.NodeLost():
                return self._node_lost(detail, ev)
            case events.NodeReplaced():
                return self._node_replaced(detail, ev)
            case _:
                return self._voice_of_the_end(detail)

    def _voice_of_the_end(self, detail: _EndOrQuiet) -> str | None:
        """The events that end a run, and those the board only counts on (no line)."""
        match detail:
            case events.RunFailed():
                self._update(state="failed")
                used = f"{detail.restarts} of {self._report.max_restarts}"
                return f"no restarts left ({used} used): the job fails"
            case events.WorkersSucceeded():
                self._update(state="succeeded")
            case events.Stopped():
                self._update(state="stopped")
                return f"stopping the workers ({_signal(detail.signal)} received)"
            case events.StoreLost():
                self._update(state="failed")  # the launcher prints the reason itself
            case events.RendezvousClosed():
                self._update(state="failed")
                return "another node closed the job (after its failure): stopping"
            case events.NotNeeded():
                self._update(state="succeeded")
                return "this spare node was not needed: the job finished without it"
            case events.FinishedWithout():
                self._update(state="succeeded")
                return (
                    "the job finished while this node waited to rejoin it (another node "
                    "had taken its place): nothing was left for its workers"
                )
            case events.WatchdogExpired():
                return f"watchdog expired for pid {detail.pid} (scope {escape(detail.scope)})"
            case (
                events.ExitBarrierTimeout()
                | events.WorkersStopped()
                | events.ForkServerStarted()
                | events.ForkServerReady()
                | events.ForkServerRefused()
            ):
                pass
            case _:
                assert_never(detail)
        return None

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

    # -- the events with more to say ---------------------------------------------------
    def _rendezvous_complete(self, e: events.RendezvousComplete, ev: Event) -> str | None:
        before, self._world = self._world, e.world_size
        self._update(round=e.round)
        if e.replaces is not None:
            return (
                f"round {e.round}: this node takes the place of lost group rank "
                f"{e.replaces}; its workers join the running ones in-process (tier: node)"
            )
        if before is None:
            joins = " (joining a running job)" if e.round > 0 else ""
            return (
                f"round {e.round}: {e.world_size} node(s); this node is rank {ev.group_rank}{joins}"
            )
        if before != e.world_size:
            verb = "joined" if e.world_size > before else "left"
            return f"round {e.round}: a node {verb}; {e.world_size} node(s) now (was {before})"
        return None

    def _workers_started(self, e: events.WorkersStarted, ev: Event) -> str | None:
        self._update(attempt=e.attempt)
        recovering = self._fault_at is not None
        self._recovered(ev.timestamp)
        if recovering:
            return f"workers running again (attempt {e.attempt})"
        return None

    def _workers_failed(self, e: events.WorkersFailed, ev: Event) -> str:
        lines = []
        first: FailureLine | None = None
        for rank, cause in sorted(e.causes.items(), key=lambda kv: kv[1].time):
            if cause.local_rank not in self._hung:
                self._count("faults", "signal" if cause.exitcode < 0 else "exit")
            message = _first_line(cause.message)
            line = FailureLine(
                rank=rank,
                host=ev.host,
                exitcode=cause.exitcode,
                message=message,
                time=cause.time,
                round=self._report.round or 0,
            )
            first = first or line
            lines.append(
                f"rank {rank} (local rank {cause.local_rank}, pid {cause.pid}, "
                f"host {ev.host}) failed: {_how(cause.exitcode)}: {message}"
            )
        self._hung.clear()
        if first is not None:
            self._update(last_failure=first)
        self._fault(ev.timestamp, "group")
        return "; ".join(lines) or "workers failed"

    def _worker_lost(self, e: events.WorkerLost, ev: Event) -> str:
        self._count("faults", "lost")
        code = e.exitcode or -signal.SIGKILL
        message = _first_line(e.reason)
        rank = -1 if e.rank is None else e.rank
        line = FailureLine(
            rank=rank, host=ev.host, exitcode=code, message=message, time=ev.timestamp
        )
        self._update(last_failure=line)
        self._fault(ev.timestamp, "process")
        return (
            f"rank {rank} (local rank {e.local_rank}) died: {_how(code)}; "
            "its in-process peers keep running"
        )

    def _worker_hung(self, e: events.WorkerHung) -> str:
        self._hung.add(e.local_rank)
        self._count("faults", "hang")
        return f"local rank {e.local_rank} (pid {e.pid}) hung: {_first_line(e.reason)}"

    def _worker_respawned(self, e: events.WorkerRespawned, ev: Event) -> str:
        self._recovered(ev.timestamp)
        how = "forked" if e.forked else "started"
        return (
            f"local rank {e.local_rank} replaced in place: pid {e.pid} {how} in "
            f"{e.seconds:.2f} s (replacement {e.replacement}); healthy processes kept "
            "running (tier: process)"
        )

    def _node_lost(self, e: events.NodeLost, ev: Event) -> str:
        self._count("faults", "node")
        self._fault(ev.timestamp, "node")
        first, last = e.ranks
        return (
            f"node of group rank {e.group_rank} lost (ranks {first}-{last}): this node's "
            "workers go on without them in their processes; a spare or a new node takes "
            "its place (tier: node)"
        )

    def _node_replaced(self, e: events.NodeReplaced, ev: Event) -> str:
        lost = "" if e.seen_lost else " (lost moments before)"
        if not e.seen_lost:
            self._count("faults", "node")
            self._fault(e.lost_at or ev.timestamp, "node")
        self._recovered(ev.timestamp)
        return (
            f"a new node took group rank {e.group_rank}{lost}; its workers join "
            "the running ones in-process (tier: node)"
        )
