"""The agent's decisions, pure: what was observed goes in, the next action comes out.

Nothing here reads a file, a clock or a process: the loop (``_agent.py``) observes
(``_watch.observe``), calls :func:`decide` and acts; after a group failure it records
the failure in the rendezvous and asks :func:`after_failure` whether the job's restart
budget allows another attempt. ``agent/README.md`` follows one failure through it.

The actions, in the order :func:`decide` considers them:

- :class:`Stop`: a signal asked the agent to stop (workers that all died of such a
  signal wait :data:`STOP_GRACE` for the agent's own before their failure counts:
  :func:`signalled_to_stop`);
- :class:`RestartGroup` without ``failed``, when the others dropped this node (its own
  group rank is vacant: they took it for lost, say its agent stalled past the dead-node
  delay, and went on without its ranks): it joins again, as its own replacement or a
  spare's place, and what its workers did meanwhile is no failure;
- :class:`RestartGroup` with ``failed``: a worker failed (or hung) -- the group restarts;
- :class:`DropRanks`: in-process workers died while in-process peers of theirs run on:
  the peers restart in their own processes; the dead ones are replaced by new
  processes that join the peers (``respawn``, while the rank's replacements are
  within the restart budget) or the group goes on without them;
- :class:`ExitBarrier`: every worker is done (exited, or its script returned) and at
  least one succeeded; a worker whose script returned is a success whatever its
  interpreter's teardown does (an abort, a signal, a non-zero status), and one still
  tearing down after the policy's ``teardown_grace`` (counted from the node's last
  return) is killed, a success still;
- :class:`NodeLost`: another node of the round was lost and its rank left vacant (every
  node's workers restart in-process): tell this node's workers that its ranks are dead,
  so they go on without them at once and take its replacement in when it comes;
- :class:`MarkInprocess`: every worker here runs under ``relaunch.inprocess`` and may
  be replaced: say so in the rendezvous (a lost node then leaves a vacancy);
- :class:`RestartGroup` without ``failed``: nodes wait to join -- a new round admits them;
- :class:`Monitor`: nothing to do but watch (and start the fork server when it is time).
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "STOP_GRACE",
    "Action",
    "DropRanks",
    "ExitBarrier",
    "GiveUp",
    "Hang",
    "MarkInprocess",
    "Monitor",
    "NodeLost",
    "Observation",
    "Policy",
    "RankView",
    "RestartGroup",
    "Stop",
    "after_failure",
    "decide",
    "oldest_hung",
    "remaining_restarts",
    "signalled_to_stop",
    "wants_fork_server",
]


@dataclass(frozen=True, kw_only=True)
class RankView:
    """What one poll saw of one local rank's worker."""

    local_rank: int
    exitcode: int | None
    """Its exit code (or the code its runner announced before tearing down); None while
    it runs."""
    inprocess: bool = False
    """It runs under ``relaunch.inprocess`` (it wrote the in-process marker)."""
    progress: float | None = None
    """Wall-clock time its main thread last ran Python code; None when not watched."""
    stopped: bool = False
    """Its process is stopped (SIGSTOP, SIGTSTP) or traced, as seen when hangs are
    watched: it makes no progress, whatever its last progress time."""
    lost: bool = False
    """Dropped earlier in this attempt: it died and its in-process peers went on."""
    respawns: int = 0
    """Replacement processes this local rank had in this attempt."""
    returned: float | None = None
    """Wall-clock time its script returned (or exited 0), as its runner announced
    before the interpreter tore down; None when it did not. Such a worker succeeded,
    whatever ``exitcode`` its teardown ends with."""


@dataclass(frozen=True, kw_only=True)
class Observation:
    """One poll of the node: the workers, the time, a stop request, nodes waiting."""

    ranks: Sequence[RankView]
    now: float
    """Wall-clock time of the poll (progress times are wall-clock)."""
    stop_signal: int | None = None
    nodes_waiting: int = 0
    round_finishing: bool = False
    """A node of this round already finished (its workers succeeded) while the round
    goes on: the round takes no new node in (its finished workers would run again)."""
    vacancies: Mapping[int, int] = field(default_factory=dict)
    """Group ranks of the round that lost nodes left, with their replacements'
    incarnation (tiered recovery)."""
    declared: frozenset[tuple[int, int]] = frozenset()
    """The vacancies (group rank, incarnation) this node already acted on."""
    marked_inprocess: bool = False
    """This node already told the rendezvous that its workers restart in-process."""
    dropped: bool = False
    """This node's own group rank is vacant: the other nodes took it for lost and went
    on without its ranks (tiered recovery)."""


@dataclass(frozen=True, kw_only=True)
class Policy:
    """The parts of the WorkerSpec that decisions depend on."""

    hang_timeout: float | None = None
    max_restarts: int = 0
    fork_server: bool = True
    """The user wants replacement workers forked (``--no-warm-standby`` turns it off)."""
    membership_restarts: bool = False
    """The workers may restart without a failure: the job's membership can change (a
    dynamic rendezvous of more than one node: a node joins, leaves or is lost), and
    such a restart spends none of ``max_restarts``."""
    max_respawns: int = 0
    """Replacement processes allowed per local rank and attempt for in-process workers
    (the agent uses ``max_restarts``); 0: the group goes on without a dead rank."""
    teardown_grace: float = 30.0
    """Seconds a worker whose script returned may spend tearing down its interpreter
    once every worker of the node is done, counted from the node's last return; then
    it is killed and counted as succeeded all the same (the agent uses
    ``--shutdown-timeout``: the time a worker gets to end when the agent stops it)."""


@dataclass(frozen=True)
class Monitor:
    """Keep watching."""


@dataclass(frozen=True)
class Stop:
    """A signal asked the agent to stop: stop the workers with it, end the run."""

    signal: int


@dataclass(frozen=True)
class Hang:
    """A worker that made no progress for the hang timeout."""

    local_rank: int
    since: float
    """When its main thread last ran Python code (wall clock)."""


@dataclass(frozen=True)
class RestartGroup:
    """Stop every worker of the node and go to the next rendezvous round.

    ``failed`` names the local ranks whose failure caused it (the lost ones included,
    for the report); empty for a membership change.
    """

    failed: tuple[int, ...] = ()
    hang: Hang | None = None
    reason: Literal["failure", "membership"] = "failure"


@dataclass(frozen=True)
class DropRanks:
    """These in-process workers died; their peers restart in-process. Those in
    ``respawn`` get a replacement process that joins the peers' next iteration."""

    local_ranks: tuple[int, ...]
    respawn: tuple[int, ...] = ()


@dataclass(frozen=True)
class ExitBarrier:
    """The workers are done: wait for the other nodes, then end the run with success.

    ``kill`` names the local ranks whose script returned but whose interpreter is still
    tearing down after the teardown grace: they are killed first (and succeeded)."""

    kill: tuple[int, ...] = ()


@dataclass(frozen=True)
class GiveUp:
    """The job's restart budget is spent: stop, close the rendezvous, report."""

    restarts: int
    """Restarts the job used."""


@dataclass(frozen=True)
class NodeLost:
    """Nodes of the round were lost and their ranks wait for a replacement: record the
    deaths of their workers' ranks (below ``incarnation``) for this node's workers."""

    vacancies: Mapping[int, int]
    """Group rank -> the incarnation its replacement's workers will start at."""


@dataclass(frozen=True)
class MarkInprocess:
    """Tell the rendezvous that this node's workers restart in-process."""


Action = Monitor | Stop | RestartGroup | DropRanks | ExitBarrier | NodeLost | MarkInprocess


STOP_GRACE = 0.5
"""Seconds the loop waits for its own stop signal before a failure of workers that died
of one (:func:`signalled_to_stop`)."""

_STOP_CODES = frozenset(
    code for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM) for code in (-sig, 128 + sig)
)
"""A worker's exit by SIGHUP, SIGINT or SIGTERM: killed by it, or exiting 128+N from its
own handler."""


def signalled_to_stop(action: Action, obs: Observation) -> bool:
    """Whether ``action`` restarts the group for failures that are all deaths by a
    signal asking processes to stop, with no stop asked of the agent yet. A scheduler
    stopping the job (Slurm's ``scancel``, a preemption) signals every process of it, the
    agent among them: a worker's death could reach the agent's poll before its own
    signal did, and the job ended as failed, not stopped (seen once under Slurm). The
    loop waits :data:`STOP_GRACE` for that signal, then decides again."""
    if obs.stop_signal is not None or not isinstance(action, RestartGroup) or not action.failed:
        return False
    views = {v.local_rank: v for v in obs.ranks}
    return all(lr in views and views[lr].exitcode in _STOP_CODES for lr in action.failed)


def _failed(view: RankView) -> bool:
    """Exited non-zero (or announced it) before its script returned."""
    return (
        view.exitcode is not None and view.exitcode != 0 and not view.lost and view.returned is None
    )


def _done(view: RankView) -> bool:
    """Exited, or its script returned (its interpreter may still be tearing down)."""
    return view.exitcode is not None or view.returned is not None


def oldest_hung(progress: Mapping[int, float], now: float, timeout: float) -> int | None:
    """The local rank hung longest (no progress for ``timeout``), or None.

    Peers blocked in a collective with a hung rank stop progressing too, a little
    later: the rank that stopped first is the cause.
    """
    hung = {lr: t for lr, t in progress.items() if now - t >= timeout}
    return min(hung, key=lambda lr: (hung[lr], lr)) if hung else None


