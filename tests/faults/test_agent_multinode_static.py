"""Two nodes (static rendezvous) of two gloo workers each: a worker crash on one node
restarts both nodes' groups, and the new attempt does not trip over the old one's store
state (torchrun 2.13 fails this: pytorch issue 135712)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from multinode_support.ports import free_port, ipv6_loopback
from multinode_support.stacks import stacks_of_tree

PY = sys.executable

TRAIN = """
import os, sys, time
import torch, torch.distributed as dist
rank = int(os.environ["RANK"]); attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
t = torch.ones(1) * (rank + 1)
for step in range(20):
    dist.all_reduce(t.fill_(rank + 1))
    assert t.item() == 10, t
    if attempt == 0 and rank == 3 and step == 3:
        os._exit(13)   # a crash in the middle of training
    time.sleep(0.02)
with open(os.path.join(sys.argv[1], f"done_{rank}"), "w") as f:
    f.write(str(attempt))
dist.destroy_process_group()
"""


def start_nodes(
    stack: contextlib.ExitStack, common: list[str], script: Path, out_dir: Path,
    env: dict[str, str], count: int,
) -> list[subprocess.Popen[str]]:  # fmt: skip
    """Start node ranks 0 .. count-1 (each reaped as ``stack`` closes)."""
    return [
        stack.enter_context(subprocess.Popen(
            [PY, "-m", "relaunch", *common, f"--node-rank={rank}", str(script), str(out_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        ))
        for rank in range(count)
    ]  # fmt: skip


def static_flags(nnodes: int, port: int, run_id: str) -> list[str]:
    """A static job of ``nnodes`` nodes of one worker each on loopback, no standby."""
    return [
        f"--nnodes={nnodes}", "--nproc-per-node=1", "--rdzv-backend=static",
        "--master-addr=127.0.0.1", f"--master-port={port}", "--local-addr=127.0.0.1",
        f"--rdzv-id={run_id}", "--no-warm-standby",
    ]  # fmt: skip


def run_nodes(
    common: list[str], script: Path, out_dir: Path, env: dict[str, str], count: int = 2
) -> list[tuple[int, str, str]]:
    """Run node ranks 0 .. count-1 to the end; (exit code, stdout, stderr) of each. Reaps
    them all; a node still running after 140 s fails the test with its threads' stacks."""
    with contextlib.ExitStack() as stack:
        nodes = start_nodes(stack, common, script, out_dir, env, count)
        results = []
        try:
            for node in nodes:
                try:
                    out, err = node.communicate(timeout=140)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"node {nodes.index(node)} hangs:\n{stacks_of_tree(node.pid)}")
                results.append((node.returncode, out, err))
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
    return results


