"""The per-node agent: one role's workers on this node, run by :class:`AgentRun`."""

from __future__ import annotations

import os
import socket

from relaunch.agent._round import leave_rendezvous
from relaunch.agent._run import AgentRun
from relaunch.agent._spec import RunResult, StopRequest, WorkerSpec
from relaunch.agent._status import NodeStatus
from relaunch.rendezvous import SharedBoard
from relaunch.status import NodeReport

__all__ = ["LocalAgent"]


class LocalAgent:
    """Runs one role's workers on this node until they succeed, fail for good, or a signal.

    What a run owns (the worker processes, the fork server, the workers' store, the
    timer server, the run log directory) belongs to the :class:`AgentRun` that
    :meth:`run` builds, and is released before :meth:`run` returns. The agent itself
    keeps what outlives a run: the node's status and a stop request.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self._spec = spec
        self._handler = spec.rdzv_handler
        self._host = socket.gethostname()
        self._stop = StopRequest()
        self._run: AgentRun | None = None
        handler = self._handler
        node = (
            handler.node_id if isinstance(handler, SharedBoard) else f"{self._host}_{os.getpid()}_0"
        )
        self._status = NodeStatus(
            self._handler,
            node=node,
            host=self._host,
            role=spec.role,
            max_restarts=spec.max_restarts,
            snapshots=spec.snapshots,
        )

    @property
    def stop_signal(self) -> int | None:
        """The signal that stopped the run, if one did."""
        return self._stop.signum

    @property
    def run_log_dir(self) -> str | None:
        return self._run.logdir.path if self._run is not None else None

    @property
    def status_report(self) -> NodeReport:
        """This node's latest status report (an immutable snapshot, safe from any thread)."""
        return self._status.report

    def request_stop(self, signum: int) -> None:
        """Ask the run to stop (safe to call from a signal handler: it only sets flags)."""
        self._stop.set(signum)
        self._handler.interrupt()  # a blocked rendezvous returns soon

    def run(self) -> RunResult:
        """Run to the end. Raises RendezvousError or StoreError when the job cannot continue."""
        try:
            run = AgentRun(self._spec, status=self._status, stop=self._stop, host=self._host)
        except BaseException:
            leave_rendezvous(self._handler)  # as a run that failed at its start would
            raise
        self._run = run
        return run.run()
