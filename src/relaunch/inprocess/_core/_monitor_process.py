"""The monitor process: one per rank, a separate OS process that outlives its rank.

It is forked from the rank before the rank opens any connection or starts any thread
of the wrapper (fork is ~1 ms; spawning a new interpreter that imports torch costs
~1.5 s of CPU). It never returns into the rank's code: it ends with ``os._exit``.

Every ``interval`` it
- heartbeats into the store, and declares missing (``UNRESPONSIVE``) a rank it watches
  whose heartbeat has not moved for ``heartbeat_timeout`` (it watches about log2 of the
  world's ranks: :func:`watched`);
- kills its rank when it made no progress for ``hard_timeout`` while the wrapped
  function runs: SIGTERM, then SIGKILL after ``termination_grace_time``.
It notices its rank's death at once (a pidfd) and records it as dead
(``TERMINATED``, or ``HARD_TIMEOUT`` when it killed it), so the other ranks restart
without waiting for a timeout.

Standalone (no agent store), the monitor process of initial rank 0 also hosts the
coordination store, and keeps serving it after its rank died, until every rank has
left or is dead: a rank's death does not take the store down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relaunch.inprocess._core._config import CallConfig
from relaunch.inprocess._core._coord import CoordinationStore, TorchStore
from relaunch.inprocess._core._logs import get_logger
from relaunch.inprocess._core._main_thread import WAKE_SIGNAL
from relaunch.inprocess._core._progress import SharedProgress
from relaunch.inprocess._core._records import Interruption
from relaunch.inprocess._core._state import State
from relaunch.procs import terminate

__all__ = ["MonitorProcess", "MonitorSettings", "watched"]

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class MonitorSettings:
    """What the monitor process needs (already validated by the wrapper's config)."""

    initial_rank: int
    initial_world_size: int
    namespace: str
    interval: float
    hard_timeout: float
    heartbeat_timeout: float
    termination_grace_time: float
    logfile: str | None
    host_port: int | None
    """Host the coordination store on this port (standalone mode, initial rank 0)."""
    heartbeat_interval: float = 1.0
    pidfile: str | None = None
    """Where the monitor process's pid is written (``{rank}``: the initial rank)."""
    incarnation: int = 0
    """Which process of the rank this is (its death record says so; see _rejoin)."""

    @classmethod
    def of(
        cls,
        cfg: CallConfig,
        state: State,
        *,
        namespace: str,
        host_port: int | None,
        incarnation: int,
    ) -> MonitorSettings:
        """The settings for the rank of ``state`` from the wrapper's config."""
        beat = "heartbeat_interval" if cfg.heartbeat_interval is not None else None
        return cls(
            initial_rank=state.initial_rank,
            initial_world_size=state.initial_world_size,
            namespace=namespace,
            interval=cfg.seconds("monitor_process_interval"),
            hard_timeout=cfg.seconds("hard_timeout"),
            heartbeat_timeout=cfg.seconds("heartbeat_timeout"),
            termination_grace_time=cfg.seconds("termination_grace_time"),
            logfile=cfg.monitor_process_logfile,
            pidfile=cfg.monitor_process_pidfile,
            heartbeat_interval=cfg.seconds(beat or "monitor_process_interval"),
            host_port=host_port,
            incarnation=incarnation,
        )


class MonitorProcess:
    """Owner of the forked monitor process of this rank."""

    def __init__(
        self,
        settings: MonitorSettings,
        shared: SharedProgress,
        store_factory: Callable[[], TorchStore],
    ) -> None:
        self.settings = settings
        self.shared = shared
        self.store_factory = store_factory
        self.pid: int | None = None

    def start(self) -> None:
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # pragma: no cover  (runs in the child)
            code = 0
            try:
                code = _child_main(parent, self.settings, self.shared, self.store_factory)
            except BaseException:
                with contextlib.suppress(BaseException):
                    log.exception("monitor process of rank %s failed", self.settings.initial_rank)
                code = 1
            finally:
                os._exit(code)
        self.pid = pid
        if self.settings.pidfile is not None:
            path = self.settings.pidfile.format(rank=self.settings.initial_rank)
            try:
                with open(path, "w") as f:
                    f.write(f"{pid}\n")
            except OSError as exc:
                log.warning("cannot write the monitor process pid to %s: %s", path, exc)

    def alive(self) -> bool:
        if self.pid is None:
            return False
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.pid = None
            return False
        if pid == self.pid:
            self.pid = None
            return False
        return True

    def shutdown(self, timeout: float) -> None:
        """Ask the process to exit and reap it; SIGTERM then SIGKILL if it does not.

        A process hosting the store keeps serving until every rank has left, so the
        wait here may last until the other ranks are done (bounded by ``timeout``).
        """
        self.shared.stop = 1
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.pid is not None and self.alive():
            terminate(
                self.pid,
                lambda: not self.alive(),
                grace=self.settings.termination_grace_time,
                what="monitor process (did not exit)",
            )


class _Parent:
    """The rank's process, seen from its monitor process (its parent): through a pidfd,
    which becomes readable when it ends, where the kernel has them."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.pidfd = None
        self.gone = False
        """Set by the loop once it saw the process end."""

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds``; return at once when the process ends (until it is gone)."""
        if self.pidfd is not None and not self.gone:
            select.select([self.pidfd], [], [], seconds)
        else:
            time.sleep(seconds)

    def dead(self) -> bool:
        """Whether the process has ended."""
        if self.pidfd is not None:
            ready, _, _ = select.select([self.pidfd], [], [], 0)
            return bool(ready)
        return os.getppid() != self.pid


def _child_main(
    parent: int,
    settings: MonitorSettings,
    shared: SharedProgress,
    store_factory: Callable[[], TorchStore],
) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(WAKE_SIGNAL, signal.SIG_IGN)
    if settings.logfile is not None:
        handler = logging.FileHandler(settings.logfile.format(rank=settings.initial_rank))
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(message)s"))
        root = logging.getLogger()
        root.handlers = [handler]
        root.setLevel(logging.DEBUG)
    log.info(
        "monitor_process pid=%s target_pid=%s rank=%s world_size=%s",
        os.getpid(), parent, settings.initial_rank, settings.initial_world_size,
    )  # fmt: skip
    watched = _Parent(parent)
    if os.getppid() != parent:
        return 0
    server = None if settings.host_port is None else _host_store(settings.host_port)
    coord = CoordinationStore(store_factory(), settings.namespace)
    if settings.incarnation:
        coord.incarnations[settings.initial_rank] = settings.incarnation
    return _Loop(watched, settings, shared, coord, server).run()


def _host_store(port: int) -> Any:
    """Serve the coordination store on ``port`` (a torch TCPStore server)."""
    import datetime

    from torch._C._distributed_c10d import TCPStore

    timeout = datetime.timedelta(seconds=60)
    return TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timeout)


