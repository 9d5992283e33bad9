"""Goodput under a fixed fault rate: relaunch with a snapshot every step against
torchrun with the script's own disk checkpoints every K steps, in the same run.

    python bench/goodput.py [--steps 600] [--step-time 0.05] [--fault-every 8] [--every 50]
                            [--params 10] [--nodes 2 --nproc 1 --node-kill-every 2]
                            [--device cuda --backend nccl] [--launchers relaunch]

``--nodes`` agents of the launcher on this machine (each with a snapshot directory of
its own in /dev/shm, node memory, as relaunch's default; gloo over loopback),
``--nproc`` workers each (``examples/snapshots.py``: DDP, a step of ``--step-time``
seconds of sleep beside its compute), ``--max-restarts``
enough for every fault. A fault every ``--fault-every`` seconds, the same schedule for
both launchers: a SIGKILL of a random worker, or, every ``--node-kill-every``-th fault,
of a whole node: its agent and every process under it, then its snapshot directory is
deleted (its machine is gone) and a replacement node is started at once, as a
scheduler would (``--spares S``: relaunch also starts S spare agents, which take a lost
node's ranks; torchrun has none). The node killed runs workers and is never the first, which hosts the c10d store (its
loss ends the job under both launchers: issue 24). Six runs: each launcher with no
checkpoint at all, with its checkpoints and no fault, and with faults. Prints per
launcher: wall times, faults, goodput (fault-free time / wall time with faults), steps
redone per fault (step executions beyond ``--steps``, per fault), and the cost of
saving per step (fault-free wall time against the same script with no checkpoint at
all, per step), the seconds of wall time each fault cost (faulted against fault-free),
and from that the goodput at one fault a minute ("@1/min": one minus that cost over 60
s, times the no-checkpoint time over the fault-free time, so that saving counts).
``--elastic``: both launchers run ``--nnodes 1:NODES``, so a lost node shrinks the
world until its replacement joins and grows it; ``--replicated``: the script restores
its snapshots with ``load(replicated=True)``, which crosses those changes of size (without
it, each change starts relaunch's job afresh; torchrun's script restores rank 0's disk
checkpoint in any world). ``--params M``: a model of about M million parameters (Adam: its state is 3x that)
instead of the example's tiny one. ``--device cuda --backend nccl --nproc 1``: on a GPU
(snapshots through pinned memory, beside the next step). ``--launchers relaunch``: one
launcher only. ``--load N``: N busy processes beside every run (the clean ones too).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import busy_loops, free_port, in_loopback_netns

from relaunch.procs._sys import descendants

SHM = "/dev/shm"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "snapshots.py"


class Cluster:
    """The agents of one run, one per simulated node, each with its snapshot directory."""

    def __init__(
        self, launcher: str, args: argparse.Namespace, out: Path, shm: Path, script: list[str]
    ):
        self.launcher, self.args, self.out, self.script = launcher, args, out, script
        self.shm = shm
        self.port = free_port()
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.dirs: list[Path] = []
        self.started = 0
        try:
            for index in range(args.nodes + (args.spares if launcher == "relaunch" else 0)):
                self.nodes.append(self._start())
                self.dirs.append(self._dir)
                if index == 0:
                    self._wait_listening()
        except BaseException:
            self.close()  # the agents started so far
            raise

    def _start(self) -> subprocess.Popen[bytes]:
        self.started += 1
        # node memory, as relaunch's default (a directory on disk would add a file
        # system's writes and fsync to every save)
        self._dir = self.shm / f"snapshots-{self.started}"
        head = [sys.executable, "-m", "relaunch"] if self.launcher == "relaunch" else ["torchrun"]
        extra = [f"--snapshot-dir={self._dir}"] if self.launcher == "relaunch" else []
        if self.args.rdzv_conf:
            extra.append(f"--rdzv-conf={self.args.rdzv_conf}")
        cmd = [
            *head, f"--nnodes={'1:' if self.args.elastic else ''}{self.args.nodes}",
            f"--nproc-per-node={self.args.nproc}",
            "--max-restarts=1000", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=goodput", *extra, *self.script,
        ]  # fmt: skip
        # torchrun recovers only with a store of its own per round (without it, its
        # restarted workers hang: bench/launch_recovery.py)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "TMPDIR": str(self.out),
        }
        with open(self.out / f"agent-{self.started}.out", "wb") as log:
            return subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"{self.launcher}: the first agent never listened")

    def running(self) -> bool:
        return any(p.poll() is None for p in self.nodes)

    def pick_node(self, rng: random.Random) -> int:
        """A node that runs workers (not a waiting spare) and does not host the store."""
        latest = {int(str(r["pid"])) for r in _rows(self.out) if "pid" in r}
        busy = [
            i for i in range(1, len(self.nodes)) if latest & set(descendants(self.nodes[i].pid))
        ]
        return rng.choice(busy or list(range(1, len(self.nodes))))

    def kill_node(self, index: int) -> None:
        """SIGKILL node ``index`` whole, delete its snapshots, start its replacement."""
        proc = self.nodes[index]
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(self.dirs[index], ignore_errors=True)
        self.nodes[index] = self._start()
        self.dirs[index] = self._dir

    def close(self) -> int | None:
        for proc in self.nodes:
            if proc.poll() is None:
                for pid in [proc.pid, *descendants(proc.pid)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
        return self.nodes[0].returncode if self.nodes else None


def run(launcher: str, args: argparse.Namespace, faults: bool, mode: str) -> dict[str, float]:
    """One job; ``mode``: "snapshot" (every step), "disk" (every K steps) or "none"."""
    out = Path(tempfile.mkdtemp(prefix="relaunch-goodput-"))
    shm = Path(
        tempfile.mkdtemp(prefix="relaunch-goodput-", dir=SHM if os.path.isdir(SHM) else None)
    )
    script = [str(EXAMPLE), "--steps", str(args.steps), "--sleep", str(args.step_time),
              "--log-to", str(out), "--params", str(args.params),
              "--device", args.device, "--backend", args.backend]  # fmt: skip
    if mode == "disk":
        script += ["--disk-every", str(args.every), "--disk-dir", str(out)]
    elif mode == "none":
        script += ["--disk-every", str(10**9), "--disk-dir", str(out)]
    elif args.replicated:
        script += ["--replicated"]
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    try:
        cluster = Cluster(launcher, args, out, shm, script)
    except BaseException:  # a launcher that cannot start (not installed): nothing left
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        raise
    killed = {"worker": 0, "node": 0}
    kills: list[float] = []
    finished = True
    try:
        next_fault = t0 + args.fault_every
        while cluster.running():
            time.sleep(0.05)
            if time.monotonic() - t0 > args.limit:
                print(f"  note: {launcher} {mode} did not finish in {args.limit:g} s: stopped")
                finished = False
                break
            if faults and time.monotonic() >= next_fault:
                every = args.node_kill_every
                if every and (sum(killed.values()) + 1) % every == 0:
                    kills.append(time.time())
                    cluster.kill_node(cluster.pick_node(rng))
                    killed["node"] += 1
                elif _kill_worker(out, rng):
                    kills.append(time.time())
                    killed["worker"] += 1
                next_fault = time.monotonic() + args.fault_every
        wall = time.monotonic() - t0
        rows = _rows(out)
        executed = sum(1 for r in rows if r.get("rank") == 0 and "step" in r)
        parts = _restart_parts(rows, kills)
    finally:
        rc = cluster.close()
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if rc != 0:
        print(f"  note: {launcher} {mode}: the first node exited {rc}")
    return {"wall": wall, "faults": sum(killed.values()), "nodes": killed["node"],
            "executed": executed, "finished": finished, "parts": parts}  # fmt: skip


PARTS = ("exec", "imported", "group", "loaded", "built", "stepped")


def _restart_parts(rows: list[dict[str, Any]], kills: list[float]) -> list[list[float]]:
    """Per restart of rank 0 (attempt > 0): the seconds from the fault before it to the
    new process, then between the example's phases (imported torch, process group up,
    snapshot loaded, model and optimizer built from it) and to its first step's end."""
    found = []
    for row in rows:
        phases = row.get("phases")
        if row.get("rank") != 0 or not row.get("attempt") or not isinstance(phases, dict):
            continue
        steps = [
            float(r["t"]) for r in rows
            if r.get("rank") == 0 and r.get("attempt") == row["attempt"] and "step" in r
        ]  # fmt: skip
        before = [k for k in kills if k <= phases["exec"]]
        if not steps or not before:
            continue
        marks = [max(before), *(float(phases[p]) for p in PARTS[:-1]), min(steps)]
        found.append([b - a for a, b in itertools.pairwise(marks)])
    return found


