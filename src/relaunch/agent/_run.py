"""One run of the node agent: rendezvous, start workers, monitor, restart, exit barrier.

:class:`AgentRun` exists for the length of :meth:`LocalAgent.run`: it is built with
everything a run owns (the run log directory, the event sink, the node's workers), so
none of them is ever missing while the loop runs, and :meth:`AgentRun.run` releases
them all before it returns.
"""

from __future__ import annotations

import os
import signal
import time

from relaunch import events
from relaunch._never import assert_never
from relaunch.agent._attempt import return_values
from relaunch.agent._core import (
    STOP_GRACE,
    Action,
    DropRanks,
    ExitBarrier,
    GiveUp,
    Hang,
    MarkInprocess,
    Monitor,
    NodeLost,
    Observation,
    RestartGroup,
    Stop,
    after_failure,
    decide,
    signalled_to_stop,
    wants_fork_server,
)
from relaunch.agent._membership import Membership
from relaunch.agent._round import (
    BarrierEnd,
    WorkerStore,
    barrier_note,
    close_rendezvous,
    depart_round,
    finish_round,
    gather_failures,
    leave_rendezvous,
    moved_on,
    publish_failures,
    store_lost_reason,
)
from relaunch.agent._spec import (
    RoundStart,
    RunResult,
    StopRequest,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
    policy_of,
)
from relaunch.agent._status import NodeStatus, say
from relaunch.agent._warmup import learn_modules, next_round, share_modules
from relaunch.agent._watch import after_return, causes, failures, observe, report_hang
from relaunch.agent._workers import NodeWorkers
from relaunch.errors import (
    ProcessFailure,
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    StoreConnectionError,
    StoreError,
)
from relaunch.events import Detail, Event, EventSink
from relaunch.procs import RunLogDir, set_child_subreaper
from relaunch.rendezvous import RendezvousInfo

__all__ = ["AgentRun"]


class AgentRun:
    """One run of this node's workers, until they succeed, fail for good, or a signal.

    Owns: the worker processes, the fork server, the workers' store (on the rank-0
    node), the timer server, the run log directory.
    """

    def __init__(
        self, spec: WorkerSpec, *, status: NodeStatus, stop: StopRequest, host: str
    ) -> None:
        self._spec = spec
        self._handler = spec.rdzv_handler
        self._run_id = self._handler.get_run_id()
        self._host = host
        self._status = status
        self._stop = stop
        self._policy = policy_of(spec)
        self._restart_count = 0
        self._attempt = -1
        self._group = WorkerGroup(
            spec=spec, workers=[Worker(local_rank=i) for i in range(spec.local_world_size)]
        )
        self._worker_store = WorkerStore(spec, host)
        self._info: RendezvousInfo | None = None  # this node's round (None: before the first)
        set_child_subreaper()
        self.logdir = RunLogDir(spec.log_dir, self._run_id)
        self._events = EventSink(os.path.join(self.logdir.path, "events.jsonl"))
        self._membership = Membership(self._handler, self._emit, self._run_id)
        try:
            self._workers = NodeWorkers(spec, self.logdir, self._emit)
        except BaseException:
            self.logdir.close(keep=False)
            raise

    def run(self) -> RunResult:
        """Run to the end, then release what the run owns. Raises RendezvousError or
        StoreError when the job cannot continue."""
        keep = True  # a run that fails keeps its temporary log dir (the error files)
        try:
            with self._stop.armed():
                result = self._loop()
            keep = result.state == WorkerState.FAILED
            return result
        finally:
            self._teardown(keep_logs=keep)

    def _job_closed(self) -> RunResult:
        """The rendezvous is closed (seen at the exit barrier, or joining a round): the
        job succeeded without this node, or another node gave up on it (which counts
        one failure past the budget)."""
        if self._stop.signum is not None:
            return self._stopped()  # our own interrupt() ended a rendezvous
        if self._attempt < 0:  # a spare the job did not need
            self._emit(events.NotNeeded())
            return RunResult(state=WorkerState.SUCCEEDED)
        self._stop_workers(signal.SIGTERM)
        if self._handler.restart_count() <= self._policy.max_restarts:
            self._emit(events.FinishedWithout())
            return RunResult(state=WorkerState.SUCCEEDED)
        self._emit(events.RendezvousClosed())
        return RunResult(state=WorkerState.FAILED, failures=self._job_failures({}))

    # -- lifecycle ----------------------------------------------------------------
    def _teardown(self, *, keep_logs: bool) -> None:
        sig = self._stop.signum or signal.SIGTERM
        self._workers.close(sig, self._attempt)
        self._group.state = WorkerState.STOPPED
        self._publish_status(force=True)
        if self._attempt >= 0:
            self._status.say_summary()
        self._worker_store.close()
        leave_rendezvous(self._handler)
        kept = self.logdir.close(keep=keep_logs)
        if kept is not None:
            say(f"the failed run's logs and error files are kept in {kept}")

    def _emit(self, detail: Detail) -> None:
        event = Event(
            detail=detail,
            run_id=self._run_id,
            role=self._spec.role,
            host=self._host,
            group_rank=self._group.group_rank,
            restart_count=self._restart_count,
        )
        self._events.emit(event)
        self._status.observe(event)
        self._publish_status()

    def _publish_status(self, *, force: bool = False) -> None:
        ws = self._workers
        pids = ws.pids() if ws.running else {}
        self._status.publish(self._group, self._workers.slots, pids, force=force)

    # -- the loop -----------------------------------------------------------------
    def _loop(self) -> RunResult:
        try:
            return self._loop_once_started()
        except (StoreError, RendezvousStateError) as exc:
            if self._stop.signum is not None:
                return self._stopped()
            return self._store_lost(exc)

    def _store_lost(self, exc: StoreError | RendezvousStateError) -> RunResult:
        """The rendezvous store is unreachable (or its state stayed corrupt): say why, stop."""
        failures: dict[int, ProcessFailure] = {}
        if self._workers.running:
            obs = self._observe(ask_rendezvous=False)
            failed = tuple(v.local_rank for v in obs.ranks if v.exitcode and v.returned is None)
            failures = self._failures(failed, obs)
        self._status.stop_publishing()
        self._stop_workers(signal.SIGTERM)
        reason = store_lost_reason(self._handler, exc)
        self._emit(events.StoreLost(reason=reason))
        if isinstance(exc, StoreConnectionError):  # nothing more asked of a store known lost
            leave_rendezvous(self._handler, store_lost=True)
        return RunResult(state=WorkerState.FAILED, failures=failures, reason=reason)

    def _loop_once_started(self) -> RunResult:
        try:
            self._rendezvous_and_start()
            while True:
                self._stop.wait(self._spec.monitor_interval, self._workers.exit_fds())
                obs = self._observe()
                action = decide(obs, self._policy)
                if signalled_to_stop(action, obs):  # the agent's signal may be a moment behind
                    self._stop.wait(STOP_GRACE)
                    action = decide(obs := self._observe(), self._policy)
                result = self._act(action, obs)
                self._publish_status()
                if result is not None:
                    return result
        except (RendezvousClosedError, RendezvousGracefulExitError):
            return self._job_closed()

    def _observe(self, *, ask_rendezvous: bool = True) -> Observation:
        """Poll the processes, and the rendezvous (:meth:`Membership.observe`)."""
        codes = self._workers.poll()
        slots = self._workers.slots
        running = all(code is None or slots[lr].lost for lr, code in codes.items())
        ask = ask_rendezvous and self._stop.signum is None
        hang_timeout = self._policy.hang_timeout
        obs = observe(
            slots,
            codes,
            watch_progress=bool(hang_timeout),
            stop_signal=self._stop.signum,
            pids=self._workers.pids() if hang_timeout else None,
            stalled_after=hang_timeout,
        )
        return self._membership.observe(obs, self._info if ask else None, running=running)

    def _failures(self, ranks: tuple[int, ...], obs: Observation) -> dict[int, ProcessFailure]:
        workers = self._workers
        return failures(ranks, obs, self._group.workers, workers.slots, workers.pids())

    def _act(self, action: Action, obs: Observation) -> RunResult | None:
        """Carry out the core's decision; a RunResult ends the run."""
        match action:
            case Stop():
                if any(v.exitcode is None for v in obs.ranks):  # the others go on without it
                    depart_round(self._handler)
                return self._stopped()
            case Monitor():
                self._workers.tick(wanted=self._wants_fork_server())
                share_modules(self._handler, self._workers)
            case DropRanks():
                self._workers.drop(action, obs, self._group, self._attempt)
            case NodeLost():
                self._membership.lost(action.vacancies, self._group, self._restart_count)
            case MarkInprocess():
                self._membership.mark()
            case ExitBarrier():
                return self._succeeded(action, obs)
            case RestartGroup(reason="membership"):
                self._emit(events.MembershipChanged())
                self._restart()
            case RestartGroup():
                if action.hang is not None:
                    self._emit(self._report_hang(action.hang))
                self._group.state = WorkerState.FAILED
                return self._on_failure(self._failures(action.failed, obs))
            case _:
                assert_never(action)
        return None

    def _succeeded(self, action: ExitBarrier, obs: Observation) -> RunResult | None:
        """Every worker is done: wait for the round's other nodes, then end the run
        (None: one of them left the round unfinished, and this node runs again)."""
        notes = after_return(action, obs, self._group.workers, self._policy.teardown_grace)
        if action.kill:
            self._stop_workers(signal.SIGKILL)  # returned, then stuck in teardown
        self._group.state = WorkerState.SUCCEEDED
        self._emit(events.WorkersSucceeded(attempt=self._attempt, after_return=notes))
        timeout = self._spec.exit_barrier_timeout
        end = finish_round(self._handler, self._info, timeout, self._emit, self._stop)
        if end is BarrierEnd.ROUND_ENDED:  # the job goes on: this node too
            self._emit(events.RoundReopened())
            self._restart()
            return None
        if end in (BarrierEnd.CLOSED, BarrierEnd.STOPPED):  # (STOPPED: a signal to the agent)
            return self._job_closed() if end is BarrierEnd.CLOSED else self._stopped()
        note = barrier_note(self._info, timeout) if end is BarrierEnd.TIMED_OUT else None
        values = return_values(self._spec, self._group.workers, self._workers.slots)
        return RunResult(state=WorkerState.SUCCEEDED, return_values=values, reason=note)

    def _report_hang(self, hang: Hang) -> events.WorkerHung:
        assert self._policy.hang_timeout is not None
        pid = self._workers.pids()[hang.local_rank]
        return report_hang(
            hang, self._workers.slots[hang.local_rank], pid, self._policy.hang_timeout
        )

    def _on_failure(self, failures: dict[int, ProcessFailure]) -> RunResult | None:
        """Restart after a worker failure, or end the run when the job's budget is spent."""
        assert self._info is not None
        self._emit(
            events.WorkersFailed(
                attempt=self._attempt,
                failures={r: f.exitcode for r, f in failures.items()},
                causes=causes(failures),
            )
        )
        publish_failures(self._info, failures)
        total = self._handler.record_failure(self._info.round)
        if total is None:  # the job went on from this round first: the next one
            self._emit(events.RoundWentOn(round=self._info.round))
            self._restart()
            return None
        verdict = after_failure(total, self._policy.max_restarts)
        if isinstance(verdict, GiveUp):
            self._stop_workers(signal.SIGTERM)
            self._emit(events.RunFailed(attempt=self._attempt, restarts=verdict.restarts))
            close_rendezvous(self._handler)  # the other nodes stop too
            return RunResult(state=WorkerState.FAILED, failures=self._job_failures(failures))
        self._emit(events.Restart(restarts=total, max_restarts=self._spec.max_restarts))
        self._restart()
        return None

    def _stopped(self) -> RunResult:
        sig = self._stop.signum or signal.SIGTERM
        self._emit(events.Stopped(signal=sig))
        self._stop_workers(sig)
        return RunResult(state=WorkerState.STOPPED)

    def _restart(self) -> None:
        self._stop_workers(signal.SIGTERM)
        self._rendezvous_and_start()

    # -- rendezvous and start -------------------------------------------------------
    def _rendezvous_and_start(self) -> None:
        self._publish_status(force=True)  # what happened shows while the rendezvous waits
        t0 = time.monotonic()
        info = self._join_round()
        group = self._group
        self._membership.new_round(info.rank, info.incarnation)
        replacing = bool(info.incarnation)
        self._emit(
            events.RendezvousComplete(
                round=info.round,
                world_size=info.world_size,
                seconds=round(time.monotonic() - t0, 4),
                replaces=info.rank if replacing else None,
                incarnation=info.incarnation if replacing else None,
            )
        )
        self._attempt += 1
        if info.incarnation:
            # This node takes a lost one's place: its ranks' old processes are dead to
            # the running workers before the new ones ask to join (the other nodes may
            # not have seen the vacancy before it was filled).
            self._membership.lost(
                {info.rank: info.incarnation}, group, self._restart_count, taking_over=True
            )
            learn_modules(self._handler, self._workers)
        start = RoundStart(
            info=info,
            ranks=tuple(w.global_rank for w in group.workers),
            addr=self._spec.local_addr or self._host,
        )
        for hook in self._spec.round_hooks:
            hook.round_started(start)
        self._workers.start(
            group,
            self._attempt,
            restart_count=self._restart_count,
            run_id=self._run_id,
            incarnation=info.incarnation,
        )

    def _join_round(self) -> RendezvousInfo:
        """The next complete round whose rank 0 said where its workers' store is (a
        round whose rank 0 is lost before it said so is left for the next one)."""
        prewarm = self._attempt < 0 and self._wants_fork_server()
        while True:
            info = next_round(self._handler, self._workers, prewarm=prewarm)
            self._info = info
            self._restart_count = self._handler.restart_count()
            self._group.place(info.rank, info.world_size, info.store)
            # (told to stop: the next rendezvous ends at once)
            where = self._worker_store.open(
                info, moved_on=lambda: self._stop.signum is not None or moved_on(self._handler)
            )
            if where is not None:
                self._group.master_addr, self._group.master_port = where
                return info

    def _wants_fork_server(self) -> bool:
        return wants_fork_server(
            self._policy,
            is_python=self._spec.entrypoint.is_python,
            restart_count=self._restart_count,
        )

    def _stop_workers(self, sig: int) -> None:
        if self._workers.running:
            self._workers.stop(sig, self._attempt)
            self._group.state = WorkerState.STOPPED

    def _job_failures(self, own: dict[int, ProcessFailure]) -> dict[int, ProcessFailure]:
        return gather_failures(self._info, own) if self._info is not None else dict(own)
