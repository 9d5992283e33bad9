"""``srun relaunch ...`` with no rendezvous flags, on a real Slurm (Debian's slurmctld,
slurmd and munge) whose nodes are network namespaces with host names of their own.

- a step of two nodes trains and ends with exit 0, every worker with the right
  ``RANK`` / ``WORLD_SIZE``;
- the same environment without Slurm (exactly what srun sets, given by hand to two
  agents), so the detection is covered where Slurm cannot be installed;
- a node lost mid-job, and a task lost mid-job: with ``srun --no-kill
  --kill-on-bad-exit=0 --wait=0`` (the options the README gives) the surviving node
  trains on and finishes; the cluster is configured like a strict site
  (``KillOnBadExit=1``, ``WaitTime=10``), where each of the three is needed (checked
  by hand: without ``--no-kill`` the step is cancelled "due to node failure", without
  the others the surviving task is killed);
- ``scancel``: SIGTERM reaches every worker, each agent stops its workers and ends with
  its one-line summary and exit 143 (128 + SIGTERM).

Needs root (namespaces); the Slurm tests skip, saying why, where Slurm is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.cluster import Cluster
from multinode_support.hosts import Hosts, start_plain
from multinode_support.netns import Net, network
from multinode_support.slurm import Slurm, require_slurm
from multinode_support.waiting import wait_for

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]

# Writes `step <node> <restart> <rank> <world> <step> <sum>` lines (Cluster.steps reads
# them) and, on SIGTERM, a term_<node>_<local_rank> file before exiting 143.
WORKER = r"""
import os, signal, sys, time
from datetime import timedelta
out = sys.argv[1]
args = dict(a.split("=", 1) for a in sys.argv[3:])  # argv[2]: the mode, "train"
env = os.environ
node, local = env["SLURMD_NODENAME"], env["LOCAL_RANK"]

def on_term(signum, frame):
    with open(os.path.join(out, f"term_{node}_{local}"), "w") as f:
        f.write(f"{env['RANK']} {env['WORLD_SIZE']}\n")
    os._exit(128 + signum)

