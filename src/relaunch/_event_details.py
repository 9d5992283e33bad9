"""The details of the agent's events: one frozen dataclass per state change (what
happened), the closed union :data:`Detail` and :data:`Emit`. The envelope (where and
when) and the JSON lines are :mod:`relaunch.events`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

__all__ = [
    "Cause",
    "Detail",
    "Emit",
    "ExitBarrierTimeout",
    "FinishedWithout",
    "ForkServerReady",
    "ForkServerRefused",
    "ForkServerStarted",
    "MembershipChanged",
    "NodeLost",
    "NodeReplaced",
    "NotNeeded",
    "RendezvousClosed",
    "RendezvousComplete",
    "Restart",
    "RoundReopened",
    "RoundWentOn",
    "RunFailed",
    "Stopped",
    "StoreLost",
    "WatchdogExpired",
    "WorkerHung",
    "WorkerLost",
    "WorkerRespawned",
    "WorkersFailed",
    "WorkersStarted",
    "WorkersStopped",
    "WorkersSucceeded",
]


@dataclass(frozen=True, kw_only=True)
class _Detail:
    """What happened. ``name`` is the event's name in ``events.jsonl``; the fields are
    its metadata (an optional field, one whose default is None, is left out while None)."""

    name: ClassVar[str]

    def metadata(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            out[f.name] = _plain(value)
        return out


def _plain(value: object) -> object:
    """``value`` with the dataclasses inside it made dicts (for JSON)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- the round ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RendezvousComplete(_Detail):
    """This node is in a round: its number, the nodes in it, how long it took; a node
    that takes a lost node's place says whose (``replaces``) and the loss's incarnation."""

    name: ClassVar[str] = "rendezvous_complete"
    round: int
    world_size: int
    seconds: float
    replaces: int | None = None
    incarnation: int | None = None


@dataclass(frozen=True, kw_only=True)
class MembershipChanged(_Detail):
    """A new round is starting (a node joined, left, or restarts): restart the workers."""

    name: ClassVar[str] = "membership_changed"


@dataclass(frozen=True, kw_only=True)
class RoundWentOn(_Detail):
    """This node's workers failed after the job had gone on from their round: another
    node began the next one (a node joined, left or was lost, their peers stopped for
    it), or the job dropped this node (silent past the dead-node delay: a stalled
    machine, its workers' peers gone when it came back). Their failure follows from
    that: no restart is counted, and the node joins the next round."""

    name: ClassVar[str] = "round_went_on"
    round: int


@dataclass(frozen=True, kw_only=True)
class RendezvousClosed(_Detail):
    """Another node closed the job (after its failure)."""

    name: ClassVar[str] = "rendezvous_closed"


@dataclass(frozen=True, kw_only=True)
class RoundReopened(_Detail):
    """This node's workers had succeeded, but another node left the round before every
    node finished (to restart it after a failure, or lost): the job goes on, and this
    node runs its workers again in the next round."""

    name: ClassVar[str] = "round_reopened"


@dataclass(frozen=True, kw_only=True)
class FinishedWithout(_Detail):
    """The job finished while this node waited to rejoin it (another node had taken
    its place): nothing was left for its workers."""

    name: ClassVar[str] = "finished_without"


@dataclass(frozen=True, kw_only=True)
class NotNeeded(_Detail):
    """The job finished before this spare node ever ran workers."""

    name: ClassVar[str] = "not_needed"


@dataclass(frozen=True, kw_only=True)
class StoreLost(_Detail):
    """The rendezvous store stopped answering (or its state is corrupt): the run ends."""

    name: ClassVar[str] = "store_lost"
    reason: str


@dataclass(frozen=True, kw_only=True)
class ExitBarrierTimeout(_Detail):
    """This node's workers succeeded but the round's other nodes did not all arrive."""

    name: ClassVar[str] = "exit_barrier_timeout"
    world_size: int


@dataclass(frozen=True, kw_only=True)
class NodeLost(_Detail):
    """A node of the running in-process round was lost; its ranks ``ranks[0]..ranks[1]``
    are vacant (tier: node)."""

    name: ClassVar[str] = "node_lost"
    group_rank: int
    ranks: tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class NodeReplaced(_Detail):
    """A spare or a new node took a lost node's place (``seen_lost``: this node saw the
    loss first; ``lost_at``: when it was lost, Unix time)."""

    name: ClassVar[str] = "node_replaced"
    group_rank: int
    lost_at: float
    seen_lost: bool


