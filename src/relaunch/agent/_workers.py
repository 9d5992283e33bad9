"""This node's worker processes across attempts, with the servers they use.

:class:`NodeWorkers` starts an attempt's workers (forked from the node's fork server
when one is ready), polls and stops them, and owns the fork server and the timer
server (``--watchdog``) until :meth:`NodeWorkers.close`. The agent's loop calls it to
act; it decides nothing.
"""

from __future__ import annotations

import logging
import os
import time

from relaunch._contract import JOIN_WAIT, JOIN_WAIT_ENV, PRELOAD_ENV
from relaunch.agent._attempt import Slot, attempt_workers, replacement
from relaunch.agent._core import DropRanks, Observation
from relaunch.agent._forking import NodeForkServer, guess_imports
from relaunch.agent._spec import WorkerGroup, WorkerSpec, WorkerState
from relaunch.agent._watch import failures
from relaunch.errors import RelaunchError, WorkerError
from relaunch.events import (
    Emit,
    WatchdogExpired,
    WorkerLost,
    WorkerRespawned,
    WorkersStarted,
    WorkersStopped,
)
from relaunch.procs import ProcessSpec, RunLogDir, WorkerProcesses
from relaunch.timer import TimerExpiry, TimerServer

__all__ = ["NodeWorkers"]

log = logging.getLogger(__name__)