signal.signal(signal.SIGTERM, on_term)
import torch
import torch.distributed as dist
rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
log = open(os.path.join(out, f"steps_{node}_{local}.log"), "a", buffering=1)
go, steps = args.get("go"), int(args.get("steps", "3"))
step = done = 0
while True:
    t = torch.tensor([float(rank + 1), float(bool(go) and os.path.exists(go))])
    dist.all_reduce(t)
    restart = env["TORCHELASTIC_RESTART_COUNT"]
    log.write(f"step {node} {restart} {rank} {world} {step} {int(t[0].item())}\n")
    step += 1
    if go and t[1].item() == 0:
        time.sleep(0.05)
        continue
    done += 1
    if done >= steps:
        break
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
"""

HEARTBEAT = "keep_alive_interval=0.25,keep_alive_max_attempt=8,last_call_timeout=1"


def _relaunch() -> list[str]:
    script = Path(sys.executable).parent / "relaunch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "relaunch"]


class Job:
    """One ``srun`` of relaunch on the Slurm cluster, and what its workers wrote."""

    def __init__(self, slurm: Slurm, tmp: Path) -> None:
        self.slurm = slurm
        self.tmp = tmp
        self.steps_of = Cluster(tmp, backend="c10d", endpoint="")  # the steps/ parser
        self.out = self.steps_of.out
        self.worker = tmp / "slurm_worker.py"
        self.worker.write_text(WORKER)
        self.output = tmp / "srun.out"

    def srun(self, *srun_opts: str, flags: tuple[str, ...] = (), go: Path | None = None) -> None:
        worker_args = [f"go={go}", "steps=3"] if go else ["steps=3"]
        self.proc = self.slurm.srun(
            "--nodes=2", "--ntasks-per-node=1", *srun_opts,
            *_relaunch(), "--nproc-per-node=2", "--monitor-interval=0.1", *flags,
            str(self.worker), str(self.out), "train", *worker_args,
            out=self.output, cwd=self.tmp,
        )  # fmt: skip

    def text(self) -> str:
        return self.output.read_text(errors="replace") + "\n" + self.slurm.logs()[-6000:]

    def wait(self, timeout: float = 150) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"srun did not end\n{self.text()}") from None

    def training(self, node: str, world: int) -> bool:
        rows = self.steps_of.steps(node)
        return bool(rows) and rows[-1].world == world


@pytest.fixture
def net() -> Iterator[Net]:
    with network(3, tag="sl", octet=216) as created:
        yield created


@pytest.fixture
def slurm(net: Net, tmp_path: Path) -> Iterator[Slurm]:
    require_slurm()
    cluster = Slurm(Hosts(net, ["ctl", "node01", "node02"], tmp_path), tmp_path)
    try:
        yield cluster.start()
    finally:
        cluster.close()


def _ranks_and_worlds(job: Job) -> dict[tuple[str, int], int]:
    return {(s.node, s.rank): s.world for s in job.steps_of.steps()}


def test_srun_two_nodes_trains_with_slurms_environment(slurm: Slurm, tmp_path: Path) -> None:
    job = Job(slurm, tmp_path)
    job.srun()
    assert job.wait() == 0, job.text()
    seen = _ranks_and_worlds(job)
    assert seen == {("node01", 0): 4, ("node01", 1): 4, ("node02", 2): 4, ("node02", 3): 4}
    text = job.output.read_text()
    job_id = text.split("rdzv id ")[1].split()[0]
    assert job_id.endswith(".0"), text  # SLURM_JOB_ID.SLURM_STEP_ID
    assert (
        "relaunch: from Slurm: nnodes=2, node 0 of the step, rdzv endpoint node01:29400 "
        f"(c10d, hosted on this node), rdzv id {job_id}"
    ) in text
    assert text.count("relaunch: summary: the workers succeeded") == 2, text


def test_the_environment_srun_sets_without_slurm(net: Net, tmp_path: Path) -> None:
    """What srun gave each task in the test above (Slurm 22.05), given by hand."""
    hosts = Hosts(net, ["ctl", "node01", "node02"], tmp_path)
    cluster = Cluster(tmp_path, backend="c10d", endpoint="")
    worker = tmp_path / "slurm_worker.py"
    worker.write_text(WORKER)
    try:
        for i, node in ((1, "node01"), (2, "node02")):
            env = {
                "SLURM_JOB_ID": "77", "SLURM_JOBID": "77", "SLURM_STEP_ID": "0",
                "SLURM_STEPID": "0", "SLURM_PROCID": str(i - 1), "SLURM_NODEID": str(i - 1),
                "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
                "SLURM_STEP_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1(x2)",
                "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NODELIST": "node[01-02]",
                "SLURM_NODELIST": "node[01-02]", "SLURM_STEP_NODELIST": "node[01-02]",
                "SLURMD_NODENAME": node, "SLURM_CPUS_ON_NODE": "1",
            }  # fmt: skip
            start_plain(cluster, node, hosts.prefix(i), env, "--nproc-per-node=2", script=worker)
        for node in ("node01", "node02"):
            assert cluster.wait_exit(node, timeout=150) == 0, cluster.outputs()
        seen = {(s.node, s.rank): s.world for s in cluster.steps()}
        assert seen == {("node01", 0): 4, ("node01", 1): 4, ("node02", 2): 4, ("node02", 3): 4}
        assert "rdzv endpoint node01:29400 (c10d, hosted on this node), rdzv id 77.0" in (
            cluster.output("node01")
        )
    finally:
        cluster.close()


@pytest.mark.parametrize("lost", ["node", "task"])
def test_a_lost_node_or_task_leaves_the_other_training(
    slurm: Slurm, tmp_path: Path, lost: str
) -> None:
    job = Job(slurm, tmp_path)
    go = tmp_path / "go"
    job.srun(
        "--no-kill", "--kill-on-bad-exit=0", "--wait=0",
        flags=("--nnodes=1:2", "--max-restarts=2", f"--rdzv-conf={HEARTBEAT}"), go=go,
    )  # fmt: skip
    wait_for(
        lambda: job.training("node01", 4) and job.training("node02", 4),
        120, what="both nodes training together", detail=job.text,
    )  # fmt: skip
    if lost == "node":
        slurm.kill_host(2)  # slurmd, slurmstepd, relaunch and its workers of node02
    else:
        agent = next(p for p in slurm.pids(2) if _is_relaunch(p))
        os.kill(agent, 9)  # its workers die with it; the task exits 137
    wait_for(lambda: job.training("node01", 2), 120, what="node01 alone", detail=job.text)
    go.touch()
    code = job.wait()
    text = job.output.read_text()
    assert "relaunch: round 1: a node left; 1 node(s) now (was 2)" in text, job.text()
    assert "relaunch: summary: the workers succeeded" in text, job.text()
    last = job.steps_of.steps("node01")[-1]
    assert (last.world, last.total) == (2, 1 + 2), job.text()
    # srun's status is its worst task's: 0 when the lost node never reported one.
    assert code == (0 if lost == "node" else 137), job.text()


def _is_relaunch(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(part.endswith((b"/relaunch", b"relaunch")) for part in cmdline[:3])


def test_scancel_reaches_the_workers_and_each_node_reports(slurm: Slurm, tmp_path: Path) -> None:
    job = Job(slurm, tmp_path)
    go = tmp_path / "never"
    job.srun(go=go)
    wait_for(
        lambda: job.training("node01", 4) and job.training("node02", 4),
        120, what="both nodes training together", detail=job.text,
    )  # fmt: skip
    (job_id,) = slurm.job_ids()
    slurm.command("scancel", job_id)
    assert job.wait() == 143, job.text()
    terms = sorted(p.name for p in job.out.glob("term_*"))
    assert terms == [f"term_{n}_{r}" for n in ("node01", "node02") for r in (0, 1)], job.text()
    text = job.output.read_text()
    assert text.count("relaunch: stopping the workers (SIGTERM received)") == 2, text
    assert text.count("relaunch: summary: the run ended (stopped)") == 2, text
    assert text.count("relaunch: error: stopped by signal SIGTERM") == 2, text
    wait_for(lambda: not slurm.job_ids(), 60, what="the job gone", detail=job.text)
