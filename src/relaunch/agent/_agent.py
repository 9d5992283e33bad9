"""The per-node agent: rendezvous, start workers, monitor, restart, exit barrier."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from relaunch.agent._attempt import Slot, attempt_workers, return_values
from relaunch.agent._forking import NodeForkServer
from relaunch.agent._round import (
    exit_barrier,
    gather_failures,
    publish_failures,
    publish_worker_store,
    read_worker_store,
    store_lost_reason,
)
from relaunch.agent._spec import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState
from relaunch.agent._watch import poll_group
from relaunch.errors import (
    ProcessFailure,
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    StoreError,
)
from relaunch.events import Event, EventSink
from relaunch.procs import (
    RunLogDir,
    WorkerProcesses,
    set_child_subreaper,
)
from relaunch.rendezvous import RendezvousInfo
from relaunch.store.tcp import TCPStoreServer
from relaunch.timer import TimerExpiry, TimerServer

__all__ = ["LocalAgent"]

log = logging.getLogger(__name__)


class LocalAgent:
    """Runs one role's workers on this node until they succeed, fail for good, or a signal.

    Owns: the worker processes, the fork server, the workers' store (on the
    rank-0 node), the timer server, the run log directory. :meth:`run` releases
    all of them before it returns.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self._spec = spec
        self._handler = spec.rdzv_handler
        self._run_id = self._handler.get_run_id()
        self._host = socket.gethostname()
        self._remaining_restarts = spec.max_restarts
        self._restart_count = 0
        self._attempt = -1
        self._group = WorkerGroup(
            spec=spec, workers=[Worker(local_rank=i) for i in range(spec.local_world_size)]
        )
        self._procs: WorkerProcesses | None = None
        self._forking: NodeForkServer | None = None
        self._slots: dict[int, Slot] = {}
        self._started_at = 0.0
        self._worker_store: TCPStoreServer | None = None
        self._info: RendezvousInfo | None = None
        self._wake = threading.Event()
        self._stop_signal: int | None = None
        self._logdir: RunLogDir | None = None
        self._events = EventSink(None)
        self._timer: TimerServer | None = None

    # -- public -------------------------------------------------------------------
    @property
    def stop_signal(self) -> int | None:
        """The signal that stopped the run, if one did."""
        return self._stop_signal

    @property
    def run_log_dir(self) -> str | None:
        return self._logdir.path if self._logdir else None

    def request_stop(self, signum: int) -> None:
        """Ask the run to stop (safe to call from a signal handler: it only sets flags)."""
        self._stop_signal = signum
        self._wake.set()
        self._handler.interrupt()  # a blocked rendezvous returns soon

    def run(self) -> RunResult:
        """Run to the end. Raises RendezvousError or StoreError when the job cannot continue."""
        self._setup()
        try:
            return self._loop()
        except (RendezvousClosedError, RendezvousGracefulExitError):
            if self._stop_signal is not None:
                return self._stopped()  # our own interrupt() ended a rendezvous
            if self._attempt < 0:
                # Closed before this node ever ran workers: a spare the job did not need.
                self._emit("not_needed")
                return RunResult(state=WorkerState.SUCCEEDED)
            raise
        finally:
            self._teardown()

    # -- lifecycle ----------------------------------------------------------------
    def _setup(self) -> None:
        set_child_subreaper()
        self._logdir = RunLogDir(self._spec.log_dir, self._run_id)
        self._events = EventSink(os.path.join(self._logdir.path, "events.jsonl"))
        self._forking = NodeForkServer(
            modules_file=os.path.join(self._logdir.path, "worker_modules.txt"),
            log_dir=self._logdir.path,
            delay=self._spec.standby_delay,
            emit=self._emit,
        )
        if self._spec.watchdog:
            timer = TimerServer(path=self._spec.watchdog_file, on_expiry=self._on_timer_expiry)
            timer.start()
            self._timer = timer

    def _teardown(self) -> None:
        sig = self._stop_signal or signal.SIGTERM
        self._stop_workers(sig)
        if self._forking is not None:
            self._forking.close()
        if self._worker_store is not None:
            self._worker_store.close()
            self._worker_store = None
        if self._timer is not None:
            self._timer.close()
            self._timer = None
        try:
            self._handler.shutdown()
        except (RendezvousError, StoreError) as exc:
            log.warning("rendezvous shutdown failed: %s", exc)
        if self._logdir is not None:
            self._logdir.close()

    def _emit(self, name: str, **metadata: object) -> None:
        self._events.emit(
            Event(
                name=name,
                run_id=self._run_id,
                role=self._spec.role,
                host=self._host,
                group_rank=self._group.group_rank,
                restart_count=self._restart_count,
                metadata=metadata,
            )
        )

    # -- the loop -----------------------------------------------------------------
    def _loop(self) -> RunResult:
        try:
            return self._loop_once_started()
        except StoreError as exc:
            if self._stop_signal is not None:
                return self._stopped()
            return self._store_lost(exc)

    def _store_lost(self, exc: StoreError) -> RunResult:
        """The rendezvous store is unreachable: the job cannot go on; say why, and stop."""
        failures: dict[int, ProcessFailure] = {}
        if self._procs is not None:
            _, failures = self._poll()
        self._stop_workers(signal.SIGTERM)
        reason = store_lost_reason(self._handler.get_backend(), exc)
        self._emit("store_lost", reason=reason)
        return RunResult(state=WorkerState.FAILED, failures=failures, reason=reason)

    def _loop_once_started(self) -> RunResult:
        self._rendezvous_and_start()
        spec = self._spec
        while True:
            if self._wake.wait(spec.monitor_interval) or self._stop_signal is not None:
                return self._stopped()
            state, failures = self._poll()
            self._group.state = state
            if state == WorkerState.SUCCEEDED:
                self._emit("workers_succeeded", attempt=self._attempt)
                note = self._exit_barrier()
                values = return_values(self._spec, self._group.workers, self._slots)
                return RunResult(state=state, return_values=values, reason=note)
            try:
                if state == WorkerState.FAILED:
                    result = self._on_failure(failures)
                    if result is not None:
                        return result
                elif self._handler.num_nodes_waiting() > 0:
                    self._emit("membership_changed")
                    self._restart()
                else:
                    self._maybe_start_fork_server()
            except RendezvousClosedError:
                if self._stop_signal is not None:
                    return self._stopped()
                # Another node gave up on the job (or it was closed): we fail with it.
                self._stop_workers(signal.SIGTERM)
                self._emit("rendezvous_closed")
                return RunResult(state=WorkerState.FAILED, failures=self._job_failures({}))

    def _on_failure(self, failures: dict[int, ProcessFailure]) -> RunResult | None:
        """Restart after a worker failure, or end the run when the job's budget is spent."""
        assert self._info is not None
        self._emit(
            "workers_failed",
            attempt=self._attempt,
            failures={r: f.exitcode for r, f in failures.items()},
        )
        if self._info is not None:
            publish_failures(self._info, failures)
        total = self._handler.record_failure(self._info.round)
        if total > self._spec.max_restarts:
            self._stop_workers(signal.SIGTERM)
            self._emit("run_failed", attempt=self._attempt, restarts=total - 1)
            try:
                self._handler.set_closed()  # the other nodes stop too
            except (RendezvousError, StoreError) as exc:
                log.warning("could not close the rendezvous: %s", exc)
            return RunResult(state=WorkerState.FAILED, failures=self._job_failures(failures))
        self._emit("restart", restarts=total, max_restarts=self._spec.max_restarts)
        self._restart()
        return None

    def _stopped(self) -> RunResult:
        sig = self._stop_signal or signal.SIGTERM
        self._emit("stopped", signal=sig)
        self._stop_workers(sig)
        return RunResult(state=WorkerState.STOPPED)

    def _restart(self) -> None:
        self._stop_workers(signal.SIGTERM)
        self._rendezvous_and_start()

    def _poll(self) -> tuple[WorkerState, dict[int, ProcessFailure]]:
        """The group's state and its failures (see ``_watch.poll_group``)."""
        assert self._procs is not None
        codes = self._procs.poll()
        pids = self._procs.pids()
        if self._timer is not None:
            for lr, code in codes.items():
                if code is not None:
                    self._timer.clear_pid(pids[lr])
        return poll_group(
            self._group.workers,
            self._slots,
            codes,
            pids,
            hang_timeout=self._spec.hang_timeout if self._spec.entrypoint.is_python else None,
            emit=self._emit,
        )

    # -- rendezvous and start -------------------------------------------------------
    def _rendezvous_and_start(self) -> None:
        t0 = time.monotonic()
        info = self._handler.next_rendezvous()
        self._info = info
        self._restart_count = self._handler.restart_count()
        self._remaining_restarts = max(0, self._spec.max_restarts - self._restart_count)
        group = self._group
        group.group_rank, group.group_world_size, group.store = (
            info.rank,
            info.world_size,
            info.store,
        )
        group.master_addr, group.master_port = self._publish_worker_store(info)
        self._emit(
            "rendezvous_complete",
            round=info.round,
            world_size=info.world_size,
            seconds=round(time.monotonic() - t0, 4),
        )
        n = self._spec.local_world_size
        world = n * info.world_size
        for worker in group.workers:
            worker.global_rank = worker.role_rank = info.rank * n + worker.local_rank
            worker.world_size = worker.role_world_size = world
        self._start_workers()

    def _publish_worker_store(self, info: RendezvousInfo) -> tuple[str, int]:
        """Rank 0 hosts a fresh store for this round's workers; the others read its address."""
        if self._worker_store is not None:
            self._worker_store.close()
            self._worker_store = None
        if info.rank != 0:
            return read_worker_store(info, timeout=max(60.0, self._spec.exit_barrier_timeout))
        local = "127.0.0.1" if info.world_size == 1 else self._host
        addr = self._spec.master_addr or self._spec.local_addr or local
        bind = "127.0.0.1" if addr.startswith("127.") else "0.0.0.0"
        port = self._spec.master_port if info.world_size == 1 and self._spec.master_port else 0
        server = TCPStoreServer(host=bind, port=port)
        server.start()
        self._worker_store = server
        if info.world_size > 1:
            publish_worker_store(info, addr, server.port)
        return addr, server.port

    def _start_workers(self) -> None:
        spec, group = self._spec, self._group
        assert self._logdir is not None and group.master_addr is not None
        assert group.master_port is not None and group.group_rank is not None
        assert group.group_world_size is not None
        self._attempt += 1
        extra: dict[str, str] = {}
        if self._timer is not None:
            extra["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1"
            extra["TORCHELASTIC_TIMER_FILE"] = self._timer.path
        self._slots, specs = attempt_workers(
            spec,
            group,
            self._logdir,
            self._attempt,
            restart_count=self._restart_count,
            run_id=self._run_id,
            extra=extra,
        )
        assert self._forking is not None
        warm = spec.warm_standby and spec.entrypoint.is_python
        modules = self._forking.modules_file
        report = {0: modules} if warm and not os.path.exists(modules) else {}
        server = self._forking.usable()
        procs = WorkerProcesses(
            spec.entrypoint,
            specs,
            fork_server=server,
            report_modules=report,
            name=spec.role,
        )
        self._procs = procs
        t0 = time.monotonic()
        procs.start()
        start_seconds = round(time.monotonic() - t0, 4)
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
            "workers_started",
            attempt=self._attempt,
            pids=pids,
            forked=sorted(procs.forked),
            seconds=start_seconds,
            master_addr=group.master_addr,
            master_port=group.master_port,
        )

    def _maybe_start_fork_server(self) -> None:
        spec = self._spec
        if self._forking is not None and self._slots:
            self._forking.tick(
                wanted=spec.warm_standby
                and spec.entrypoint.is_python
                and self._remaining_restarts > 0,
                running_for=time.monotonic() - self._started_at,
                env=self._slots[0].env,
            )

    def _stop_workers(self, sig: int) -> None:
        procs, self._procs = self._procs, None
        if procs is None:
            return
        codes = procs.close(sig, grace=self._spec.stop_grace)
        self._group.state = WorkerState.STOPPED
        if self._timer is not None:
            for pid in procs.pids().values():
                self._timer.clear_pid(pid)
        self._emit("workers_stopped", attempt=self._attempt, exitcodes=codes)

    def _exit_barrier(self) -> str | None:
        """Wait for the round's other nodes; then the job is over: rank 0 closes the
        rendezvous, so spares still waiting in it learn that they are not needed.
        Returns what to tell the user when the other nodes did not all arrive."""
        info = self._info
        if info is None:
            return None
        note = exit_barrier(info, self._spec.exit_barrier_timeout)
        if note is not None:
            self._emit("exit_barrier_timeout", world_size=info.world_size)
            return note
        if info.rank == 0:
            try:
                self._handler.set_closed()
            except (RendezvousError, StoreError) as exc:
                log.warning("could not close the rendezvous after success: %s", exc)
        return None

    def _job_failures(self, own: dict[int, ProcessFailure]) -> dict[int, ProcessFailure]:
        return gather_failures(self._info, own) if self._info is not None else dict(own)

    def _on_timer_expiry(self, expiry: TimerExpiry) -> None:
        self._emit("watchdog_expired", pid=expiry.pid, scope=expiry.scope_id, signal=expiry.signal)
