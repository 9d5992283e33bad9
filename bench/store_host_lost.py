"""A lost node by kind (the store's host, an etcd member, any other), relaunch's
embedded store against torchrun's c10d, side by side in the same run.

    python bench/store_host_lost.py [--runs 2] [--nodes 4] [--idle 10] [--load 2] [--kinds host]

``--nodes`` agents on this machine (loopback, in a network namespace of their own)
x 1 worker of a tiny DDP job on gloo (a step: an all-reduce and 50 ms of sleep),
``--nnodes=N-1:N``, c10d endpoint on node 0. relaunch runs with
``--rdzv-conf store_members=auto`` (3 etcd members among the agents); torchrun with
a store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; without it torchrun's
restarted workers hang). For each kind of node, a fresh job: once every node
trains, SIGKILL that node (its agent, workers and etcd member: the machine is
gone); measured: the time until every surviving node trained a step at the smaller
size. Also the embedded store's CPU at idle (its etcd and keeper processes, per node,
over ``--idle`` seconds of training). Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, in_loopback_netns, median

from relaunch.procs._sys import descendants

TRAIN = textwrap.dedent(
    """
    import os, sys, time
    node, world = os.environ["BENCH_NODE"], os.environ["WORLD_SIZE"]
    log = open(os.path.join(sys.argv[1], f"steps_{node}.log"), "a", buffering=1)
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(4)
    while True:
        dist.all_reduce(t)
        log.write(f"{world} {time.time()}\\n")
        time.sleep(0.05)
    """
)


class Job:
    def __init__(self, launcher: str, nodes: int, out: Path) -> None:
        self.out, self.nodes = out, nodes
        script = out / "train.py"
        script.write_text(TRAIN)
        port = free_port()
        head = [
            sys.executable,
            "-m",
            "relaunch" if launcher == "relaunch" else "torch.distributed.run",
        ]
        conf = ["--rdzv-conf=store_members=auto"] if launcher == "relaunch" else []
        self.procs: list[subprocess.Popen[bytes]] = []
        for i in range(nodes):
            cmd = [*head, f"--nnodes={nodes - 1}:{nodes}", "--nproc-per-node=1",
                   "--max-restarts=10", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   "--rdzv-id=bench", "--local-addr=127.0.0.1", "--monitor-interval=0.1", *conf,
                   str(script), str(out)]  # fmt: skip
            env = {**os.environ, "BENCH_NODE": str(i), "OMP_NUM_THREADS": "1",
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo",
                   # what an agent leaves (a SIGKILLed one cannot remove its run dir)
                   # goes with the bench's directory
                   "TMPDIR": str(out)}  # fmt: skip
            with open(out / f"agent_{i}.out", "wb") as log:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
            time.sleep(0.3 if i == 0 else 0.1)

    def steps(self, node: int) -> list[tuple[int, float]]:
        path = self.out / f"steps_{node}.log"
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            parts = line.split()
            if len(parts) == 2:
                with contextlib.suppress(ValueError):
                    rows.append((int(parts[0]), float(parts[1])))
        return rows

    def training_at(self, nodes: list[int], world: int, after: float) -> float | None:
        """When every node of ``nodes`` had trained a step at ``world`` after ``after``."""
        times = []
        for n in nodes:
            later = [t for w, t in self.steps(n) if w == world and t > after]
            if not later:
                return None
            times.append(min(later))
        return max(times)

    def members(self) -> list[int]:
        """Nodes running an etcd member (their keeper names the agent's pid)."""
        found = subprocess.run(["pgrep", "-af", "relaunch.store._etcd_keeper"],
                               capture_output=True, text=True, check=False).stdout  # fmt: skip
        return [i for i, p in enumerate(self.procs) if f"--name 127.0.0.1-{p.pid}-" in found]

    def kill(self, node: int) -> None:
        """SIGKILL the node whole; its memory (the etcd member's data) goes with it."""
        proc = self.procs[node]
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        for path in glob.glob(f"/dev/shm/relaunch-*-{proc.pid}-*"):
            shutil.rmtree(path, ignore_errors=True)

    def etcd_cpu(self) -> float:
        """CPU seconds used so far by the embedded store's processes (etcd, keepers)."""
        found = subprocess.run(["pgrep", "-f", "relaunch.store._etcd_keeper|etcdbin/etcd"],
                               capture_output=True, text=True, check=False).stdout.split()  # fmt: skip
        total = 0.0
        for pid in found:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def close(self) -> None:
        """Stop every agent as a scheduler would (SIGTERM, then SIGKILL after 30 s)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill(i)


def one(
    launcher: str, kind: str, nodes: int, limit: float, idle: float
) -> tuple[float | None, float | None]:
    out = Path(tempfile.mkdtemp(prefix="relaunch-bench-lost-"))
    job = Job(launcher, nodes, out)
    cpu = None
    try:
        deadline = time.monotonic() + 120
        while job.training_at(list(range(nodes)), nodes, 0) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{launcher}: the job never trained at {nodes} nodes")
            time.sleep(0.1)
        time.sleep(2.0)
        if launcher == "relaunch" and idle > 0:
            before = job.etcd_cpu()
            time.sleep(idle)
            cpu = (job.etcd_cpu() - before) / idle / nodes * 100
        members = job.members() if launcher == "relaunch" else [0]
        if kind == "host":
            victim = 0
        elif kind == "member":
            victim = next((m for m in members if m != 0), -1)
        else:
            victim = next((n for n in range(nodes) if n not in members), -1)
        if victim < 0:
            return None, cpu
        t0 = time.time()
        job.kill(victim)
        left = [n for n in range(nodes) if n != victim]
        end = time.monotonic() + limit
        while time.monotonic() < end:
            at = job.training_at(left, nodes - 1, t0)
            if at is not None:
                return at - t0, cpu
            time.sleep(0.05)
        return None, cpu
    finally:
        job.close()
        shutil.rmtree(out, ignore_errors=True)
        with contextlib.suppress(OSError):
            for path in out.iterdir():
                path.unlink()
            out.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds to wait for recovery")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured")
    parser.add_argument("--only", choices=("relaunch", "torchrun"), help="one launcher only")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the job")
    parser.add_argument(
        "--kinds", default="host,member,other", help="the kinds of node lost, comma-separated"
    )
    args = parser.parse_args()
    unknown = set(args.kinds.split(",")) - {"host", "member", "other"}
    if unknown:
        parser.error(f"--kinds: expected host, member or other, got {sorted(unknown)}")
    in_loopback_netns()
    load = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(args.load)
    ]
    try:
        _table(args)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()


def _table(args: argparse.Namespace) -> None:
    print(f"{args.nodes} nodes x 1 worker, --nnodes={args.nodes - 1}:{args.nodes}, load "
          f"{args.load}; seconds from SIGKILL of a node to every survivor training; median "
          f"of {args.runs}")  # fmt: skip
    print(f"{'node lost':<12} {'relaunch':>24} {'torchrun':>24}")
    cpus = []
    for kind in args.kinds.split(","):
        row = {}
        for launcher in ("relaunch", "torchrun"):
            if args.only not in (None, launcher):
                row[launcher] = "-"
                continue
            if launcher == "torchrun" and kind == "member":
                row[launcher] = "-"  # torchrun's store has no members
                continue
            got = []
            for _ in range(args.runs):
                took, cpu = one(
                    launcher, kind, args.nodes, args.limit, args.idle if not cpus else 0
                )
                if cpu is not None:
                    cpus.append(cpu)
                got.append(took)
            done = [g for g in got if g is not None]
            runs = ", ".join(f"{g:.2f}" for g in done)
            row[launcher] = (
                f"{median(done):.2f} s ({runs})"
                if len(done) == len(got)
                else f"lost {len(got) - len(done)} of {len(got)}"
            )
        print(f"{kind:<12} {row['relaunch']:>24} {row['torchrun']:>24}")
    if cpus:
        print(
            f"embedded store CPU at idle: {cpus[0]:.2f}% of a core per node (etcd and its keeper)"
        )


if __name__ == "__main__":
    main()
