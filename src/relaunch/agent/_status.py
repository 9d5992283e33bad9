"""The agent's side of the live view: its status board, published to the rendezvous.

:class:`NodeStatus` feeds the agent's events to a
:class:`~relaunch.status.StatusBoard` (which says the human lines on stderr) and
publishes the node report to the rendezvous store on a change, at most once a
second. A store that refuses the write costs one warning and a pause; it never
stops the agent.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Mapping

from relaunch._contract import read_marker
from relaunch.agent._attempt import Slot
from relaunch.agent._spec import SnapshotFacts, SnapshotSource, WorkerGroup, WorkerState
from relaunch.errors import RendezvousError, StoreError, StoreLostError
from relaunch.events import Event, RendezvousComplete
from relaunch.rendezvous import RendezvousHandler, SharedBoard
from relaunch.status import NodeReport, StatusBoard, WorkerRow, encode_report

__all__ = ["NodeStatus", "say"]

log = logging.getLogger(__name__)

PUBLISH_INTERVAL = 1.0
"""At most one write of the report per this many seconds."""
RETRY_AFTER = 30.0
"""After a failed write, the next try waits this long (a lost store must not stall the loop)."""

_STATES = {
    WorkerState.HEALTHY: "running",
    WorkerState.SUCCEEDED: "succeeded",
    WorkerState.FAILED: "failed",
    WorkerState.STOPPED: "stopped",
}


def say(text: str) -> None:
    """One human line on stderr."""
    print(f"relaunch: {text}", file=sys.stderr, flush=True)


class NodeStatus:
    """The node's status board and its publication (called from the agent's loop only)."""

    def __init__(
        self,
        handler: RendezvousHandler,
        *,
        node: str,
        host: str,
        role: str,
        max_restarts: int,
        snapshots: SnapshotSource | None = None,
    ) -> None:
        self._shared = handler if isinstance(handler, SharedBoard) else None
        """Where the report is published; None: nowhere (static: the page shows this node)."""
        self._snapshots = snapshots
        self.board = StatusBoard(
            node=node, host=host, role=role, max_restarts=max_restarts, say=say
        )
        self._sent_at = -1e9
        self._sent = b""
        self._paused_until = 0.0
        self.report: NodeReport = self.board.report()
        """The last report built (read by the status page's thread: an immutable snapshot)."""
        self._iterations: dict[int, tuple[int, int]] = {}
        """By attempt: the in-process iteration its workers joined at (0, or the running
        job's for a node that took a lost one's place) and the highest they reported."""
        self._joining = False
        """The next attempt's workers join a running job (their first iteration is the
        job's: the restarts before it are not this node's)."""

    def observe(self, event: Event) -> None:
        self.board.observe(event)
        if isinstance(event.detail, RendezvousComplete):
            self._joining = event.detail.incarnation is not None

    def say_summary(self) -> None:
        """The run's last line, with the in-process restarts of its attempts."""
        self.board.say_summary(in_process=sum(hi - lo for lo, hi in self._iterations.values()))

    def stop_publishing(self) -> None:
        """The store is gone: writing to it would only wait for timeouts."""
        self._paused_until = float("inf")

    def publish(
        self,
        group: WorkerGroup,
        slots: Mapping[int, Slot],
        pids: Mapping[int, int],
        *,
        force: bool = False,
    ) -> None:
        """Build the report; write it if it changed and the last write is old enough."""
        now = time.monotonic()
        if not force and now - self._sent_at < PUBLISH_INTERVAL:
            return
        self._sent_at = now
        facts = self._snapshots.snapshot_facts() if self._snapshots else SnapshotFacts()
        report = self.board.report(_rows(group, slots, pids, facts.newest))
        seen = [w.iteration for w in report.workers if w.iteration is not None]
        if seen:
            lo, hi = self._iterations.get(report.attempt, (min(seen) if self._joining else 0, 0))
            self._iterations[report.attempt] = (lo, max(hi, *seen))
        self.report = dataclasses.replace(
            report, restores=facts.restores, steps_redone=facts.steps_redone
        )
        raw = encode_report(self.report)
        if now < self._paused_until or raw == self._sent or self._shared is None:
            return  # (built all the same: the status page and the summary read it)
        try:
            self._shared.publish_status(raw)
        except (StoreError, RendezvousError) as exc:
            if not isinstance(exc, StoreLostError):  # (the job's end says why)
                log.warning(
                    "cannot publish this node's status (next try in %g s): %s", RETRY_AFTER, exc
                )
            self._paused_until = now + RETRY_AFTER
            return
        self._sent = raw


def _rows(
    group: WorkerGroup,
    slots: Mapping[int, Slot],
    pids: Mapping[int, int],
    snapshots: Mapping[int, int],
) -> list[WorkerRow]:
    state = _STATES.get(group.state, "starting")
    rows = []
    for worker in group.workers:
        if worker.global_rank is None or worker.global_rank < 0:
            continue
        slot = slots.get(worker.local_rank)
        iteration, active = read_marker(slot.files.marker) if slot else (None, None)
        rows.append(
            WorkerRow(
                local_rank=worker.local_rank,
                rank=worker.global_rank,
                pid=pids.get(worker.local_rank),
                state="lost" if slot is not None and slot.lost is not None else state,
                respawns=slot.respawns if slot else 0,
                iteration=iteration,
                active=active,
                snapshot=snapshots.get(worker.global_rank),
            )
        )
    return rows