@dataclass(eq=False)
class _Loop:
    """The monitor process's loop (see the module's docstring)."""

    parent: _Parent
    s: MonitorSettings
    shared: SharedProgress
    coord: CoordinationStore
    server: Any | None
    """The coordination store this process serves (standalone rank 0), or None: it
    keeps serving until every rank has left."""
    bad_read: bool = False
    """The last read of the progress record held an impossible time (logged once)."""
    last_beat: float = -1e9
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Per watched rank: its last heartbeat count, and when it was seen to change."""

    def __post_init__(self) -> None:
        self._watch(self.s.initial_rank, time.monotonic(), _FIRST, 0.0)

    def _watch(self, rank: int, now: float, first: int, credit: float) -> None:
        """Watch the ranks that ``rank`` watches (this one's own at the start; a rank's
        that stopped, so that a dead run longer than the live run before it is still
        found), as unchanged since ``credit`` seconds ago once read (``first``)."""
        for r in watched(rank, self.s.initial_world_size):
            if r != self.s.initial_rank and r not in self.seen:
                self.seen[r] = (first, now - credit)

    def run(self) -> int:
        while True:
            self.parent.wait(self.s.interval)
            if not self.parent.gone and self.parent.dead():
                self.parent.gone = True
                self._record_death()
            if self.parent.gone or self.shared.stop:
                if self.server is None or self._everyone_left():
                    return 0
                self._check_others()
                continue
            if time.monotonic() - self.last_beat >= self.s.heartbeat_interval:
                self.coord.heartbeat(self.s.initial_rank)
                self.last_beat = time.monotonic()
            self._check_progress()
            if self.shared.started:  # (a rank that comes late to the initial barrier is
                self._check_others()  # not missing: the barrier waits for it)

    def _record_death(self) -> None:
        """The rank's process ended: record it dead, unless it left normally."""
        if self.shared.stop:
            return
        kind = Interruption.HARD_TIMEOUT if self.shared.killed else Interruption.TERMINATED
        rank = self.s.initial_rank
        log.warning("rank %s died (%s)", rank, kind.name)
        self.coord.record_dead(
            int(self.shared.iteration), rank, kind, f"process {self.parent.pid} ended"
        )

    def _everyone_left(self) -> bool:
        everyone = set(range(self.s.initial_world_size))
        return everyone <= self.coord.exited_ranks() | self.coord.dead_ranks()

    def _check_progress(self) -> None:
        if not self.shared.armed or self.shared.killed:
            return
        now = time.monotonic()
        idle = self.shared.idle(now)
        if idle is None:
            if not self.bad_read:  # once per run of bad reads
                log.warning(
                    "rank %s: its progress record holds an impossible time (automatic "
                    "%r, manual %r, made at %.3f, now %.3f): not a hang, read again",
                    self.s.initial_rank, self.shared.auto_ts, self.shared.ping_ts,
                    self.shared.created, now,
                )  # fmt: skip
            self.bad_read = True
            return
        self.bad_read = False
        if idle <= self.s.hard_timeout:
            return
        log.warning(
            "rank %s: hard timeout (%.1f s without progress): killing", self.s.initial_rank, idle
        )
        self.shared.killed = 1
        terminate(
            self.parent.pid,
            self.parent.dead,
            grace=self.s.termination_grace_time,
            what=f"rank {self.s.initial_rank}",
        )

    def _check_others(self) -> None:
        now = time.monotonic()
        beats = self.coord.heartbeats(self.seen)
        gone: set[int] | None = None
        for r, value in beats.items():
            last, when = self.seen[r]
            if last == _INHERITED:
                self.seen[r] = (value, when)
                continue
            if value != last:
                self.seen[r] = (value, now)
                continue
            if now - when <= self.s.heartbeat_timeout:
                continue
            if gone is None:
                # A replacement of a rank is judged by its own incarnation.
                self.coord.incarnations.update(self.coord.join_requests())
                gone = self.coord.exited_ranks() | self.coord.dead_ranks()
            self.seen[r] = (value, float("inf"))  # (until it beats again: a replacement)
            # (its watch, credited all but the time a live rank's next beat takes to be
            # read: a dead one is found with it, not a heartbeat timeout later, and a
            # second restart with it)
            beat = 2 * self.s.heartbeat_interval + self.s.interval
            self._watch(r, now, _INHERITED, max(0.0, self.s.heartbeat_timeout - beat))
            if r in gone:
                continue
            log.warning("rank %s: no heartbeat for %.1f s: declared missing", r, now - when)
            self.coord.record_dead(
                int(self.shared.iteration), r, Interruption.UNRESPONSIVE, "no heartbeat"
            )


_FIRST = -1
"""A watched rank's count before its first read (any count read is a change)."""
_INHERITED = -2
"""An inherited rank's before its first read (the count read is taken as unchanged)."""


def watched(rank: int, world: int) -> list[int]:
    """The ranks whose heartbeats the monitor process of initial rank ``rank`` reads:
    those 1, 2, 4, 8, ... places after it in the ring of ``world`` initial ranks.

    Each rank is read by about log2(``world``) others, and a run of dead ranks (a lost
    node's) is still read by live ones as long as the run of ranks before it lives, so
    one heartbeat timeout finds them all; a rank that stops passes its own watch on to
    its watchers (:meth:`_Loop._watch`), which covers any longer run a moment later. Every monitor
    process reading every rank (as before 2026-12-01) cost the store ``world`` squared
    key reads an interval (four a second): 4 million a second at 1,024 ranks.
    """
    out: list[int] = []
    step = 1
    while step < world:
        out.append((rank + step) % world)
        step *= 2
    return out
