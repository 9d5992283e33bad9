"""The dynamic rendezvous under real ``relaunch`` agents (separate processes, c10d store).

Workers are small Python scripts (no torch) that print one line per start:
``start <group_rank> <group_world_size> <restart_count>``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from multinode_support.ports import free_port
from multinode_support.stopping import stop_sessions
from multinode_support.waiting import wait_for
from relaunch.store.tcp import TCPStoreClient

WORKER = r"""
import os, sys, time
env = os.environ
print("start", env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["TORCHELASTIC_RESTART_COUNT"],
      flush=True)
mode = sys.argv[1]
if mode == "fail-once" and env["TORCHELASTIC_RESTART_COUNT"] == "0":
    if env["GROUP_RANK"] == "1":
        sys.exit(3)
    time.sleep(60)  # as if blocked in a collective: restarted when the failed node rejoins
if mode == "until-smaller" and env["GROUP_WORLD_SIZE"] != sys.argv[2]:
    time.sleep(60)  # the first, larger round runs until a node is lost
"""


class Agents:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.script = tmp / "worker.py"
        self.script.write_text(WORKER)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.endpoint = f"127.0.0.1:{free_port()}"

    def start(self, nnodes: str, *worker_args: str, host: bool, restarts: int = 0) -> int:
        i = len(self.procs)
        out = open(self.tmp / f"agent{i}.out", "wb")  # noqa: SIM115
        conf = f"is_host={int(host)},keep_alive_interval=0.25,keep_alive_max_attempt=8"
        cmd = [
            sys.executable, "-m", "relaunch",
            f"--nnodes={nnodes}", "--nproc-per-node=1", f"--max-restarts={restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}", "--rdzv-id=job",
            f"--rdzv-conf={conf}", f"--log-dir={self.tmp / f'logs{i}'}",
            str(self.script), *worker_args,
        ]  # fmt: skip
        self.procs.append(
            subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        )
        out.close()
        return i

    def starts(self, i: int) -> list[list[str]]:
        text = (self.tmp / f"agent{i}.out").read_text(errors="replace")
        return [line.split()[1:] for line in text.splitlines() if line.startswith("start ")]

    def wait_starts(self, i: int, count: int, timeout: float = 90) -> list[list[str]]:
        end = time.monotonic() + timeout
        while len(self.starts(i)) < count:
            assert self.procs[i].poll() is None or len(self.starts(i)) >= count, self.log(i)
            assert time.monotonic() < end, self.log(i)
            time.sleep(0.05)
        return self.starts(i)

    def log(self, i: int) -> str:
        return (self.tmp / f"agent{i}.out").read_text(errors="replace")[-3000:]

    def state(self) -> dict[str, Any]:
        """The job's rendezvous state, as the agents wrote it in their store."""
        host, port = self.endpoint.rsplit(":", 1)
        with TCPStoreClient(host, int(port), timeout=10) as store:
            raw = store.get("relaunch/rdzv/job/state")
        assert raw is not None
        doc: dict[str, Any] = json.loads(raw)
        return doc

    def wait(self, i: int, timeout: float = 90) -> int:
        try:
            return self.procs[i].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logs = "\n".join(f"--- agent {j}:\n{self.log(j)}" for j in range(len(self.procs)))
            raise AssertionError(f"agent {i} still runs after {timeout:g} s\n{logs}") from None

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(timeout=10)

    def reap(self) -> None:
        stop_sessions(self.procs)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    group = Agents(tmp_path)
    yield group
    group.reap()


def test_worker_failure_spends_one_job_restart(agents: Agents) -> None:
    for i in range(2):
        agents.start("2", "fail-once", host=i == 0, restarts=1)
    assert [agents.wait(i) for i in range(2)] == [0, 0], agents.log(0) + agents.log(1)
    for i in range(2):
        # both nodes restarted once, and both see the job's count (1), not their own
        assert [s[2] for s in agents.starts(i)] == ["0", "1"]


def test_agent_killed_survivors_continue_smaller(agents: Agents) -> None:
    for i in range(3):
        agents.start("2:3", "until-smaller", "2", host=i == 0)
    for i in range(3):
        agents.wait_starts(i, 1)
    assert {agents.starts(i)[0][1] for i in range(3)} == {"3"}
    agents.kill(2)  # the agent dies with its worker: no goodbye
    for i in range(2):
        assert agents.wait(i) == 0, agents.log(i)
        second = agents.starts(i)[1]
        assert second[1:] == ["2", "0"]  # a round of two, and no restart spent
    assert sorted(agents.starts(i)[1][0] for i in range(2)) == ["0", "1"]


def test_spare_takes_the_lost_nodes_place(agents: Agents) -> None:
    for i in range(2):
        agents.start("2:2", "until-smaller", "0", host=i == 0)
    for i in range(2):
        agents.wait_starts(i, 1)
    spare = agents.start("2:2", "until-smaller", "0", host=False)
    wait_for(
        lambda: len(agents.state()["redundancy_list"]) == 1,
        60,
        what="the spare on the redundancy list",
        detail=lambda: agents.log(spare),
    )
    assert agents.starts(spare) == []  # registered, and it started no worker
    agents.kill(1)
    agents.wait_starts(0, 2)
    agents.wait_starts(spare, 1)
    assert agents.starts(0)[1][1] == agents.starts(spare)[0][1] == "2"
    assert {agents.starts(0)[1][0], agents.starts(spare)[0][0]} == {"0", "1"}
