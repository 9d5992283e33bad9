"""The per-node agent: rendezvous, start workers, monitor, restart, exit barrier."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

from relaunch.agent._contract import AttemptFiles
from relaunch.agent._env import substitute_local_rank, worker_env, worker_streams
from relaunch.agent._observe import (
    announced_exit,
    collect_stacks,
    last_progress,
    oldest_hung,
    record_hang,
)
from relaunch.agent._round import (
    exit_barrier,
    gather_failures,
    publish_failures,
    publish_worker_store,
    read_worker_store,
)
from relaunch.agent._spec import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState
from relaunch.errors import (
    ProcessFailure,
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    StoreError,
)
from relaunch.events import Event, EventSink
from relaunch.procs import (
    ForkServer,
    ProcessSpec,
    RunLogDir,
    WorkerProcesses,
    set_child_subreaper,
)
from relaunch.rendezvous import RendezvousInfo
from relaunch.store.tcp import TCPStoreServer
from relaunch.timer import TimerExpiry, TimerServer

__all__ = ["LocalAgent"]

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    """One local rank's worker of the current attempt: its environment and files."""

    env: dict[str, str]
    files: AttemptFiles
    started: float
    """Wall-clock start (hang detection counts from it before the first progress)."""
    lost: ProcessFailure | None = None
    """Set when the worker died and its in-process peers went on without it."""


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
        self._fork_server: ForkServer | None = None
        self._fork_refused: str | None = None
        self._fork_server_ready = False
        self._slots: dict[int, _Slot] = {}
        self._started_at = 0.0
        self._worker_store: TCPStoreServer | None = None
        self._info: RendezvousInfo | None = None
        self._wake = threading.Event()
        self._stop_signal: int | None = None
        self._logdir: RunLogDir | None = None
        self._events = EventSink(None)
        self._modules_file = ""
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
        self._modules_file = os.path.join(self._logdir.path, "worker_modules.txt")
        if self._spec.watchdog:
            timer = TimerServer(path=self._spec.watchdog_file, on_expiry=self._on_timer_expiry)
            timer.start()
            self._timer = timer

    def _teardown(self) -> None:
        sig = self._stop_signal or signal.SIGTERM
        self._stop_workers(sig)
        if self._fork_server is not None:
            self._fork_server.close()
            self._fork_server = None
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
        if self._handler.get_backend() == "c10d":
            reason = (
                f"the node hosting the c10d rendezvous store was lost ({exc}); the job cannot "
                "go on without it (--rdzv-backend etcd survives the loss of any node)"
            )
        else:
            reason = f"the rendezvous store cannot be reached ({exc})"
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
                return RunResult(state=state, return_values=self._return_values(), reason=note)
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
        self._publish_failures(failures)
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
        """The group's state. A worker has failed once its runner announced a non-zero exit
        (before its teardown), once it exited non-zero, or once it hung. A failed worker of
        an in-process restart group is *lost*, not a group failure, while in-process peers
        of it still run: they go on without it."""
        assert self._procs is not None
        codes = self._procs.poll()
        pids = self._procs.pids()
        failures: dict[int, ProcessFailure] = {}
        for worker in self._group.workers:
            lr, slot = worker.local_rank, self._slots[worker.local_rank]
            code = codes.get(lr)
            if code is not None and self._timer is not None:
                self._timer.clear_pid(pids[lr])
            if code is None:
                code = codes[lr] = announced_exit(slot.files)
            if code is None or code == 0 or slot.lost is not None:
                continue
            failure = ProcessFailure(
                local_rank=lr, pid=pids[lr], exitcode=code, error_file=slot.files.error_file
            )
            if self._peers_restart_in_process(lr, codes):
                slot.lost = failure
                self._emit("worker_lost", local_rank=lr, exitcode=code, reason=failure.message)
                continue
            failures[worker.global_rank] = failure
        lost = {
            w.global_rank: s.lost
            for w in self._group.workers
            if (s := self._slots[w.local_rank]).lost
        }
        if not failures and self._spec.hang_timeout:
            failures = self._hung(codes, pids)
        if failures:
            failures.update(lost)
            return WorkerState.FAILED, failures
        if all(code is not None for code in codes.values()):
            if len(lost) == len(codes):
                return WorkerState.FAILED, lost
            return WorkerState.SUCCEEDED, failures
        return WorkerState.HEALTHY, failures

    def _hung(
        self, codes: dict[int, int | None], pids: dict[int, int]
    ) -> dict[int, ProcessFailure]:
        """The worker hung longest, as a failure with its stacks, if one passed --hang-timeout."""
        timeout = self._spec.hang_timeout
        if not timeout or not self._spec.entrypoint.is_python:
            return {}
        progress = {
            lr: t
            for lr, slot in self._slots.items()
            if codes.get(lr) is None
            and not os.path.exists(slot.files.marker)
            and (t := last_progress(slot.files, slot.started)) is not None
        }
        lr = oldest_hung(progress, time.time(), timeout)
        if lr is None:
            return {}
        files = self._slots[lr].files
        stacks = collect_stacks(pids[lr], files)
        message = record_hang(files, since=progress[lr], timeout=timeout, stacks=stacks)
        self._emit("worker_hung", local_rank=lr, pid=pids[lr], reason=message, stacks=stacks)
        log.error("local rank %s (pid %s): %s; its stacks:\n%s", lr, pids[lr], message, stacks)
        worker = self._group.workers[lr]
        failure = ProcessFailure(
            local_rank=lr, pid=pids[lr], exitcode=-signal.SIGKILL, error_file=files.error_file
        )
        return {worker.global_rank: failure}

    def _peers_restart_in_process(self, local_rank: int, codes: dict[int, int | None]) -> bool:
        """Whether the worker ran under relaunch.inprocess, and so do running peers of it."""
        slots = self._slots
        return os.path.exists(slots[local_rank].files.marker) and any(
            code is None and os.path.exists(slots[lr].files.marker)
            for lr, code in codes.items()
            if lr != local_rank
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

    def _advertised_addr(self, world_size: int) -> str:
        if self._spec.master_addr:
            return self._spec.master_addr
        if self._spec.local_addr:
            return self._spec.local_addr
        return "127.0.0.1" if world_size == 1 else self._host

    def _publish_worker_store(self, info: RendezvousInfo) -> tuple[str, int]:
        """Rank 0 hosts a fresh store for this round's workers; the others read its address."""
        if self._worker_store is not None:
            self._worker_store.close()
            self._worker_store = None
        if info.rank != 0:
            return read_worker_store(info, timeout=max(60.0, self._spec.exit_barrier_timeout))
        addr = self._advertised_addr(info.world_size)
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
        self._slots = {}
        extra: dict[str, str] = {}
        if self._timer is not None:
            extra["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1"
            extra["TORCHELASTIC_TIMER_FILE"] = self._timer.path
        specs: list[ProcessSpec] = []
        for worker in group.workers:
            lr = worker.local_rank
            attempt_dir = self._logdir.attempt_dir(self._attempt, lr)
            files = AttemptFiles.in_dir(attempt_dir)
            env = worker_env(
                base=spec.base_env,
                local_rank=lr,
                global_rank=worker.global_rank,
                role_rank=worker.role_rank,
                role=spec.role,
                local_world_size=spec.local_world_size,
                world_size=worker.world_size,
                role_world_size=worker.role_world_size,
                group_rank=group.group_rank,
                group_world_size=group.group_world_size,
                master_addr=group.master_addr,
                master_port=group.master_port,
                restart_count=self._restart_count,
                max_restarts=spec.max_restarts,
                run_id=self._run_id,
                error_file=files.error_file,
                extra={**extra, **files.env(spec.hang_timeout)},
            )
            self._slots[lr] = _Slot(env=env, files=files, started=time.time())
            stdout, stderr, tee = worker_streams(spec, lr, worker.global_rank, attempt_dir)
            args = substitute_local_rank(spec.args, lr)
            is_function = spec.entrypoint.kind == "function"
            specs.append(
                ProcessSpec(
                    local_rank=lr,
                    env=env,
                    args=() if is_function else tuple(str(a) for a in args),
                    call_args=args if is_function else (),
                    result_file=files.result_file if is_function else None,
                    stdout=stdout,
                    stderr=stderr,
                    tee=tee,
                )
            )
        warm = spec.warm_standby and spec.entrypoint.is_python
        report = {}
        if warm and not os.path.exists(self._modules_file):
            report[0] = self._modules_file
        server = self._fork_server
        procs = WorkerProcesses(
            spec.entrypoint,
            specs,
            fork_server=server if server is not None and server.alive() else None,
            report_modules=report,
            name=spec.role,
        )
        self._procs = procs
        t0 = time.monotonic()
        procs.start()
        start_seconds = round(time.monotonic() - t0, 4)
        if procs.fork_refused is not None and server is not None:
            self._fork_refused = procs.fork_refused
            log.warning(
                "the fork server cannot fork workers (%s): starting fresh interpreters from now on",
                procs.fork_refused,
            )
            self._emit("fork_server_refused", reason=procs.fork_refused)
            server.close()
            self._fork_server = None
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
        spec, server = self._spec, self._fork_server
        if server is not None and not self._fork_server_ready:
            server.pump(0.0)
            if server.ready:
                self._fork_server_ready = True
                self._emit("fork_server_ready", pid=server.pid)
        if (
            not spec.warm_standby
            or not spec.entrypoint.is_python
            or self._remaining_restarts <= 0
            or self._fork_server is not None
            or self._fork_refused is not None
            or self._logdir is None
        ):
            return
        running = time.monotonic() - self._started_at
        # Wait until the workers told us what they import (or for long enough), so the
        # server preloads exactly that, and does not compete with the workers' own start.
        if running < spec.standby_delay or (
            not os.path.exists(self._modules_file) and running < 30.0
        ):
            return
        self._fork_server = ForkServer(
            env=self._slots[0].env,
            preload_file=self._modules_file,
            log_file=os.path.join(self._logdir.path, "fork_server.log"),
        )
        self._emit("fork_server_started", pid=self._fork_server.pid)

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
        if info.world_size > 1 and not exit_barrier(info, self._spec.exit_barrier_timeout):
            note = (
                f"this node's workers succeeded, but not every node of the round (world size "
                f"{info.world_size}) reached the exit barrier within "
                f"{self._spec.exit_barrier_timeout:g} s: the other nodes' outcome is unknown"
            )
            self._emit("exit_barrier_timeout", world_size=info.world_size)
            return note
        if info.rank == 0:
            try:
                self._handler.set_closed()
            except (RendezvousError, StoreError) as exc:
                log.warning("could not close the rendezvous after success: %s", exc)
        return None

    def _publish_failures(self, failures: dict[int, ProcessFailure]) -> None:
        if self._info is not None and self._info.world_size > 1:
            publish_failures(self._info, failures)

    def _job_failures(self, own: dict[int, ProcessFailure]) -> dict[int, ProcessFailure]:
        if self._info is None or self._info.world_size <= 1:
            return dict(own)
        return gather_failures(self._info, own)

    def _return_values(self) -> dict[int, object]:
        """Return values of a function entrypoint, by global rank (None if unreadable)."""
        if self._spec.entrypoint.kind != "function":
            return {}
        values: dict[int, object] = {}
        for worker in self._group.workers:
            value: object = None
            try:
                with open(self._slots[worker.local_rank].files.result_file) as f:
                    data = json.load(f)
                if isinstance(data, dict) and data.get("version") == 1:
                    value = data.get("value")
            except (OSError, ValueError) as exc:
                log.warning("local rank %s: no readable return value: %s", worker.local_rank, exc)
            values[worker.global_rank] = value
        return values

    def _on_timer_expiry(self, expiry: TimerExpiry) -> None:
        self._emit("watchdog_expired", pid=expiry.pid, scope=expiry.scope_id, signal=expiry.signal)