class NodeWorkers:
    """The running attempt's processes and slots; the fork and timer servers."""

    def __init__(self, spec: WorkerSpec, logdir: RunLogDir, emit: Emit) -> None:
        self._spec = spec
        self._logdir = logdir
        self._emit = emit
        self.slots: dict[int, Slot] = {}
        self._specs: dict[int, ProcessSpec] = {}
        self._procs: WorkerProcesses | None = None
        self._started_at = 0.0
        self._forking = NodeForkServer(
            modules_file=os.path.join(logdir.path, "worker_modules.txt"),
            log_dir=logdir.path,
            delay=spec.standby_delay,
            emit=emit,
        )
        self._shared = 0
        self._share_check = 0.0
        self._timer: TimerServer | None = None
        if spec.watchdog:
            timer = TimerServer(path=spec.watchdog_file, on_expiry=self._on_timer_expiry)
            timer.start()
            self._timer = timer

    @property
    def running(self) -> bool:
        """Whether an attempt's processes are up (started and not stopped)."""
        return self._procs is not None

    def start(
        self,
        group: WorkerGroup,
        attempt: int,
        *,
        restart_count: int,
        run_id: str,
        incarnation: int = 0,
    ) -> None:
        """Start this attempt's workers (``group`` holds their ranks and store address;
        ``incarnation`` > 0: they replace a lost node's and join its peers running)."""
        spec = self._spec
        self.slots, specs = attempt_workers(
            spec,
            group,
            self._logdir,
            attempt,
            restart_count=restart_count,
            run_id=run_id,
            extra=self._extra_env(),
            incarnation=incarnation,
        )
        self._specs = {s.local_rank: s for s in specs}
        warm = spec.warm_standby and spec.entrypoint.is_python
        modules = self._forking.modules_file
        # The first workers say what they import (a prewarmed server had a guess).
        # (not a lost node's replacements: they were given the other nodes' list)
        first = (attempt == 0 and not incarnation) or not os.path.exists(modules)
        report = {0: modules} if warm and first else {}
        server = self._forking.usable()
        procs = WorkerProcesses(
            spec.entrypoint, specs, fork_server=server, report_modules=report, name=spec.role
        )
        self._procs = procs
        t0 = time.monotonic()
        procs.start()
        seconds = round(time.monotonic() - t0, 4)
        if procs.fork_refused is not None and server is not None:
            self._forking.refused(procs.fork_refused)
        self._started_at = time.monotonic()
        pids = procs.pids()
        for worker in group.workers:
            worker.id = pids[worker.local_rank]
        if self._timer is not None:
            self._timer.watch_pids(set(pids.values()))
        group.state = WorkerState.HEALTHY
        self._emit(
            WorkersStarted(
                attempt=attempt,
                pids=pids,
                forked=tuple(sorted(procs.forked)),
                seconds=seconds,
                master_addr=group.master_addr,
                master_port=group.master_port,
            )
        )

    def _extra_env(self) -> dict[str, str]:
        """What every worker of an attempt gets beyond torchrun's variables: the
        watchdog's pipe, and what a replacement of a dead in-process rank needs."""
        extra: dict[str, str] = {}
        if self._timer is not None:
            extra["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1"
            extra["TORCHELASTIC_TIMER_FILE"] = self._timer.path
        if self._spec.max_restarts > 0 and self._spec.entrypoint.is_python:
            extra[JOIN_WAIT_ENV] = str(JOIN_WAIT)  # dead in-process ranks are replaced
            extra[PRELOAD_ENV] = self._forking.modules_file  # what a replacement imports
        return extra

    def drop(self, action: DropRanks, obs: Observation, group: WorkerGroup, attempt: int) -> None:
        """These in-process workers died (their peers went on): record them, and start
        a replacement for those to respawn (a failure to start leaves the rank out)."""
        lost = failures(action.local_ranks, obs, group.workers, self.slots, self.pids())
        for failure in lost.values():
            self.slots[failure.local_rank].lost = failure  # never counted again
            self._emit(
                WorkerLost(
                    rank=group.workers[failure.local_rank].global_rank,
                    local_rank=failure.local_rank,
                    exitcode=failure.exitcode,
                    reason=failure.message,
                )
            )
        for lr in action.respawn:
            try:
                self.respawn(lr, attempt)
            except WorkerError as exc:  # its peers go on without it
                log.warning("cannot start a replacement for local rank %s: %s", lr, exc)

    def respawn(self, local_rank: int, attempt: int) -> None:
        """Start a replacement process for ``local_rank`` (an in-process worker that
        died while its peers run on): it joins the peers' next iteration."""
        assert self._procs is not None
        old = self.slots[local_rank]
        slot, spec = replacement(old, self._specs[local_rank], self._spec.hang_timeout)
        server = self._forking.usable()
        t0 = time.monotonic()
        pid, forked = self._procs.replace(spec, fork_server=server)
        seconds = round(time.monotonic() - t0, 4)
        if self._procs.fork_refused is not None and server is not None:
            self._forking.refused(self._procs.fork_refused)
        self.slots[local_rank], self._specs[local_rank] = slot, spec
        if self._timer is not None:
            self._timer.watch_pids({pid})
        self._emit(
            WorkerRespawned(
                attempt=attempt,
                local_rank=local_rank,
                pid=pid,
                incarnation=slot.incarnation,
                replacement=slot.respawns,
                forked=forked,
                seconds=seconds,
            )
        )

    def poll(self) -> dict[int, int | None]:
        """Exit code per local rank, None while running (exited ones leave the timer)."""
        assert self._procs is not None
        codes = self._procs.poll()
        if self._timer is not None:
            pids = self._procs.pids()
            for lr, code in codes.items():
                if code is not None:
                    self._timer.clear_pid(pids[lr])
        return codes

    def pids(self) -> dict[int, int]:
        assert self._procs is not None
        return self._procs.pids()

    def exit_fds(self) -> list[int]:
        """What becomes readable when a running worker exits (see ``WorkerProcesses``)."""
        return self._procs.exit_fds() if self._procs is not None else []

    def prewarm(self, shared: list[str]) -> None:
        """Start the fork server before any worker (a spare waiting in the rendezvous),
        so the workers it may start later are forked in milliseconds, preloading what
        the other nodes' workers import (``shared``) or else a guess. Never raises."""
        spec = self._spec
        if self._forking.started and not shared:
            return
        try:
            modules = shared or guess_imports(spec.entrypoint)
            self._forking.prewarm(env=dict(spec.base_env), modules=modules)
        except (OSError, RelaunchError) as exc:
            log.warning("could not start the fork server early: %s", exc)

    def learn_modules(self, shared: list[str]) -> None:
        """What the other nodes' workers import, for workers that replace a lost node's:
        they import it before they join (``RELAUNCH_INPROCESS_PRELOAD``). Never raises."""
        try:
            self._forking.add_modules(shared)
        except OSError as exc:
            log.warning("could not write the list of modules to preload: %s", exc)

    def modules_to_share(self) -> list[str] | None:
        """What the workers import, when it grew (checked every few seconds once the
        fork server started from their list; they report for two minutes): the agent
        shares it with spares."""
        now = time.monotonic()
        if not self.slots or now < self._share_check:
            return None
        self._share_check = now + 5.0
        modules = self._forking.modules()
        if not modules or len(modules) == self._shared:
            return None
        self._shared = len(modules)
        return modules

    def tick(self, *, wanted: bool) -> None:
        """While the workers run: start the fork server when it is due."""
        if self.slots:
            self._forking.tick(
                wanted=wanted,
                running_for=time.monotonic() - self._started_at,
                env=self.slots[0].env,
            )

    def stop(self, sig: int, attempt: int) -> None:
        """Stop the attempt's workers (``sig``, then SIGKILL after the grace)."""
        procs, self._procs = self._procs, None
        if procs is None:
            return
        codes = procs.close(sig, grace=self._spec.stop_grace)
        self._forking.workers_stopped()
        if self._timer is not None:
            for pid in procs.pids().values():
                self._timer.clear_pid(pid)
        self._emit(WorkersStopped(attempt=attempt, exitcodes=codes))

    def close(self, sig: int, attempt: int) -> None:
        """Stop the workers, then the fork server and the timer server."""
        self.stop(sig, attempt)
        self._forking.close()
        if self._timer is not None:
            self._timer.close()
            self._timer = None

    def _on_timer_expiry(self, expiry: TimerExpiry) -> None:
        self._emit(WatchdogExpired(pid=expiry.pid, scope=expiry.scope_id, signal=expiry.signal))
