"""The agent's data model: what to run (WorkerSpec), what runs (Worker, WorkerGroup), outcomes."""

from __future__ import annotations

import contextlib
import enum
import os
import select
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from relaunch.agent._core import Policy
from relaunch.errors import ConfigError
from relaunch.procs import Entrypoint, Std
from relaunch.rendezvous import RendezvousHandler, RendezvousInfo, TieredMembership
from relaunch.store import Store

if TYPE_CHECKING:
    from relaunch.errors import ProcessFailure

__all__ = [
    "RoundHook",
    "RoundStart",
    "RunResult",
    "SnapshotFacts",
    "SnapshotSource",
    "StopRequest",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "policy_of",
]


@dataclass
class StopRequest:
    """A stop asked for (by a signal): the signal, and what wakes the agent's loop."""

    signum: int | None = None
    wake: threading.Event = field(default_factory=threading.Event)
    _pipe: tuple[int, int] | None = field(default=None, init=False, repr=False)

    def set(self, signum: int) -> None:
        """Safe in a signal handler: flags, and one byte into the armed pipe."""
        self.signum = signum
        self.wake.set()
        pipe = self._pipe
        if pipe is not None:
            with contextlib.suppress(OSError):  # full: a byte is there already
                os.write(pipe[1], b"\0")

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """For the block's length, :meth:`wait` also ends at a stop asked for while it
        polls (a pipe :meth:`set` writes to; closed after the block)."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        try:
            yield
        finally:
            self._pipe = None
            os.close(write)
            os.close(read)

    def wait(self, seconds: float, fds: Sequence[int] = ()) -> None:
        """Wait ``seconds``, less when a stop is asked for or one of ``fds`` becomes
        readable (a worker's exit). Armed, it polls the pipe (a signal handler that sets
        the event while this thread holds the event's lock in ``wait`` would deadlock)."""
        pipe = self._pipe
        if pipe is None or self.wake.is_set():
            self.wake.wait(seconds)
            return
        poller = select.poll()
        for fd in (pipe[0], *fds):
            poller.register(fd, select.POLLIN)
        poller.poll(seconds * 1000)


@dataclass(frozen=True, kw_only=True)
class RoundStart:
    """A round this node takes part in, just before its workers of the round start."""

    info: RendezvousInfo
    ranks: tuple[int, ...]
    """The global ranks this node's workers run in the round."""
    addr: str
    """This node's address as the round's other nodes reach it."""


class RoundHook(Protocol):
    """Something the composition root plugs into the agent's rounds (the snapshots' peer
    copies): called in the agent's thread before the round's workers start; it must not
    raise, and blocks their start for as long as it runs."""

    def round_started(self, start: RoundStart) -> None: ...


@dataclass(frozen=True, kw_only=True)
class SnapshotFacts:
    """What the node's snapshots say, for its status report."""

    newest: Mapping[int, int] = field(default_factory=dict)
    """Global rank -> step of its newest complete snapshot on this node."""
    restores: int = 0
    """Restores from snapshots this node's ranks took part in."""
    steps_redone: int = 0
    """Steps done before those faults that the job did again."""


class SnapshotSource(Protocol):
    """The node's snapshots as the status report shows them (read at most once a
    second, from the agent's thread; it must not raise)."""

    def snapshot_facts(self) -> SnapshotFacts: ...


class WorkerState(str, enum.Enum):
    """State of a worker group, as torchelastic defines it."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything the agent needs to run one role's workers on this node."""

    role: str = "default"
    """Role name (``ROLE_NAME``); prefixes tee'd output as ``[<role><rank>]:``."""
    local_world_size: int
    """Workers on this node (``--nproc-per-node``)."""
    entrypoint: Entrypoint
    args: tuple[object, ...] = ()
    """Arguments for every worker; ``${local_rank}`` is substituted in strings. For a
    function entrypoint, the function's arguments (JSON data)."""
    rdzv_handler: RendezvousHandler
    max_restarts: int = 0
    """Restarts of the worker group allowed after a failure (for the whole job)."""
    monitor_interval: float = 0.1
    """Seconds between two polls of the workers."""
    master_addr: str | None = None
    """Address workers reach the store at; default: this node's local_addr or host."""
    master_port: int | None = None
    """Port of the workers' store; default: a free port, new for every attempt."""
    local_addr: str | None = None
    redirects: Mapping[int, Std] = field(default_factory=dict)
    tee: Mapping[int, Std] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    log_line_prefix_template: str | None = None
    log_dir: str | None = None
    exit_barrier_timeout: float = 300.0
    warm_standby: bool = True
    """Fork replacement workers from a fork server that imported what the workers import."""
    standby_delay: float = 2.0
    """Seconds after workers start before the fork server starts (not to slow their start)."""
    hang_timeout: float | None = None
    """Seconds without Python code in a worker's main thread after which it is hung."""
    stop_grace: float = 30.0
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    watchdog: bool = False
    """Run the named-pipe timer server (``TORCHELASTIC_ENABLE_FILE_TIMER=1``)."""
    watchdog_file: str | None = None
    """Named pipe path for the timer server (``TORCHELASTIC_TIMER_FILE``); created if None."""
    base_env: Mapping[str, str] = field(default_factory=dict)
    """The environment workers inherit (the agent's, read by the CLI)."""
    round_hooks: tuple[RoundHook, ...] = ()
    """Called before each round's workers start (see RoundHook)."""
    snapshots: SnapshotSource | None = None
    """The node's snapshots, for the status report (None: none shown)."""

    def __post_init__(self) -> None:
        if self.local_world_size < 1:
            raise ConfigError(f"local_world_size: expected >= 1, got {self.local_world_size}")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts: expected >= 0, got {self.max_restarts}")
        if not self.monitor_interval > 0:
            raise ConfigError(f"monitor_interval: expected > 0, got {self.monitor_interval}")
        if self.exit_barrier_timeout < 0:
            raise ConfigError(
                f"exit_barrier_timeout: expected >= 0, got {self.exit_barrier_timeout}"
            )
        if self.stop_grace < 0:
            raise ConfigError(f"stop_grace: expected >= 0, got {self.stop_grace}")
        if self.hang_timeout is not None and not self.hang_timeout > 0:
            raise ConfigError(f"hang_timeout: expected > 0 or None, got {self.hang_timeout}")
        if self.standby_delay < 0:
            raise ConfigError(f"standby_delay: expected >= 0, got {self.standby_delay}")
        if self.master_port is not None and not 0 <= self.master_port <= 65535:
            raise ConfigError(f"master_port: expected 0..65535, got {self.master_port}")


@dataclass(kw_only=True)
class Worker:
    """One worker process slot on this node."""

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    id: int | None = None
    """The pid of the running process, None before it starts."""


def policy_of(spec: WorkerSpec) -> Policy:
    """The parts of ``spec`` that the agent's decisions depend on."""
    python = spec.entrypoint.is_python
    tiers = spec.rdzv_handler if isinstance(spec.rdzv_handler, TieredMembership) else None
    return Policy(
        hang_timeout=spec.hang_timeout if python else None,
        max_restarts=spec.max_restarts,
        fork_server=spec.warm_standby,
        membership_restarts=tiers is not None and tiers.max_nodes > 1,
        max_respawns=spec.max_restarts if python else 0,
        teardown_grace=spec.stop_grace,
    )


@dataclass(kw_only=True)
class WorkerGroup:
    """This node's workers of one role, for the current attempt."""

    spec: WorkerSpec
    workers: list[Worker]
    store: Store | None = None
    group_rank: int | None = None
    group_world_size: int | None = None
    state: WorkerState = WorkerState.INIT
    master_addr: str | None = None
    master_port: int | None = None

    def place(self, group_rank: int, group_world_size: int, store: Store) -> None:
        """Take this node's place in a round: its workers' global ranks follow the
        node's (``group_rank * local_world_size + local_rank``)."""
        self.group_rank, self.group_world_size, self.store = group_rank, group_world_size, store
        n = len(self.workers)
        for worker in self.workers:
            worker.global_rank = worker.role_rank = group_rank * n + worker.local_rank
            worker.world_size = worker.role_world_size = n * group_world_size


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """How the run ended: state, return values (function entrypoints), failures by global rank."""

    state: WorkerState
    return_values: Mapping[int, object] = field(default_factory=dict)
    failures: Mapping[int, ProcessFailure] = field(default_factory=dict)
    reason: str | None = None
    """Why the run ended when no worker's failure says it all (the store was lost, the
    exit barrier timed out): one line for the user."""

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED
