"""The agent's decision core, driven through every action with a fake clock (no
sleeps, no processes); and the loop's bookkeeping of lost ranks around it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from relaunch._contract import AttemptFiles
from relaunch.agent import Worker
from relaunch.agent._attempt import Slot
from relaunch.agent._core import (
    DropRanks,
    ExitBarrier,
    GiveUp,
    Hang,
    MarkInprocess,
    Monitor,
    NodeLost,
    Observation,
    Policy,
    RankView,
    RestartGroup,
    Stop,
    after_failure,
    decide,
    remaining_restarts,
    signalled_to_stop,
    wants_fork_server,
)
from relaunch.agent._watch import after_return, failures, observe
from relaunch.procs import is_stopped

T0 = 1_000_000.0
POLICY = Policy(max_restarts=3)


def running(n: int, **kw: object) -> list[RankView]:
    return [RankView(local_rank=i, exitcode=None, **kw) for i in range(n)]  # type: ignore[arg-type]


def obs(ranks: list[RankView], now: float = T0, **kw: object) -> Observation:
    return Observation(ranks=ranks, now=now, **kw)  # type: ignore[arg-type]


def with_rank(ranks: list[RankView], view: RankView) -> list[RankView]:
    return [view if r.local_rank == view.local_rank else r for r in ranks]


# -- monitor, stop, success ------------------------------------------------------------
def test_running_workers_are_monitored() -> None:
    assert decide(obs(running(4)), POLICY) == Monitor()


@pytest.mark.parametrize(
    ("codes", "held"),
    [
        ((-15,), True),  # killed by SIGTERM, as a scheduler signals every process of a job
        ((143, -2), True),  # exited 128+SIGTERM from its own handler; SIGINT
        ((129,), True),  # 128+SIGHUP
        ((-15, 1), False),  # one failed otherwise: a failure, at once
        ((-9,), False),  # SIGKILL: no scheduler's stop
        ((1,), False),
    ],
)
def test_a_failure_by_a_stop_signal_waits_a_moment_for_the_agent_s_own(
    codes: tuple[int, ...], held: bool
) -> None:
    """Slurm's scancel signals the agent and its workers: a worker's death may reach
    the agent's poll first. Such a failure waits for the agent's own signal (whose Stop
    then wins, as it always does) before it restarts the group."""
    ranks = running(3)
    for lr, code in enumerate(codes):
        ranks = with_rank(ranks, RankView(local_rank=lr, exitcode=code))
    seen = obs(ranks)
    action = decide(seen, POLICY)
    assert isinstance(action, RestartGroup) and action.failed
    assert signalled_to_stop(action, seen) is held
    stopped = obs(ranks, stop_signal=signal.SIGTERM)
    assert not signalled_to_stop(action, stopped)
    assert decide(stopped, POLICY) == Stop(signal.SIGTERM)
    assert not signalled_to_stop(RestartGroup(reason="membership"), seen)


def test_a_stop_signal_wins_over_everything() -> None:
    ranks = with_rank(running(2), RankView(local_rank=0, exitcode=1))
    assert decide(obs(ranks, stop_signal=signal.SIGTERM), POLICY) == Stop(signal.SIGTERM)


def test_all_exited_zero_is_the_exit_barrier() -> None:
    ranks = [RankView(local_rank=i, exitcode=0) for i in range(3)]
    assert decide(obs(ranks), POLICY) == ExitBarrier()


def test_some_exited_zero_others_running_is_monitored() -> None:
    ranks = with_rank(running(3), RankView(local_rank=1, exitcode=0))
    assert decide(obs(ranks), POLICY) == Monitor()


# -- failures --------------------------------------------------------------------------
def test_a_failed_worker_restarts_the_group() -> None:
    ranks = with_rank(running(4), RankView(local_rank=2, exitcode=-signal.SIGKILL))
    assert decide(obs(ranks), POLICY) == RestartGroup(failed=(2,))


def test_several_failures_are_reported_together() -> None:
    ranks = [
        RankView(local_rank=0, exitcode=1),
        RankView(local_rank=1, exitcode=None),
        RankView(local_rank=2, exitcode=-signal.SIGSEGV),
    ]
    assert decide(obs(ranks), POLICY) == RestartGroup(failed=(0, 2))


def test_a_failure_beats_waiting_nodes() -> None:
    ranks = with_rank(running(2), RankView(local_rank=0, exitcode=1))
    assert decide(obs(ranks, nodes_waiting=2), POLICY) == RestartGroup(failed=(0,))


def test_waiting_nodes_restart_a_healthy_group_for_membership() -> None:
    assert decide(obs(running(2), nodes_waiting=1), POLICY) == RestartGroup(reason="membership")


# -- in-process workers ----------------------------------------------------------------
def test_a_dead_inprocess_worker_with_running_inprocess_peers_is_dropped() -> None:
    ranks = with_rank(
        running(3, inprocess=True), RankView(local_rank=1, exitcode=-9, inprocess=True)
    )
    assert decide(obs(ranks), POLICY) == DropRanks((1,))


def test_a_dropped_worker_is_not_dropped_again() -> None:
    ranks = with_rank(
        running(3, inprocess=True),
        RankView(local_rank=1, exitcode=-9, inprocess=True, lost=True),
    )
    assert decide(obs(ranks), POLICY) == Monitor()


def test_the_last_inprocess_worker_dying_is_a_group_failure() -> None:
    ranks = [RankView(local_rank=0, exitcode=-9, inprocess=True)]
    assert decide(obs(ranks), POLICY) == RestartGroup(failed=(0,))


def test_a_dead_inprocess_worker_without_inprocess_peers_fails_the_group() -> None:
    ranks = [
        RankView(local_rank=0, exitcode=-9, inprocess=True),
        RankView(local_rank=1, exitcode=None, inprocess=False),
    ]
    assert decide(obs(ranks), POLICY) == RestartGroup(failed=(0,))


def test_a_group_failure_reports_the_lost_workers_too() -> None:
    ranks = [
        RankView(local_rank=0, exitcode=-9, inprocess=True, lost=True),
        RankView(local_rank=1, exitcode=1, inprocess=False),
        RankView(local_rank=2, exitcode=None, inprocess=True),
    ]
    assert decide(obs(ranks), POLICY) == RestartGroup(failed=(0, 1))


def test_lost_workers_and_the_rest_succeeding_is_success() -> None:
    ranks = [
        RankView(local_rank=0, exitcode=-9, inprocess=True, lost=True),
        RankView(local_rank=1, exitcode=0, inprocess=True),
    ]
    assert decide(obs(ranks), POLICY) == ExitBarrier()


def test_every_worker_lost_is_a_group_failure() -> None:
    ranks = [RankView(local_rank=i, exitcode=-9, inprocess=True, lost=True) for i in range(2)]
    assert decide(obs(ranks), POLICY) == RestartGroup(failed=(0, 1))


# -- hangs -----------------------------------------------------------------------------
HANGS = Policy(hang_timeout=5.0, max_restarts=3)


def test_no_hang_before_the_timeout() -> None:
    ranks = [RankView(local_rank=i, exitcode=None, progress=T0 - 4.9) for i in range(2)]
    assert decide(obs(ranks), HANGS) == Monitor()


def test_the_worker_that_stopped_first_is_the_hung_one() -> None:
    ranks = [
        RankView(local_rank=0, exitcode=None, progress=T0 - 6.0),
        RankView(local_rank=1, exitcode=None, progress=T0 - 7.0),
        RankView(local_rank=2, exitcode=None, progress=T0 - 0.1),
    ]
    assert decide(obs(ranks), HANGS) == RestartGroup(failed=(1,), hang=Hang(1, T0 - 7.0))


def test_a_stopped_worker_is_the_hung_one_though_a_peer_stalled_first() -> None:
    # rank 0 entered an all-reduce with rank 1, then rank 1 was SIGSTOPped mid-step:
    # rank 0 made its last progress first, but the stopped process is the cause
    ranks = [
        RankView(local_rank=0, exitcode=None, progress=T0 - 6.0),
        RankView(local_rank=1, exitcode=None, progress=T0 - 3.0, stopped=True),
    ]
    assert decide(obs(ranks), HANGS) == RestartGroup(failed=(1,), hang=Hang(1, T0 - 3.0))
    # stopped alone is no hang: nothing is past the timeout yet
    ranks[0] = RankView(local_rank=0, exitcode=None, progress=T0 - 1.0)
    assert decide(obs(ranks), HANGS) == Monitor()


def test_the_clock_decides_when_a_worker_is_hung() -> None:
    ranks = [RankView(local_rank=0, exitcode=None, progress=T0)]
    assert decide(obs(ranks, now=T0 + 4.99), HANGS) == Monitor()
    assert decide(obs(ranks, now=T0 + 5.0), HANGS) == RestartGroup(failed=(0,), hang=Hang(0, T0))


def test_hangs_are_not_watched_without_a_timeout() -> None:
    ranks = [RankView(local_rank=0, exitcode=None, progress=T0 - 1e6)]
    assert decide(obs(ranks), POLICY) == Monitor()


def test_inprocess_and_unwatched_workers_are_never_hung() -> None:
    ranks = [
        RankView(local_rank=0, exitcode=None, progress=T0 - 100, inprocess=True),
        RankView(local_rank=1, exitcode=None, progress=None),
    ]
    assert decide(obs(ranks), HANGS) == Monitor()


def test_a_failure_is_reported_before_a_hang_not_yet_past_the_timeout() -> None:
    ranks = [
        RankView(local_rank=0, exitcode=None, progress=T0 - 4.0),
        RankView(local_rank=1, exitcode=3),
    ]
    assert decide(obs(ranks), HANGS) == RestartGroup(failed=(1,))


def test_a_failure_names_a_rank_hung_past_the_timeout_too() -> None:
    # Another node restarted first for its own blocked ranks: ours blocked in collectives
    # with the hung one fail; the hung one stopped first, so it is named (the cause).
    ranks = [
        RankView(local_rank=0, exitcode=1),
        RankView(local_rank=1, exitcode=None, progress=T0 - 6.0),
        RankView(local_rank=2, exitcode=None, progress=T0 - 5.5),
    ]
    assert decide(obs(ranks), HANGS) == RestartGroup(failed=(0, 1), hang=Hang(1, T0 - 6.0))


# -- a worker whose script returned is done ------------------------------------------------
TEARDOWN = Policy(max_restarts=3, hang_timeout=5.0, teardown_grace=30.0)


def returned(lr: int, exitcode: int | None, at: float = T0, **kw: object) -> RankView:
    return RankView(local_rank=lr, exitcode=exitcode, returned=at, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("code", [-signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV, 7])
def test_a_death_after_the_script_returned_is_a_success(code: int) -> None:
    ranks = [returned(0, 0), returned(1, code)]
    assert decide(obs(ranks), TEARDOWN) == ExitBarrier()


def test_a_death_after_return_while_others_run_is_no_failure() -> None:
    ranks = with_rank(running(3), returned(1, -signal.SIGABRT))
    assert decide(obs(ranks), TEARDOWN) == Monitor()


def test_a_death_before_return_still_fails_the_group() -> None:
    ranks = [returned(0, -signal.SIGABRT), RankView(local_rank=1, exitcode=-signal.SIGABRT)]
    assert decide(obs(ranks), TEARDOWN) == RestartGroup(failed=(1,))


def test_a_teardown_is_awaited_for_the_grace_then_killed_as_a_success() -> None:
    # Rank 1 returned first and hangs in teardown; the grace counts from the last return.
    ranks = [returned(0, 0, at=T0 + 10.0), returned(1, None, at=T0, progress=T0)]
    assert decide(obs(ranks, now=T0 + 39.9), TEARDOWN) == Monitor()  # no hang either
    assert decide(obs(ranks, now=T0 + 40.0), TEARDOWN) == ExitBarrier(kill=(1,))


def test_a_returned_inprocess_worker_that_dies_is_neither_dropped_nor_replaced() -> None:
    ranks = with_rank(running(3, inprocess=True), returned(2, -signal.SIGKILL, inprocess=True))
    assert decide(obs(ranks), Policy(max_restarts=2, max_respawns=2)) == Monitor()


def test_a_tearing_down_worker_is_no_running_inprocess_peer() -> None:
    ranks = [
        returned(0, None, inprocess=True),
        RankView(local_rank=1, exitcode=-signal.SIGKILL, inprocess=True),
    ]
    assert decide(obs(ranks), Policy(max_restarts=2, max_respawns=2)) == RestartGroup(failed=(1,))


def test_waiting_nodes_never_restart_workers_that_returned() -> None:
    ranks = with_rank(running(2), returned(1, None))
    assert decide(obs(ranks, nodes_waiting=1), TEARDOWN) == Monitor()


def test_the_loop_sees_a_stopped_worker_when_it_watches_hangs(tmp_path: Path) -> None:
    import subprocess

    slots = {lr: Slot(env={}, files=AttemptFiles.in_dir(str(tmp_path / str(lr))), started=T0)
             for lr in range(2)}  # fmt: skip
    progress = Path(slots[0].files.progress_file)  # rank 0 stalled: states are read
    progress.parent.mkdir(parents=True)
    progress.write_text("")
    os.utime(progress, (T0, T0))
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        wait = time.monotonic() + 10
        while time.monotonic() < wait and not is_stopped(procs[1].pid):
            time.sleep(0.01)
        pids = {lr: p.pid for lr, p in enumerate(procs)}
        codes: dict[int, int | None] = {0: None, 1: None}
        seen = observe(slots, codes, watch_progress=True, stop_signal=None,
                       pids=pids, stalled_after=1.0)  # fmt: skip
        assert [v.stopped for v in seen.ranks] == [False, True]
        unwatched = observe(slots, codes, watch_progress=False, stop_signal=None,
                            pids=pids, stalled_after=1.0)  # fmt: skip
        assert [v.stopped for v in unwatched.ranks] == [False, False]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_the_loop_sees_a_returned_worker_in_its_exit_file(tmp_path: Path) -> None:
    slots: dict[int, Slot] = {}
    for lr in range(2):
        files = AttemptFiles.in_dir(str(tmp_path / str(lr)))
        Path(files.exit_file).parent.mkdir(parents=True)
        Path(files.exit_file).write_text(json.dumps({"version": 2, "exitcode": 0, "time": T0}))
        slots[lr] = Slot(env={}, files=files, started=T0)
    codes: dict[int, int | None] = {0: 0, 1: -signal.SIGABRT}
    seen = observe(slots, codes, watch_progress=False, stop_signal=None)
    assert [(v.exitcode, v.returned) for v in seen.ranks] == [(0, T0), (-signal.SIGABRT, T0)]
    action = decide(seen, POLICY)
    assert action == ExitBarrier()
    workers = [Worker(local_rank=lr, global_rank=2 + lr) for lr in range(2)]
    notes = after_return(action, seen, workers, grace=30.0)
    assert notes == {3: "died by SIGABRT in interpreter teardown"}


# -- the restart budget -------------------------------------------------------------------
@pytest.mark.parametrize(("recorded", "max_restarts"), [(1, 1), (1, 3), (3, 3)])
def test_failures_within_the_budget_restart(recorded: int, max_restarts: int) -> None:
    assert after_failure(recorded, max_restarts) == RestartGroup()


@pytest.mark.parametrize(("recorded", "max_restarts"), [(1, 0), (4, 3)])
def test_a_failure_past_the_budget_gives_up(recorded: int, max_restarts: int) -> None:
    assert after_failure(recorded, max_restarts) == GiveUp(restarts=recorded - 1)


def test_remaining_restarts_never_go_negative() -> None:
    assert remaining_restarts(0, 3) == 3
    assert remaining_restarts(3, 3) == 0
    assert remaining_restarts(5, 3) == 0


def test_a_fork_server_is_wanted_for_python_workers_with_restarts_left() -> None:
    assert wants_fork_server(POLICY, is_python=True, restart_count=0)
    assert not wants_fork_server(POLICY, is_python=False, restart_count=0)
    assert not wants_fork_server(POLICY, is_python=True, restart_count=3)
    off = Policy(max_restarts=3, fork_server=False)
    assert not wants_fork_server(off, is_python=True, restart_count=0)


def test_a_fork_server_is_wanted_where_the_membership_can_change_with_no_restart_left() -> None:
    # torchrun's default --max-restarts 0 on a dynamic rendezvous of more than one node:
    # a node that joins, leaves or is lost restarts the workers without spending one
    elastic = Policy(max_restarts=0, membership_restarts=True)
    assert wants_fork_server(elastic, is_python=True, restart_count=0)
    spent = Policy(max_restarts=2, membership_restarts=True)
    assert wants_fork_server(spent, is_python=True, restart_count=2)
    assert not wants_fork_server(Policy(max_restarts=0), is_python=True, restart_count=0)
    assert not wants_fork_server(elastic, is_python=False, restart_count=0)
    off = Policy(max_restarts=0, membership_restarts=True, fork_server=False)
    assert not wants_fork_server(off, is_python=True, restart_count=0)


# -- the loop's bookkeeping of lost workers ------------------------------------------------
def test_a_lost_worker_on_a_node_of_group_rank_1_is_lost_once(tmp_path: Path) -> None:
    """The reviewer's ``_lost`` bug: lost workers were recorded by global rank and
    looked up by local rank, so on a node whose global ranks are not its local ranks a
    lost worker was "lost" again on every poll. Slots are keyed and marked by local rank.
    """
    n = 2
    workers = [Worker(local_rank=lr, global_rank=n * 1 + lr) for lr in range(n)]
    slots: dict[int, Slot] = {}
    for lr in range(n):
        files = AttemptFiles.in_dir(str(tmp_path / str(lr)))
        Path(files.marker).parent.mkdir(parents=True)
        Path(files.marker).write_text("")
        slots[lr] = Slot(env={}, files=files, started=T0)
    pids = {0: 1000, 1: 1001}
    codes: dict[int, int | None] = {0: None, 1: -signal.SIGKILL}

    first = observe(slots, codes, watch_progress=False, stop_signal=None)
    action = decide(first, POLICY)
    assert action == DropRanks((1,))
    dropped = failures(action.local_ranks, first, workers, slots, pids)
    assert [(f.local_rank, f.exitcode, f.pid) for f in dropped.values()] == [
        (1, -signal.SIGKILL, 1001)
    ]
    (lost,) = dropped.values()  # keyed by global rank
    slots[lost.local_rank].lost = lost  # as NodeWorkers.drop records it

    for _ in range(3):  # every later poll: nothing new
        later = observe(slots, codes, watch_progress=False, stop_signal=None)
        assert decide(later, POLICY) == Monitor()


# -- replacements (tiered recovery) ---------------------------------------------------------
RESPAWN = Policy(max_restarts=2, max_respawns=2)


def test_a_killed_inprocess_worker_is_replaced_within_the_budget() -> None:
    ranks = with_rank(
        running(3, inprocess=True),
        RankView(local_rank=2, exitcode=-signal.SIGKILL, inprocess=True, respawns=1),
    )
    assert decide(obs(ranks), RESPAWN) == DropRanks((2,), respawn=(2,))


def test_a_worker_past_its_replacements_is_dropped_for_good() -> None:
    ranks = with_rank(
        running(3, inprocess=True),
        RankView(local_rank=2, exitcode=-signal.SIGSEGV, inprocess=True, respawns=2),
    )
    assert decide(obs(ranks), RESPAWN) == DropRanks((2,), respawn=())


def test_a_worker_the_wrapper_terminated_is_not_replaced() -> None:
    # exit status 1: the wrapper let it go (a failed health check), it did not crash
    ranks = with_rank(
        running(2, inprocess=True), RankView(local_rank=0, exitcode=1, inprocess=True)
    )
    assert decide(obs(ranks), RESPAWN) == DropRanks((0,), respawn=())


def test_no_replacements_without_a_restart_budget() -> None:
    ranks = with_rank(
        running(2, inprocess=True), RankView(local_rank=0, exitcode=-9, inprocess=True)
    )
    assert decide(obs(ranks), POLICY) == DropRanks((0,), respawn=())


# -- the node tier -----------------------------------------------------------------------
INPROC = Policy(max_restarts=3, max_respawns=3)


def test_in_process_workers_are_announced_to_the_rendezvous_once() -> None:
    assert decide(obs(running(2, inprocess=True)), INPROC) == MarkInprocess()
    marked = obs(running(2, inprocess=True), marked_inprocess=True)
    assert decide(marked, INPROC) == Monitor()
    # not while one worker is not (yet) in-process, nor without replacements allowed
    mixed = with_rank(running(2, inprocess=True), RankView(local_rank=1, exitcode=None))
    assert decide(obs(mixed), INPROC) == Monitor()
    assert decide(obs(running(2, inprocess=True)), POLICY) == Monitor()


def test_a_vacancy_is_acted_on_once_per_loss() -> None:
    ranks = running(2, inprocess=True)
    seen = obs(ranks, vacancies={1: 5_000}, marked_inprocess=True)
    assert decide(seen, INPROC) == NodeLost({1: 5_000})
    done = obs(ranks, vacancies={1: 5_000}, declared=frozenset({(1, 5_000)}), marked_inprocess=True)
    assert decide(done, INPROC) == Monitor()
    # the same rank lost again later (a new incarnation) is a new loss
    again = obs(
        ranks, vacancies={1: 9_000}, declared=frozenset({(1, 5_000)}), marked_inprocess=True
    )
    assert decide(again, INPROC) == NodeLost({1: 9_000})


def test_a_node_the_others_dropped_joins_again_and_its_workers_deaths_are_no_failure() -> None:
    # its own group rank is vacant: the others took it for lost (its agent stalled past
    # the dead-node delay) and went on without its ranks; it joins again (before, it
    # declared its own ranks lost and never came back: the job stayed smaller)
    ranks = running(2, inprocess=True)
    dropped = obs(ranks, dropped=True, marked_inprocess=True)
    assert decide(dropped, INPROC) == RestartGroup(reason="membership")
    died = with_rank(ranks, RankView(local_rank=0, exitcode=1, inprocess=True))
    assert decide(obs(died, dropped=True), INPROC) == RestartGroup(reason="membership")
    # a node whose script returned finishes as it would have
    returned = with_rank(ranks, RankView(local_rank=0, exitcode=0, returned=T0, inprocess=True))
    assert decide(obs(returned, dropped=True), INPROC) == Monitor()


def test_a_failure_wins_over_a_vacancy() -> None:
    ranks = with_rank(running(2), RankView(local_rank=0, exitcode=1))
    assert decide(obs(ranks, vacancies={1: 5}), INPROC) == RestartGroup(failed=(0,))
