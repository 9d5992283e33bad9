"""Tiered recovery: a dead in-process rank is replaced and the job returns to full size,
with no healthy process restarted (two agents of two gloo workers, c10d, loopback)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.cluster import free_port
from multinode_support.tiered import RANKS, TieredJob, check_recovered, gone
from multinode_support.waiting import wait_for

pytestmark = pytest.mark.timeout(240)


@contextlib.contextmanager
def job(tmp: Path, steps: int = 400, **env: str) -> Iterator[TieredJob]:
    running = TieredJob(tmp, free_port(), steps_total=steps, env=env)
    try:
        for name in ("0", "1"):
            running.start(name)
        yield running
    finally:
        running.close()


def running_pids(j: TieredJob) -> dict[str, int]:
    """Each rank's pid, once every rank trained 40 steps."""
    j.at_step(40)
    return {n: j.pid_of(n) for n in RANKS}


def test_a_sigkilled_rank_is_replaced_and_the_job_returns_to_full_size(tmp_path: Path) -> None:
    with job(tmp_path) as j:
        pids = running_pids(j)
        fault = j.newest_step()
        os.kill(pids["1_1"], signal.SIGKILL)
        j.finish(after=fault)
    check_recovered(j, {"1_1": pids["1_1"]}, {n: p for n, p in pids.items() if n != "1_1"})
    respawned = [e["metadata"] for e in j.node_events(1) if e["name"] == "worker_respawned"]
    assert [(m["local_rank"], m["incarnation"]) for m in respawned] == [(1, 1)]  # type: ignore[index]
    assert gone([pids["1_1"]])


def test_two_ranks_of_different_nodes_killed_one_second_apart(tmp_path: Path) -> None:
    with job(tmp_path, steps=500) as j:
        pids = running_pids(j)
        os.kill(pids["0_1"], signal.SIGKILL)
        wait_for(lambda: any(s.step > 0 for s in j.steps() if s.incarnation), 60, what="rejoin")
        fault = j.newest_step()
        os.kill(pids["1_0"], signal.SIGKILL)
        j.finish(after=fault)
    killed = {n: pids[n] for n in ("0_1", "1_0")}
    check_recovered(j, killed, {n: p for n, p in pids.items() if n not in killed})


def test_a_replacement_that_dies_after_admission_does_not_take_the_job_down(
    tmp_path: Path,
) -> None:
    with job(tmp_path, KILL_FIRST_REPLACEMENT="0_1") as j:
        pids = running_pids(j)
        fault = j.newest_step()
        os.kill(pids["0_1"], signal.SIGKILL)
        j.finish(after=fault)
    check_recovered(j, {"0_1": pids["0_1"]}, {n: p for n, p in pids.items() if n != "0_1"})
    respawned = [e["metadata"] for e in j.node_events(0) if e["name"] == "worker_respawned"]
    assert [m["incarnation"] for m in respawned] == [1, 2]  # type: ignore[index]
