"""Real ``relaunch`` agents as separate processes, and the gloo worker they run.

Each agent is ``python -m relaunch ...`` in a session of its own (so a SIGKILL of its
process group takes its workers too), with its own ``--log-dir`` and output file.
Workers append one line per training step to ``<out>/steps_<node>_<local_rank>.log``::

    step <node> <restart_count> <rank> <world_size> <step> <all_reduce_sum>

so a test sees who trained, at which world size, after how many restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from multinode_support.ports import free_port, free_ports
from multinode_support.stopping import stop_sessions
from multinode_support.waiting import wait_for

__all__ = ["WORKER", "Cluster", "Step", "free_port", "free_ports"]

WORKER = r"""
import os, sys, time
from datetime import timedelta
out, mode = sys.argv[1], sys.argv[2]
args = dict(a.split("=", 1) for a in sys.argv[3:])
env = os.environ
node, restart = env["MN_NODE"], env["TORCHELASTIC_RESTART_COUNT"]
rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=float(args.get("timeout", "30"))))
path = os.path.join(out, f"steps_{node}_{env['LOCAL_RANK']}.log")
log = open(path, "a", buffering=1)
steps = int(args.get("steps", "5"))
until_world = int(args.get("until_world", "0"))
crash = args.get("crash")  # "<rank>:<step>": that rank exits 3 at that step, in attempt 0
hang = args.get("hang")  # "<node>:<local_rank>:<step>": that worker hangs, in attempt 0
go = args.get("go")  # a file: train on until it exists, then ``steps`` more steps
end_crash = args.get("end_crash")  # a rank: it exits 3 a second after the end, in attempt 0
linger = args.get("linger")  # "<node>:<file>": that node's workers end once the file exists
step = done = 0
while True:
    # The go file is seen through the all_reduce: every rank stops after the same step
    # (each checking it alone, one could stop a step early and wait in the barrier
    # while another waited in its all_reduce: a timeout and a restart).
    t = torch.tensor([float(rank + 1), float(bool(go) and os.path.exists(go))])
    dist.all_reduce(t)
    go_seen = t[1].item() > 0
    log.write(f"step {node} {restart} {rank} {world} {step} {int(t[0].item())}\n")
    if crash and restart == "0" and crash == f"{rank}:{step}":
        os._exit(3)
    if hang and restart == "0" and hang == f"{node}:{env['LOCAL_RANK']}:{step}":
        time.sleep(100000)  # stuck in C: no Python code runs (the agents' hang watch)
    step += 1
    if (until_world and world != until_world) or (go and not go_seen):
        time.sleep(0.05)  # trains on at this size until the agents restart us
        continue
    done += 1
    if done >= steps:
        break
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
if end_crash == str(rank) and restart == "0":
    time.sleep(1.0)  # the other nodes' workers are done by then
    os._exit(3)
if linger and linger.startswith(node + ":"):
    for _ in range(1200):
        if os.path.exists(linger.split(":", 1)[1]):
            break
        time.sleep(0.05)
"""


@dataclass(frozen=True)
class Step:
    node: str
    restart: int
    rank: int
    world: int
    step: int
    total: int


class Cluster:
    """Agents of one job; ``close()`` stops and reaps every one of them."""

    def __init__(self, tmp: Path, *, backend: str, endpoint: str, run_id: str = "job") -> None:
        self.tmp = tmp
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.script = tmp / "worker.py"
        self.script.write_text(WORKER)
        self.out = tmp / "steps"
        self.out.mkdir()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self,
        node: str,
        *worker_args: str,
        nnodes: str = "2",
        nproc: int = 2,
        max_restarts: int = 0,
        conf: str = "",
        local_addr: str = "127.0.0.1",
        warm: bool = False,
        prefix: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
        mode: str = "train",
        flags: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        """Start agent ``node`` (``prefix``: e.g. ``ip netns exec NS``)."""
        rdzv_conf = ",".join(c for c in ("join_timeout=60,last_call_timeout=1", conf) if c)
        cmd = [
            *prefix, sys.executable, "-m", "relaunch",
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            f"--rdzv-backend={self.backend}", f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}", f"--rdzv-conf={rdzv_conf}", f"--local-addr={local_addr}",
            "--monitor-interval=0.1", "--shutdown-timeout=5",
            "--warm-standby" if warm else "--no-warm-standby",
            f"--log-dir={self.tmp / f'logs_{node}'}", *flags,
            str(self.script), str(self.out), mode, *worker_args,
        ]  # fmt: skip
        env = {
            **os.environ,
            "MN_NODE": node,
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        with open(self.tmp / f"agent_{node}.out", "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.procs[node] = proc
        return proc

    # -- what happened ----------------------------------------------------------------

    def steps(self, node: str | None = None) -> list[Step]:
        rows = []
        for path in sorted(self.out.glob("steps_*.log")):
            for line in path.read_text(errors="replace").splitlines():
                parts = line.split()
                if len(parts) != 7 or parts[0] != "step":
                    continue  # a line being written
                restart, rank, world, step, total = (int(p) for p in parts[2:])
                row = Step(parts[1], restart, rank, world, step, total)
                if node is None or row.node == node:
                    rows.append(row)
        return rows

    def output(self, node: str) -> str:
        return (self.tmp / f"agent_{node}.out").read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- agent {n} ---\n{self.output(n)[-4000:]}" for n in self.procs)

    def events(self, node: str) -> list[dict[str, object]]:
        docs = []
        for path in sorted((self.tmp / f"logs_{node}").glob("*/events.jsonl")):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    docs.append(json.loads(line))
                except ValueError:
                    continue
        return docs

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = 90) -> None:
        """Wait until ``predicate()`` is true; fail naming ``what`` with the agents' output."""
        wait_for(predicate, timeout, what=what, detail=self.outputs)

    def wait_exit(self, node: str, timeout: float = 90) -> int:
        try:
            return self.procs[node].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {node} did not exit\n{self.outputs()}") from None

    # -- faults and cleanup -----------------------------------------------------------

    def kill(self, node: str) -> None:
        """SIGKILL agent ``node`` and its workers (its whole process group)."""
        proc = self.procs[node]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def close(self) -> None:
        stop_sessions(self.procs.values(), grace=20)