def _hang(obs: Observation, timeout: float) -> Hang | None:
    """The running, non-in-process worker hung longest past the timeout, if any.

    In-process workers are watched by their own wrapper (soft and hard timeouts); a
    worker whose script returned is past hanging (its teardown has a grace of its own)."""
    progress = {
        v.local_rank: v.progress
        for v in obs.ranks
        if not _done(v) and not v.inprocess and v.progress is not None
    }
    lr = oldest_hung(progress, obs.now, timeout)
    if lr is None:
        return None
    # a stopped process is the cause, though a peer that entered a collective with it
    # before it was stopped made its last progress earlier
    stopped = [v.local_rank for v in obs.ranks if v.stopped and v.local_rank in progress]
    if stopped:
        lr = min(stopped, key=lambda r: (progress[r], r))
    return Hang(local_rank=lr, since=progress[lr])


def decide(obs: Observation, policy: Policy) -> Action:
    """The next action after one poll (see the module docstring for the order)."""
    if obs.stop_signal is not None:
        return Stop(obs.stop_signal)
    if obs.dropped and not any(v.returned is not None or v.exitcode == 0 for v in obs.ranks):
        return RestartGroup(reason="membership")
    failed = [v for v in obs.ranks if _failed(v)]
    running_inprocess = {v.local_rank for v in obs.ranks if not _done(v) and v.inprocess}
    dropped = tuple(
        v.local_rank for v in failed if v.inprocess and running_inprocess - {v.local_rank}
    )
    group_failed = tuple(v.local_rank for v in failed if v.local_rank not in dropped)
    lost = tuple(v.local_rank for v in obs.ranks if v.lost)
    hang = _hang(obs, policy.hang_timeout) if policy.hang_timeout else None
    if group_failed or (hang is not None and not dropped):
        # A rank hung past the timeout is named with the failures: when another node's
        # agent found its own blocked ranks first and restarted, this node's ranks blocked
        # in collectives with the hung one fail; the hung one stopped first (the cause).
        named = {*group_failed, *lost, *((hang.local_rank,) if hang else ())}
        return RestartGroup(failed=tuple(sorted(named)), hang=hang)
    if dropped:
        views = {v.local_rank: v for v in obs.ranks}
        # Only a process that died (a signal: SIGKILL, SIGSEGV, an OOM kill, the hard
        # timeout) is replaced; one that exited with a status (the wrapper terminated
        # it, say for a failed health check) stays out.
        respawn = tuple(
            lr
            for lr in dropped
            if (views[lr].exitcode or 0) < 0 and views[lr].respawns < policy.max_respawns
        )
        return DropRanks(dropped, respawn)
    if obs.ranks and all(_done(v) for v in obs.ranks):
        if len(lost) == len(obs.ranks):
            return RestartGroup(failed=lost)  # every worker died, none is left to finish
        tearing_down = tuple(v.local_rank for v in obs.ranks if v.exitcode is None)
        if tearing_down and obs.now < _last_return(obs) + policy.teardown_grace:
            return Monitor()
        return ExitBarrier(kill=tearing_down)
    if (
        obs.nodes_waiting > 0
        and not obs.round_finishing
        and not any(v.returned is not None for v in obs.ranks)
    ):
        return RestartGroup(reason="membership")  # (never a worker that finished)
    fresh = {g: i for g, i in obs.vacancies.items() if (g, i) not in obs.declared}
    if fresh:
        return NodeLost(fresh)
    if (
        not obs.marked_inprocess
        and policy.max_respawns > 0
        and obs.ranks
        and all(v.inprocess and v.exitcode is None for v in obs.ranks)
    ):
        return MarkInprocess()
    return Monitor()


def _last_return(obs: Observation) -> float:
    return max((v.returned for v in obs.ranks if v.returned is not None), default=obs.now)


def after_failure(failures_recorded: int, max_restarts: int) -> RestartGroup | GiveUp:
    """Whether the job restarts after its ``failures_recorded``-th group failure.

    The count lives in the rendezvous state (shared by every node), so a job's budget
    is ``max_restarts`` whichever nodes fail."""
    if failures_recorded > max_restarts:
        return GiveUp(restarts=failures_recorded - 1)
    return RestartGroup()


def remaining_restarts(restart_count: int, max_restarts: int) -> int:
    """Restarts the job has left after ``restart_count`` of them."""
    return max(0, max_restarts - restart_count)


def wants_fork_server(policy: Policy, *, is_python: bool, restart_count: int) -> bool:
    """Whether a fork server is worth keeping: Python workers that may still restart,
    after a failure (restarts left) or when the job's membership changes."""
    may_restart = (
        policy.membership_restarts or remaining_restarts(restart_count, policy.max_restarts) > 0
    )
    return policy.fork_server and is_python and may_restart