def _kill_worker(out: Path, rng: random.Random) -> bool:
    latest = {r["rank"]: r["pid"] for r in _rows(out) if "pid" in r}
    if not latest:
        return False
    try:
        os.kill(int(latest[rng.choice(sorted(latest))]), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _rows(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in out.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--fault-every", type=float, default=8.0)
    parser.add_argument("--every", type=int, default=50, help="torchrun's checkpoint interval")
    parser.add_argument("--params", type=float, default=0.0,
                        help="the model's size in millions of parameters (0: a tiny one)")  # fmt: skip
    parser.add_argument("--nodes", type=int, default=1, help="agents (simulated nodes)")
    parser.add_argument("--nproc", type=int, default=2, help="workers per node")
    parser.add_argument("--node-kill-every", type=int, default=0, metavar="K",
                        help="every K-th fault kills a whole node (needs --nodes 2 or more)")  # fmt: skip
    parser.add_argument("--spares", type=int, default=0,
                        help="relaunch only: agents beyond --nodes, waiting as spares")  # fmt: skip
    parser.add_argument("--elastic", action="store_true",
                        help="--nnodes 1:NODES: a lost node shrinks the world until its "
                             "replacement joins (both launchers)")  # fmt: skip
    parser.add_argument("--replicated", action="store_true",
                        help="the snapshots are restored with load(replicated=True), "
                             "across the world's size changes")  # fmt: skip
    parser.add_argument("--rdzv-conf", default="",
                        help="passed to both launchers, e.g. last_call_timeout=0.05 (a round "
                             "started again holds its nodes' seats that long)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--limit", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the example trains (cuda: pinned, asynchronous snapshots)")  # fmt: skip
    parser.add_argument("--backend", default="gloo", help="the process group's backend")
    parser.add_argument("--launchers", default="relaunch,torchrun",
                        help="which launchers run, comma-separated")  # fmt: skip
    parser.add_argument("--load", type=int, default=0,
                        help="busy processes beside every run (a node's other work)")  # fmt: skip
    args = parser.parse_args()
    if args.node_kill_every and args.nodes < 2:
        parser.error("--node-kill-every needs --nodes 2 or more (the first node hosts the store)")
    in_loopback_netns()
    with busy_loops(args.load):
        compare(args)


def compare(args: argparse.Namespace) -> None:
    """Each launcher's three runs, and the table."""
    size = f"{args.params:g}M parameters" if args.params else "a tiny model"
    kinds = f", every {args.node_kill_every}th a node" if args.node_kill_every else ""
    print(f"{args.steps} steps of {args.step_time} s, {size}, {args.nodes} node(s) x "
          f"{args.nproc} worker(s), a SIGKILL every {args.fault_every} s{kinds}; "
          f"torchrun's script saves every {args.every} steps; load {args.load}")  # fmt: skip
    print(f"{'launcher':<10} {'clean s':>8} {'faulted s':>10} {'faults':>7} {'nodes':>6} "
          f"{'goodput':>8} {'redone/fault':>13} {'save ms/step':>13} {'lost s/fault':>13} "
          f"{'@1/min':>7}")  # fmt: skip
    chosen = set(args.launchers.split(","))
    parts = {}
    for launcher, mode in (("relaunch", "snapshot"), ("torchrun", "disk")):
        if launcher not in chosen:
            continue
        bare = run(launcher, args, False, "none")
        clean = run(launcher, args, False, mode)
        hit = run(launcher, args, True, mode)
        parts[launcher] = hit["parts"]
        redone = (hit["executed"] - args.steps) / max(hit["faults"], 1)
        save = (clean["wall"] - bare["wall"]) / args.steps * 1e3
        shown = f"{redone:13.1f}" if hit["finished"] else f"{'(unfinished)':>13}"
        # seconds of wall time each fault cost, and the goodput that gives at one
        # fault a minute, the cost of saving included (the bare run's time is the ideal)
        lost = (hit["wall"] - clean["wall"]) / max(hit["faults"], 1)
        projected = max(0.0, 1 - lost / 60) * min(1.0, bare["wall"] / clean["wall"])
        # a run stopped at --limit gives no cost per fault: its wall time is the limit
        cost = f"{lost:13.2f} {projected:7.1%}" if hit["finished"] else f"{'-':>13} {'-':>7}"
        print(f"{launcher:<10} {clean['wall']:8.1f} {hit['wall']:10.1f} {hit['faults']:7.0f} "
              f"{hit['nodes']:6.0f} {clean['wall'] / hit['wall']:8.1%} {shown} "
              f"{save:13.1f} {cost}")  # fmt: skip
    # where a fault's seconds go: the medians over the faulted run's restarts of rank 0
    names = ("fault->exec", "import", "group", "load", "build", "1st step")
    for launcher, found in parts.items():
        if found:
            medians = [statistics.median(col) for col in zip(*found, strict=True)]
            shown = ", ".join(f"{n} {m:.2f}" for n, m in zip(names, medians, strict=True))
            print(f"{launcher}: a restart's parts, s (median of {len(found)}): {shown}")


if __name__ == "__main__":
    main()
