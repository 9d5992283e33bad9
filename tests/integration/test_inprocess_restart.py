"""In-process restart with real rank processes on gloo, under an agent-style store.

The test process hosts a torch TCPStore (port 0) like the agent does, and starts the
ranks itself with the worker environment of torchrun. Faults are injected by
``test_inprocess_worker.py``. Short timeouts: soft 2 s, hard 4 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from multinode_support.ports import free_port as _free_port

WORKER = Path(__file__).with_name("test_inprocess_worker.py")
FAST = {
    "soft_timeout": 2,
    "hard_timeout": 4,
    "barrier_timeout": 20,
    "heartbeat_timeout": 3,
    "termination_grace_time": 1,
    "completion_timeout": 20,
}


@dataclass
class Rank:
    initial: int
    proc: subprocess.Popen[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    stderr: str = ""

    def of(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]


def _marked_pids(token: str, rank: int | None = None) -> list[int]:
    """The processes that carry ``token`` (of initial rank ``rank`` only, if given)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            if token.encode() in environ and (
                rank is None or f"\0RANK={rank}\0".encode() in b"\0" + environ
            ):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def run_job(
    world: int,
    faults: list[dict[str, Any]],
    *,
    wrapper: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    agent_store: bool = True,
    steps: int = 5,
    timeout: float = 60.0,
    silent: frozenset[int] = frozenset(),
) -> list[Rank]:
    """Start ``world`` ranks, wait for them, check nothing is left behind. The ranks
    in ``silent`` stop themselves and their monitor processes (a ``silent`` fault): they
    are killed once the others are done."""
    import torch.distributed as dist

    token = f"IPX_TOKEN_{uuid.uuid4().hex}"
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = server.port
    standalone_port = _free_port()
    ranks = []
    try:
        for r in range(world):
            rank_env = dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                TORCHELASTIC_RUN_ID=token,
                TORCHELASTIC_RESTART_COUNT="0",
                IPX_FAULTS=json.dumps(faults),
                IPX_WRAPPER=json.dumps({**FAST, **(wrapper or {})}),
                IPX_STEPS=str(steps),
                OMP_NUM_THREADS="1",
                **{token: "1"},
                **(env or {}),
            )
            if agent_store:
                rank_env.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
            else:  # rank 0's monitor process hosts the store on MASTER_PORT + 1
                rank_env.update(MASTER_PORT=str(standalone_port - 1))
                rank_env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            proc = subprocess.Popen(
                [sys.executable, str(WORKER)],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            ranks.append(Rank(r, proc))
        for rank in sorted(ranks, key=lambda r: r.initial in silent):
            if rank.initial in silent:
                for pid in _marked_pids(token, rank=rank.initial):
                    os.kill(pid, signal.SIGKILL)
            out, err = rank.proc.communicate(timeout=timeout)
            rank.events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            rank.stderr = err
    finally:
        for rank in ranks:
            if rank.proc.poll() is None:
                rank.proc.kill()
                rank.proc.communicate()
        del server
    # monitor processes exit with their rank: nothing carrying the token survives
    deadline = time.monotonic() + 10
    while _marked_pids(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _marked_pids(token)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"
    return ranks


def _report(ranks: list[Rank]) -> str:
    return "\n".join(
        f"rank {r.initial} rc={r.proc.returncode} events={r.events}\nstderr:\n{r.stderr[-3000:]}"
        for r in ranks
    )


def assert_clean(rank: Rank) -> None:
    (ret,) = rank.of("return")
    assert ret["threads"] == [], ret
    assert ret["children"] == [], ret
    assert ret["sockets"] == 0, ret


def assert_rank_1_killed_others_shift(ranks: list[Rank]) -> None:
    """Of 3 ranks, rank 1 was killed at its hard timeout; 0 and 2 went on at world size 2."""
    report = _report(ranks)
    assert ranks[1].proc.returncode in (-signal.SIGTERM, -signal.SIGKILL), report
    assert "HARD_TIMEOUT" in ranks[1].stderr, report
    assert starts(ranks[0]) == [(0, 0, 3), (1, 0, 2)], report
    assert starts(ranks[2]) == [(0, 2, 3), (1, 1, 2)], report
    for rank in (ranks[0], ranks[2]):
        assert rank.proc.returncode == 0, report
        assert_clean(rank)


def starts(rank: Rank) -> list[tuple[int, int, int]]:
    """(iteration, rank, world size) of each call of the function."""
    return [(e["iteration"], e["rank"], e["world"]) for e in rank.of("start")]


@pytest.fixture(autouse=True)
def _no_alarm() -> Iterator[None]:
    yield


@pytest.mark.timeout(90)
def test_exception_restarts_all_ranks_in_process() -> None:
    ranks = run_job(2, [{"iteration": 0, "rank": 1, "kind": "exception", "step": 2}])
    report = _report(ranks)
    for rank in ranks:
        assert rank.proc.returncode == 0, report
        assert starts(rank) == [(0, rank.initial, 2), (1, rank.initial, 2)], report
        assert {e["pid"] for e in rank.of("start")} == {rank.proc.pid}, report
        assert rank.of("return")[0]["value"] == f"value-{rank.initial}", report
        assert_clean(rank)


def test_a_rank_that_comes_late_to_the_first_barrier_is_not_declared_missing() -> None:
    # rank 1 enters the wrapper 6 s after rank 0 (heartbeat timeout 3 s): the initial
    # barrier waits for it; rank 0's monitor judged its heartbeat from the start and
    # declared it missing, and the job ran on without it (NVIDIA's judges heartbeats
    # once past that barrier)
    ranks = run_job(2, [], env={"IPX_LATE": "1:6"})
    report = _report(ranks)
    for rank in ranks:
        assert rank.proc.returncode == 0, report
        assert starts(rank) == [(0, rank.initial, 2)], report
        assert rank.of("return")[0]["value"] == f"value-{rank.initial}", report
        assert_clean(rank)


def test_a_completion_barrier_that_times_out_restarts_every_rank() -> None:
    # rank 1 lingers 5 s after its last collective (hang protection off), rank 0 waits
    # at the completion barrier for 2 s: an interruption, as NVIDIA's, and both ranks
    # run the next iteration (rank 0 left the job with BarrierTimeoutError, and rank 1
    # went on alone)
    fault = {"iteration": 0, "rank": 1, "kind": "unprotected", "step": "end"}
    ranks = run_job(2, [fault], wrapper={"completion_timeout": 2})
    report = _report(ranks)
    for rank in ranks:
        assert rank.proc.returncode == 0, report
        assert starts(rank) == [(0, rank.initial, 2), (1, rank.initial, 2)], report
        assert rank.of("return")[0]["value"] == f"value-{rank.initial}", report
        assert_clean(rank)


def test_an_assignment_of_the_user_s_is_called_by_each_rank_for_itself_with_the_store() -> None:
    # as NVIDIA's wrapper calls it: it had the store as None (and raised), and every
    # rank's answer came from each process's own call
    ranks = run_job(2, [{"iteration": 0, "rank": 1, "kind": "exception", "step": 2}],
                    env={"IPX_CUSTOM": "1"})  # fmt: skip
    report = _report(ranks)
    for rank in ranks:
        assert rank.proc.returncode == 0, report
        assert starts(rank) == [(0, rank.initial, 2), (1, rank.initial, 2)], report
        calls = rank.of("assign")
        assert calls and {(c["pid"], c["rank"]) for c in calls} == {
            (rank.proc.pid, rank.initial)
        }, report


@pytest.mark.timeout(90)
def test_a_silent_call_without_hang_protection_is_not_a_hang() -> None:
    # soft 2 s, hard 4 s: a 5 s sleep inside disable_hang_protection() on every rank
    # (a checkpoint save, say) restarts nothing
    faults = [{"iteration": 0, "rank": r, "kind": "unprotected", "step": 2} for r in (0, 1)]
    ranks = run_job(2, faults)
    report = _report(ranks)
    for rank in ranks:
        assert rank.proc.returncode == 0, report
        assert starts(rank) == [(0, rank.initial, 2)], report
        assert_clean(rank)


@pytest.mark.timeout(90)
def test_gloo_collectives_time_out_at_the_soft_timeout_except_without_hang_protection() -> None:
    # the function's gloo group has torch's default timeout (30 min); the monitor thread
    # bounds it by the soft timeout (2 s here), so a collective gloo leaves waiting on a
    # dead peer's closed connection fails before the hard timeout kills the rank;
    # inside disable_hang_protection() the group's own timeout holds again
    ranks = run_job(2, [], env={"IPX_REPORT_GLOO": "1"})
    report = _report(ranks)
    for rank in ranks:
        assert rank.proc.returncode == 0, report
        assert rank.of("gloo") == [{"event": "gloo", "outside": 2.0, "inside": 1800.0,
                                    "after": 2.0}], report  # fmt: skip
        assert_clean(rank)


@pytest.mark.timeout(90)
def test_two_successive_faults() -> None:
    faults = [
        {"iteration": 0, "rank": 1, "kind": "exception", "step": 1},
        {"iteration": 1, "rank": 0, "kind": "exception", "step": 3},
    ]
    ranks = run_job(2, faults)
    report = _report(ranks)
    for rank in ranks:
        assert rank.proc.returncode == 0, report
        assert [s[0] for s in starts(rank)] == [0, 1, 2], report
        assert_clean(rank)


@pytest.mark.timeout(90)
def test_python_hang_without_ping_restarts_at_soft_timeout() -> None:
    ranks = run_job(2, [{"iteration": 0, "rank": 1, "kind": "busy", "step": 2}])
    report = _report(ranks)
    for rank in ranks:
        assert rank.proc.returncode == 0, report  # soft timeout: nobody was killed
        assert [s[0] for s in starts(rank)] == [0, 1], report
        assert_clean(rank)
    # rank 0, in its all-reduce, stopped pinging when rank 1 did (both pinged last after
    # step 1): either rank's monitor may see its soft timeout first (under load rank 0's)
    assert any("soft timeout" in rank.stderr for rank in ranks), report


@pytest.mark.timeout(90)
def test_sleep_hang_is_woken_at_soft_timeout_not_killed() -> None:
    ranks = run_job(2, [{"iteration": 0, "rank": 1, "kind": "sleep", "step": 2}])
    report = _report(ranks)
    for rank in ranks:
        # a hard timeout would have killed rank 1; it returns the value in-process
        assert rank.proc.returncode == 0, report
        assert [s[0] for s in starts(rank)] == [0, 1], report
        assert rank.of("return")[0]["value"] == f"value-{rank.initial}", report
        assert_clean(rank)


@pytest.mark.timeout(90)
def test_rank_holding_the_gil_is_killed_at_hard_timeout_others_shift() -> None:
    ranks = run_job(3, [{"iteration": 0, "rank": 1, "kind": "gil", "step": 2}])
    assert_rank_1_killed_others_shift(ranks)


@pytest.mark.timeout(90)
def test_sigkill_of_a_rank_others_continue_at_n_minus_1() -> None:
    ranks = run_job(3, [{"iteration": 0, "rank": 0, "kind": "sigkill", "step": 2}])
    report = _report(ranks)
    assert ranks[0].proc.returncode == -signal.SIGKILL, report
    assert starts(ranks[1]) == [(0, 1, 3), (1, 0, 2)], report
    assert starts(ranks[2]) == [(0, 2, 3), (1, 1, 2)], report
    for rank in ranks[1:]:
        assert rank.proc.returncode == 0, report
        assert_clean(rank)


@pytest.mark.timeout(120)
def test_silent_ranks_are_declared_missing_by_the_ranks_that_watch_them() -> None:
    # ranks 1-3 of 4 stop with their monitor processes (a machine gone silent: no
    # heartbeat, no death). Rank 0's monitor process reads the heartbeats of 1 and 2
    # only (about log2 of the world: each read every rank before, world squared reads an
    # interval); once they are declared missing it takes over their watch and finds 3
    # a moment later (a live rank's next beat). Rank 0 goes on alone (its restart may
    # come twice, as before: a rank declared during the restart interrupts it again)
    faults = [{"iteration": 0, "rank": r, "kind": "silent", "step": 2} for r in (1, 2, 3)]
    ranks = run_job(4, faults, silent=frozenset({1, 2, 3}))
    report = _report(ranks)
    assert ranks[0].proc.returncode == 0, report
    first, *then = starts(ranks[0])
    assert first == (0, 0, 4) and then and all(w == 1 for _, _, w in then), report
    assert ranks[0].of("return")[0]["value"] == "value-0", report
    assert_clean(ranks[0])
    for r in (1, 2, 3):
        assert f"rank {r}: no heartbeat" in ranks[0].stderr, report


@pytest.mark.timeout(90)
def test_rank_stuck_in_the_restart_procedure_is_killed_at_hard_timeout() -> None:
    # the hard timeout covers the restart procedure, not only the function: the
    # others do not wait for the stuck rank until the barrier timeout
    ranks = run_job(
        3,
        [{"iteration": 0, "rank": 0, "kind": "exception", "step": 2}],
        env={"IPX_STUCK_FINALIZE": "[1]"},
    )
    assert ranks[1].of("finalize_stuck"), _report(ranks)
    assert_rank_1_killed_others_shift(ranks)


@pytest.mark.timeout(90)
def test_spare_rank_is_activated_when_an_active_rank_is_lost() -> None:
    ranks = run_job(
        3,
        [{"iteration": 0, "rank": 1, "kind": "sigkill", "step": 2}],
        wrapper={"max_active_world_size": 2},
    )
    report = _report(ranks)
    assert starts(ranks[0]) == [(0, 0, 2), (1, 0, 2)], report
    assert starts(ranks[2]) == [(1, 1, 2)], report  # spare at iteration 0, active at 1
    for rank in (ranks[0], ranks[2]):
        assert rank.proc.returncode == 0, report
        assert rank.of("return")[0]["value"] == f"value-{rank.initial}", report
        assert_clean(rank)


@pytest.mark.timeout(90)
def test_nvidias_tree_replaces_a_lost_rank_with_a_reserve_of_its_host() -> None:
    # 2 hosts of 2 ranks, 1 active per host: ranks 0 and 2 train, 1 and 3 wait
    ranks = run_job(
        4,
        [{"iteration": 0, "rank": 0, "kind": "sigkill", "step": 2}],
        wrapper={"tree": [2, 1]},
    )
    report = _report(ranks)
    assert starts(ranks[2]) == [(0, 1, 2), (1, 1, 2)], report
    assert starts(ranks[1]) == [(1, 0, 2)], report  # host 0's reserve takes rank 0
    assert starts(ranks[3]) == [], report  # host 1's reserve is not needed
    for rank in (ranks[1], ranks[2]):
        assert rank.of("return")[0]["value"] == f"value-{rank.initial}", report
        assert_clean(rank)


@pytest.mark.timeout(90)
def test_spare_rank_returns_none() -> None:
    ranks = run_job(3, [], wrapper={"max_active_world_size": 2})
    report = _report(ranks)
    assert [r.of("return")[0]["value"] for r in ranks] == ["value-0", "value-1", None], report
    assert starts(ranks[2]) == [], report
    for rank in ranks:
        assert_clean(rank)


@pytest.mark.timeout(90)
def test_failing_health_check_terminates_only_its_rank() -> None:
    ranks = run_job(
        3,
        [{"iteration": 0, "rank": 0, "kind": "exception", "step": 2}],
        env={"IPX_UNHEALTHY": "[1]"},
    )
    report = _report(ranks)
    assert ranks[1].of("error")[0]["kind"] == "HealthCheckError", report
    assert starts(ranks[0]) == [(0, 0, 3), (1, 0, 2)], report
    assert starts(ranks[2]) == [(0, 2, 3), (1, 1, 2)], report
    for rank in ranks:
        assert_clean(rank)
    assert ranks[0].proc.returncode == 0 and ranks[2].proc.returncode == 0, report


@pytest.mark.timeout(90)
def test_atomic_section_is_not_interrupted() -> None:
    faults = [
        {"iteration": 0, "rank": 1, "kind": "atomic", "step": 1},
        {"iteration": 0, "rank": 0, "kind": "exception", "step": 1},
    ]
    ranks = run_job(2, faults)
    report = _report(ranks)
    names = [e["event"] for e in ranks[1].events]
    assert names.index("atomic_enter") < names.index("atomic_exit"), report
    assert [s[0] for s in starts(ranks[1])] == [0, 1], report
    for rank in ranks:
        assert rank.proc.returncode == 0, report
        assert_clean(rank)


@pytest.mark.timeout(90)
def test_standalone_store_survives_the_death_of_rank_0() -> None:
    ranks = run_job(
        3, [{"iteration": 0, "rank": 0, "kind": "sigkill", "step": 2}], agent_store=False
    )
    report = _report(ranks)
    assert ranks[0].proc.returncode == -signal.SIGKILL, report
    assert starts(ranks[1]) == [(0, 1, 3), (1, 0, 2)], report
    for rank in ranks[1:]:
        assert rank.proc.returncode == 0, report
        assert_clean(rank)