# -- the workers -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class WorkersStarted(_Detail):
    """This node's workers of one attempt run (``forked``: the local ranks started from
    the fork server)."""

    name: ClassVar[str] = "workers_started"
    attempt: int
    pids: Mapping[int, int]
    forked: tuple[int, ...]
    seconds: float
    master_addr: str | None
    master_port: int | None


@dataclass(frozen=True, kw_only=True)
class WorkersStopped(_Detail):
    """This node's workers of one attempt were stopped (their exit codes by local rank)."""

    name: ClassVar[str] = "workers_stopped"
    attempt: int
    exitcodes: Mapping[int, int | None]


@dataclass(frozen=True, kw_only=True)
class WorkersSucceeded(_Detail):
    """Every worker of this node succeeded (``after_return``: by rank, what an interpreter
    did after its script returned that did not count as a failure)."""

    name: ClassVar[str] = "workers_succeeded"
    attempt: int
    after_return: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Cause:
    """One failed worker, as ``workers_failed`` tells it."""

    local_rank: int
    pid: int
    exitcode: int
    message: str
    time: float


@dataclass(frozen=True, kw_only=True)
class WorkersFailed(_Detail):
    """Workers of this node failed: their exit codes and causes by global rank."""

    name: ClassVar[str] = "workers_failed"
    attempt: int
    failures: Mapping[int, int]
    causes: Mapping[int, Cause]


@dataclass(frozen=True, kw_only=True)
class WorkerHung(_Detail):
    """A worker made no progress for the hang timeout (its stacks were collected)."""

    name: ClassVar[str] = "worker_hung"
    local_rank: int
    pid: int | None
    reason: str
    stacks: str


@dataclass(frozen=True, kw_only=True)
class WorkerLost(_Detail):
    """An in-process worker died; its peers keep running (tier: process)."""

    name: ClassVar[str] = "worker_lost"
    rank: int | None
    local_rank: int
    exitcode: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class WorkerRespawned(_Detail):
    """A lost in-process worker was replaced in place."""

    name: ClassVar[str] = "worker_respawned"
    attempt: int
    local_rank: int
    pid: int
    incarnation: int
    replacement: int
    forked: bool
    seconds: float


@dataclass(frozen=True, kw_only=True)
class WatchdogExpired(_Detail):
    """A worker's watchdog timer (``relaunch.timer``) expired: it was sent ``signal``."""

    name: ClassVar[str] = "watchdog_expired"
    pid: int
    scope: str
    signal: int


# -- the budget and the end --------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Restart(_Detail):
    """The workers restart after a failure (the job's restarts used so far)."""

    name: ClassVar[str] = "restart"
    restarts: int
    max_restarts: int


@dataclass(frozen=True, kw_only=True)
class RunFailed(_Detail):
    """No restarts left: the job fails."""

    name: ClassVar[str] = "run_failed"
    attempt: int
    restarts: int


@dataclass(frozen=True, kw_only=True)
class Stopped(_Detail):
    """The agent was told to stop (``signal``: the one it received)."""

    name: ClassVar[str] = "stopped"
    signal: int


# -- the fork server ---------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ForkServerStarted(_Detail):
    """The fork server was started (``prewarm``: on a spare, before any worker ran)."""

    name: ClassVar[str] = "fork_server_started"
    pid: int | None
    prewarm: bool | None = None


@dataclass(frozen=True, kw_only=True)
class ForkServerReady(_Detail):
    """The fork server imported what the workers import: forks are fast from now on."""

    name: ClassVar[str] = "fork_server_ready"
    pid: int | None


@dataclass(frozen=True, kw_only=True)
class ForkServerRefused(_Detail):
    """The fork server cannot be used (the workers start as fresh interpreters)."""

    name: ClassVar[str] = "fork_server_refused"
    reason: str


Detail = (
    RendezvousComplete | MembershipChanged | RoundReopened | RoundWentOn | RendezvousClosed
    | NotNeeded | FinishedWithout | StoreLost
    | ExitBarrierTimeout | NodeLost | NodeReplaced | WorkersStarted | WorkersStopped
    | WorkersSucceeded | WorkersFailed | WorkerHung | WorkerLost | WorkerRespawned
    | WatchdogExpired | Restart | RunFailed | Stopped | ForkServerStarted | ForkServerReady
    | ForkServerRefused
)  # fmt: skip
"""Every event the agent emits."""

Emit = Callable[[Detail], None]
"""How the agent's parts report an event (the agent adds where and when)."""
