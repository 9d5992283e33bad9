"""Recovery under faults in sequence: forked replacements, failures noticed before the
failed worker exits, stopped and hung workers, torch's teardown deadlock, nothing left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from multinode_support.waiting import wait_for
from relaunch.procs import Entrypoint, ProcessSpec, WorkerProcesses, is_stopped

PY = sys.executable


def write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def events(logs: Path) -> list[dict[str, Any]]:
    files = list(logs.glob("*/events.jsonl"))
    if not files:
        return []
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def named(evs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in evs if e["name"] == name]


def marked(marker: str) -> list[int]:
    """Processes whose environment holds ``RELAUNCH_TEST_MARK=marker`` (orphans included)."""
    found = []
    needle = f"RELAUNCH_TEST_MARK={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat", "rb") as s:
                        stat = s.read()
                    if stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X"):
                        found.append(int(entry))
        except OSError:
            continue
    return found


class Run:
    """``relaunch --standalone`` in the background, marked so that its leftovers are found."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.marker = uuid.uuid4().hex
        self.logs = tmp_path / "logs"
        env = {**os.environ, "RELAUNCH_TEST_MARK": self.marker, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [PY, "-m", "relaunch", "--standalone", f"--log-dir={self.logs}", *flags],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )

    def events(self) -> list[dict[str, Any]]:
        return events(self.logs)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.returncode is None:  # a failed test: nothing left running
            self.proc.kill()
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.communicate()

    def finish(self, timeout: float) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        wait_for(lambda: not marked(self.marker), timeout=10)
        return self.proc.returncode, out, err


TRAIN = """
import os, sys, time
first_line_has_torch = "torch" in sys.modules
out = sys.argv[1]
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(out, f"start_{attempt}_{rank}"), "w") as f:
    f.write(f"{os.getpid()} {int(first_line_has_torch)}")
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 4))
for step in range(1000000):
    model(torch.randn(2, 4)).sum().backward()
    with open(os.path.join(out, f"step_{attempt}_{rank}"), "w") as f:
        f.write(str(step))
    # the ranks agree to finish after the same step (one that saw the file alone would
    # leave the other blocked in the next step's all-reduce: "Connection closed by peer")
    finish = torch.tensor([float(os.path.exists(os.path.join(out, "finish")))])
    dist.all_reduce(finish)
    if finish.item():
        break
    time.sleep(0.02)
dist.destroy_process_group()
"""


def started(tmp_path: Path, attempt: int, rank: int) -> tuple[int, bool] | None:
    path = tmp_path / f"start_{attempt}_{rank}"
    text = path.read_text() if path.exists() else ""
    if len(text.split()) != 2:
        return None
    pid, has_torch = text.split()
    return int(pid), has_torch == "1"


def stepped(tmp_path: Path, attempt: int, rank: int) -> bool:
    return (tmp_path / f"step_{attempt}_{rank}").exists()


@pytest.mark.timeout(240)
def test_five_kills_one_second_apart_are_replaced_by_forks_that_import_nothing(
    tmp_path: Path,
) -> None:
    train = write(tmp_path, "train.py", TRAIN)
    with Run(tmp_path, "--nproc-per-node=2", "--max-restarts=5", train, str(tmp_path)) as run:
        wait_for(lambda: bool(named(run.events(), "fork_server_ready")), timeout=120)
        wait_for(lambda: stepped(tmp_path, 0, 0) and stepped(tmp_path, 0, 1))
        for attempt in range(5):
            info = started(tmp_path, attempt, attempt % 2)
            assert info is not None
            os.kill(info[0], signal.SIGKILL)
            time.sleep(1.0)  # the next fault comes 1 s later, recovered or not
            # both ranks of the next attempt started (the next kill is of either one)
            wait_for(lambda a=attempt: all(started(tmp_path, a + 1, r) for r in (0, 1)))  # type: ignore[misc]
        wait_for(lambda: stepped(tmp_path, 5, 0) and stepped(tmp_path, 5, 1))
        (tmp_path / "finish").write_text("")
        code, _, err = run.finish(timeout=60)
    assert code == 0, err
    for attempt in range(1, 6):
        for rank in (0, 1):
            info = started(tmp_path, attempt, rank)
            assert info is not None and info[1], f"attempt {attempt} rank {rank} imported torch"
    forked = [e["metadata"]["forked"] for e in named(run.events(), "workers_started")]
    assert forked[1:] == [[0, 1]] * 5


@pytest.mark.timeout(120)
def test_a_raise_restarts_the_group_before_the_failed_worker_exits(tmp_path: Path) -> None:
    s = write(
        tmp_path,
        "raiser.py",
        """
        import atexit, os, sys, time
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        if attempt == "0" and os.environ["LOCAL_RANK"] == "1":
            atexit.register(time.sleep, 60)  # a slow teardown
            raise ValueError("bad batch")
        if attempt == "0":
            time.sleep(60)
        """,
    )
    run = Run(tmp_path, "--nproc-per-node=2", "--max-restarts=1", s)
    code, _, err = run.finish(timeout=100)
    assert code == 0, err
    evs = run.events()
    failed = named(evs, "workers_failed")[0]["metadata"]["failures"]
    assert failed == {"1": 1}  # the runner's announced exit code, not a signal
    # The failed worker was still in its atexit sleep when the group was stopped.
    assert named(evs, "workers_stopped")[0]["metadata"]["exitcodes"]["1"] == -signal.SIGTERM