@pytest.mark.timeout(150)
def test_crash_on_one_node_restarts_both_with_clean_state(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    port = free_port()
    common = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=static",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--max-restarts=2",
        "--local-addr=127.0.0.1",
        "--rdzv-id=job1",
    ]
    results = run_nodes(common, script, tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    for code, out, err in results:
        assert code == 0, (out + err)[-3000:]
    done = {p.name: p.read_text() for p in tmp_path.glob("done_*")}
    assert done == {"done_0": "1", "done_1": "1", "done_2": "1", "done_3": "1"}


ALWAYS_FAILS = """
import os, sys, time
from relaunch.errors import record

@record
def main():
    if os.environ["RANK"] == "3":
        time.sleep(0.5)
        raise RuntimeError("rank three always fails, attempt " + os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open(os.path.join(sys.argv[1], "attempt_" + os.environ["RANK"]), "a") as f:
        f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
    time.sleep(600)

main()
"""


@pytest.mark.timeout(150)
@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_two_static_nodes_on_an_ipv6_master_addr_train(tmp_path: Path) -> None:
    """``--master-addr ::1``: the endpoint is bracketed and node 0's store listens on
    ``::`` (before: the command line refused ``::1:PORT``, and the store bound 0.0.0.0,
    which node 1 could not reach)."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    common = ["--nnodes=2", "--nproc-per-node=2", "--master-addr=::1",
              f"--master-port={free_port()}", "--max-restarts=1", "--no-warm-standby"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = run_nodes(common, script, out, env)
    assert [code for code, _, _ in results] == [0, 0], results
    assert sorted(p.name for p in out.iterdir()) == [f"done_{r}" for r in range(4)]


@pytest.mark.timeout(150)
def test_restart_budget_is_the_jobs_and_every_node_reports_the_root_cause(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent(ALWAYS_FAILS))
    port = free_port()
    common = [
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=static",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--max-restarts=2",
        "--local-addr=127.0.0.1",
        "--rdzv-id=job2",
        "--no-warm-standby",
    ]
    results = run_nodes(common, script, tmp_path, dict(os.environ))
    reports = [err for _, _, err in results]
    assert [code for code, _, _ in results] == [1, 1], reports
    for report in reports:
        root = report.split("Root Cause")[1]
        assert "RuntimeError: rank three always fails, attempt 2" in root, report
    # 3 attempts in all (2 restarts for the job), every node saw the same restart counts
    for rank in (0, 1, 2):
        assert (tmp_path / f"attempt_{rank}").read_text().split() == ["0", "1", "2"]


GIVES_UP_AS_ONE_ENDS = """
import os, sys, time
node = os.environ["GROUP_RANK"]
if node == "1":
    time.sleep(1.5)  # node 0's workers have ended: node 0 waits at the exit barrier
    sys.exit(3)
if node == "2":
    time.sleep(600)  # stopped when node 1 gives up on the job
"""


@pytest.mark.timeout(150)
def test_a_give_up_while_a_node_waits_at_the_barrier_stops_the_others(tmp_path: Path) -> None:
    # No restarts: node 1's failure ends the job; node 2, still running, stops at once
    # (a node waiting at the barrier keeps nodes from restarting for a scale-up, never
    # from seeing the job closed); node 0 ends too.
    script = tmp_path / "gives_up.py"
    script.write_text(textwrap.dedent(GIVES_UP_AS_ONE_ENDS))
    common = [*static_flags(3, free_port(), "job3"), "--max-restarts=0"]
    results = run_nodes(common, script, tmp_path, dict(os.environ), count=3)
    reports = [err for _, _, err in results]
    assert [code for code, _, _ in results] == [1, 1, 1], reports
    for report in reports:
        assert "exitcode  : 3" in report.split("Root Cause")[1], report


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_sigterm_ends_an_agent_waiting_in_rendezvous(tmp_path: Path, backend: str) -> None:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(9)\n")
    port = free_port()
    endpoint = ["--master-addr=127.0.0.1", f"--master-port={port}", "--node-rank=0"]
    if backend == "c10d":
        endpoint = [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=lonely"]
    agent = subprocess.Popen(
        [PY, "-m", "relaunch", "--nnodes=2", f"--rdzv-backend={backend}", *endpoint,
         "--local-addr=127.0.0.1", f"--log-dir={tmp_path / 'logs'}", str(script)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # wait until it listens (it hosts the store), i.e. it is inside the rendezvous
        import socket as _socket
        import time as _time

        deadline = _time.monotonic() + 30
        while True:
            try:
                _socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert _time.monotonic() < deadline
                _time.sleep(0.1)
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 128 + signal.SIGTERM, err


DONE_FIRST = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:  # done at once: its node waits at the exit barrier
    with open(os.path.join(sys.argv[1], "pid0"), "w") as f:
        f.write(str(os.getpid()))
    sys.exit(0)
time.sleep(600)  # the other node's worker is still training
"""


@pytest.mark.timeout(120)
def test_sigterm_ends_an_agent_waiting_at_the_exit_barrier(tmp_path: Path) -> None:
    """Node 0's workers succeeded and it waits for node 1's at the exit barrier: a
    SIGTERM (Ctrl-C, scancel) ends it now, with 128 + 15, not after node 1 or the
    barrier's timeout (before, it waited them out and then exited 0)."""
    script = tmp_path / "done_first.py"
    script.write_text(DONE_FIRST)
    common = [*static_flags(2, free_port(), "barrier"), "--exit-barrier-timeout=90"]
    with contextlib.ExitStack() as stack:
        nodes = start_nodes(stack, common, script, tmp_path, dict(os.environ), 2)
        try:
            pid_file = tmp_path / "pid0"
            deadline = time.monotonic() + 60
            while not (pid_file.exists() and pid_file.read_text()):
                assert time.monotonic() < deadline and nodes[0].poll() is None
                time.sleep(0.05)
            worker = int(pid_file.read_text())
            while os.path.exists(f"/proc/{worker}"):  # (its agent reaps it)
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(1.0)  # its agent saw it exit and waits at the barrier
            nodes[0].send_signal(signal.SIGTERM)
            _, err = nodes[0].communicate(timeout=30)
            assert nodes[0].returncode == 128 + signal.SIGTERM, err
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.send_signal(signal.SIGTERM)
                try:
                    node.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    node.kill()
                    node.communicate()


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (``SigCgt``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_an_agent_still_connecting_to_the_store(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Node 1 of a static job whose node 0 never comes retries its connection to the
    store for the join timeout (600 s), before any agent exists: a signal ends it there,
    with one line (before: it went on retrying, and a Ctrl-C waited up to 10 minutes)."""
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(9)\n")
    agent = subprocess.Popen(
        [PY, "-m", "relaunch", "--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1",
         f"--master-port={free_port()}", "--node-rank=1", str(script)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # its handlers are in (SIGTERM's: Python catches SIGINT from its own start)
        while not _catches(agent.pid, signal.SIGTERM):
            assert agent.poll() is None
            time.sleep(0.01)
        agent.send_signal(sig)
        _, err = agent.communicate(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 128 + sig, err
    assert f"stopped by signal {sig.name} while joining the job" in err, err