@pytest.mark.timeout(60)
def test_a_stopped_worker_gets_no_grace_period(tmp_path: Path) -> None:
    procs = WorkerProcesses(
        Entrypoint(kind="binary", target="sleep"),
        [ProcessSpec(local_rank=0, env=dict(os.environ), args=("600",))],
    )
    procs.start()
    pid = procs.pids()[0]
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: is_stopped(pid))
    # A grace period of 10 minutes would outlast the test's timeout.
    assert procs.close(signal.SIGTERM, grace=600.0) == {0: -signal.SIGKILL}


@pytest.mark.timeout(120)
def test_hang_timeout_restarts_the_group_and_names_the_hung_rank(tmp_path: Path) -> None:
    s = write(
        tmp_path,
        "hang.py",
        """
        import os, time
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        for step in range(20):
            dist.all_reduce(torch.ones(1))
            if step == 3 and os.environ["RANK"] == "1":
                time.sleep(100000)  # stuck_here
            time.sleep(0.05)
        dist.destroy_process_group()
        """,
    )
    run = Run(tmp_path, "--nproc-per-node=2", "--max-restarts=0", "--hang-timeout=2", s)
    code, _, err = run.finish(timeout=100)
    assert code == 1
    hung = named(run.events(), "worker_hung")
    assert [e["metadata"]["local_rank"] for e in hung] == [1]
    assert 'hang.py", line 8' in hung[0]["metadata"]["stacks"]  # the sleep
    assert "Hang: no Python code ran" in err and "rank      : 1" in err


@pytest.mark.timeout(120)
def test_a_sigstopped_worker_is_found_by_hang_timeout_and_replaced(tmp_path: Path) -> None:
    train = write(tmp_path, "train.py", TRAIN)
    with Run(
        tmp_path, "--nproc-per-node=2", "--max-restarts=1", "--hang-timeout=2",
        "--shutdown-timeout=600", train, str(tmp_path),
    ) as run:  # fmt: skip
        wait_for(lambda: stepped(tmp_path, 0, 0) and stepped(tmp_path, 0, 1), timeout=90)
        info = started(tmp_path, 0, 1)
        assert info is not None
        os.kill(info[0], signal.SIGSTOP)
        wait_for(lambda: stepped(tmp_path, 1, 0) and stepped(tmp_path, 1, 1), timeout=60)
        (tmp_path / "finish").write_text("")
        code, _, err = run.finish(timeout=60)
    assert code == 0, err
    hung = named(run.events(), "worker_hung")
    assert hung and hung[0]["metadata"]["pid"] == info[0]
    assert "stopped" in hung[0]["metadata"]["stacks"]


@pytest.mark.timeout(280)
def test_ddp_teardown_after_destroy_process_group_never_hangs(tmp_path: Path) -> None:
    # Rank 0 returns with its DDP model alive after destroy_process_group() (torch's
    # teardown deadlock); rank 1 waits until rank 0's process is gone, then fails, so
    # every attempt goes through rank 0's full interpreter teardown. 30 restarts.
    s = write(
        tmp_path,
        "teardown.py",
        """
        import os, sys, time
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo")
        rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        pids = [None, None]
        dist.all_gather_object(pids, os.getpid())
        model = DDP(torch.nn.Linear(8, 8))
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
        dist.destroy_process_group()
        if rank == 1 and attempt < 30:
            def gone(pid):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
                except OSError:
                    return True
            while not gone(pids[0]):
                time.sleep(0.01)
            sys.exit(3)
        """,
    )
    run = Run(tmp_path, "--nproc-per-node=2", "--max-restarts=30", s)
    code, _, err = run.finish(timeout=260)
    assert code == 0, err
    assert len(named(run.events(), "restart")) == 30


@pytest.mark.timeout(180)
def test_fork_server_and_forked_workers_die_with_a_sigkilled_agent(tmp_path: Path) -> None:
    train = write(tmp_path, "train.py", TRAIN)
    with Run(tmp_path, "--nproc-per-node=2", "--max-restarts=2", train, str(tmp_path)) as run:
        wait_for(lambda: bool(named(run.events(), "fork_server_ready")), timeout=120)
        wait_for(lambda: stepped(tmp_path, 0, 0) and stepped(tmp_path, 0, 1))
        info = started(tmp_path, 0, 0)
        assert info is not None
        os.kill(info[0], signal.SIGKILL)
        wait_for(lambda: stepped(tmp_path, 1, 0) and stepped(tmp_path, 1, 1))
        assert named(run.events(), "workers_started")[-1]["metadata"]["forked"] == [0, 1]
        assert len(marked(run.marker)) >= 4  # the agent, the fork server, two workers
        run.proc.kill()
        run.proc.wait(10)
        wait_for(lambda: not marked(run.marker), timeout=10)
