"""A lost node by kind (the store's host, an etcd member, any other), relaunch's
embedded store against torchrun's c10d, side by side in the same run.

    python bench/store_host_lost.py [--runs 2] [--nodes 4] [--idle 10] [--load 2] [--kinds host]
    python bench/store_host_lost.py --sequence 6 [--gap 1:5] [--load 2]
    python bench/store_host_lost.py --floor [--idle 20] [--nodes 8]
    python bench/store_host_lost.py --quorum [--runs 3] [--nodes 4] [--load 2]

``--nodes`` agents on this machine (loopback, in a network namespace of their own)
x 1 worker of a tiny DDP job on gloo (a step: an all-reduce and 50 ms of sleep),
``--nnodes=N-1:N``, c10d endpoint on node 0. relaunch runs with
``--rdzv-conf store_members=auto`` (3 etcd members among the agents); torchrun with
a store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; without it torchrun's
restarted workers hang). For each kind of node, a fresh job: once every node
trains, SIGKILL that node (its agent, workers and etcd member: the machine is
gone); measured: the time until every surviving node trained a step at the smaller
size. Also the embedded store's CPU at idle (its etcd and keeper processes, per node,
over ``--idle`` seconds of training) and the calls its members handled a second then,
by etcd's method (their /metrics); with ``--floor``, only that, then again with every
agent stopped (etcd with no client); with ``--quorum``, two of the three members
SIGKILLed at once (with torchrun: the store's host and another node), and the time
until every surviving agent exited, and how (the line it ended with). Run by hand,
not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import busy_loops, calls_line, etcd_calls, free_port, in_loopback_netns, median

from relaunch.procs._sys import descendants
from relaunch.store._etcd_member import healthy

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
        self.script = out / "train.py"
        self.script.write_text(TRAIN)
        self.port = free_port()
        self.launcher = launcher
        self.procs: list[subprocess.Popen[bytes]] = []
        for i in range(nodes):
            self.start(self.port)
            time.sleep(0.3 if i == 0 else 0.1)

    def start(self, port: int) -> int:
        """Start one more node (its agent), its endpoint on ``port``; its index."""
        i = len(self.procs)
        head = [sys.executable, "-m",
                "relaunch" if self.launcher == "relaunch" else "torch.distributed.run"]  # fmt: skip
        conf = ["--rdzv-conf=store_members=auto"] if self.launcher == "relaunch" else []
        cmd = [*head, f"--nnodes={self.nodes - 1}:{self.nodes}", "--nproc-per-node=1",
               "--max-restarts=100", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=bench", "--local-addr=127.0.0.1", "--monitor-interval=0.1", *conf,
               str(self.script), str(self.out)]  # fmt: skip
        env = {**os.environ, "BENCH_NODE": str(i), "OMP_NUM_THREADS": "1",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo",
               # what an agent leaves (a SIGKILLed one cannot remove its run dir)
               # goes with the bench's directory
               "TMPDIR": str(self.out)}  # fmt: skip
        with open(self.out / f"agent_{i}.out", "wb") as log:
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        return i

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

    def members(self) -> dict[int, int]:
        """Nodes running an etcd member (their keeper names the agent's pid), with the
        member's client port (an endpoint for a node that joins later)."""
        found = subprocess.run(["pgrep", "-af", "relaunch.store._etcd_keeper"],
                               capture_output=True, text=True, check=False).stdout  # fmt: skip
        nodes = {p.pid: i for i, p in enumerate(self.procs)}
        members = {}
        for line in found.splitlines():
            words = line.split()  # python -m relaunch.store._etcd_keeper AGENT_PID ...
            if "--listen-client-urls" not in words:
                continue
            agent = words[words.index("relaunch.store._etcd_keeper") + 1]
            if agent.isdigit() and int(agent) in nodes:
                url = words[words.index("--listen-client-urls") + 1]
                members[nodes[int(agent)]] = int(url.rsplit(":", 1)[1])
        return members

    def kill(self, node: int) -> None:
        """SIGKILL the node whole; its memory (the etcd member's data) goes with it."""
        proc = self.procs[node]
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        for path in glob.glob(f"/dev/shm/relaunch-*-{proc.pid}-*"):
            shutil.rmtree(path, ignore_errors=True)

    def etcd_cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each of the embedded store's processes (etcd and
        its keeper), by ``pid:name``."""
        found = subprocess.run(["pgrep", "-f", "relaunch.store._etcd_keeper|etcdbin/etcd"],
                               capture_output=True, text=True, check=False).stdout.split()  # fmt: skip
        used = {}
        for pid in found:
            with contextlib.suppress(OSError):
                name, rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
                fields = rest.split()
                clock = os.sysconf("SC_CLK_TCK")
                used[f"{pid}:{name.split('(')[-1]}"] = (int(fields[11]) + int(fields[12])) / clock
        return used

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


@contextlib.contextmanager
def _training(launcher: str, nodes: int) -> Iterator[Job]:
    """A fresh job of ``nodes`` nodes, every one training (settled 2 s more); closed,
    its directory removed, at the end."""
    out = Path(tempfile.mkdtemp(prefix="relaunch-bench-lost-"))
    job = Job(launcher, nodes, out)
    try:
        if _wait_training(job, list(range(nodes)), nodes, 0.0, 120) is None:
            raise RuntimeError(f"{launcher}: the job never trained at {nodes} nodes")
        time.sleep(2.0)
        yield job
    finally:
        job.close()
        shutil.rmtree(out, ignore_errors=True)


def one(
    launcher: str, kind: str, nodes: int, limit: float, idle: float
) -> tuple[float | None, float | None]:
    cpu = None
    with _training(launcher, nodes) as job:
        if launcher == "relaunch" and idle > 0:
            cpu = _idle(job, idle)
        members = list(job.members()) if launcher == "relaunch" else [0]
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
        at = _wait_training(job, left, nodes - 1, t0, limit)
        return (None if at is None else at - t0), cpu


def _idle(job: Job, seconds: float) -> float:
    """The embedded store's CPU over ``seconds`` (% of a core per node), its members'
    and their calls printed."""
    ports = list(job.members().values())
    before, calls = job.etcd_cpu(), etcd_calls(ports)
    time.sleep(seconds)
    after, calls = job.etcd_cpu(), etcd_calls(ports) - calls
    used = {p: after[p] - before.get(p, 0.0) for p in after}
    members = sorted((u / seconds * 100 for p, u in used.items() if p.endswith(":etcd")),
                     reverse=True)  # fmt: skip
    print("    etcd members: " + ", ".join(f"{u:.2f}%" for u in members) + " of a core")
    print(f"    calls a second at idle, all members: {calls_line(calls, seconds)}")
    return sum(used.values()) / seconds / job.nodes * 100


def floor(args: argparse.Namespace) -> None:
    """``--floor``: the embedded store's CPU at idle, then with every agent stopped
    (SIGSTOP: no calls; the workers and the members run on): what etcd costs with no
    client, and so what the clients' calls cost."""
    with _training("relaunch", args.nodes) as job:
        print(f"{args.nodes} nodes, load {args.load}, {args.idle:.0f} s each; training:")
        training = _idle(job, args.idle)
        for proc in job.procs:
            proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(4.0)  # (their last calls answered)
            print("every agent stopped:")
            alone = _idle(job, args.idle)
        finally:
            for proc in job.procs:
                proc.send_signal(signal.SIGCONT)
        print(f"embedded store CPU per node: {training:.2f}% training, {alone:.2f}% with no "
              f"client: the calls {training - alone:.2f}%")  # fmt: skip


def sequence(args: argparse.Namespace) -> None:
    """``--sequence K``: one relaunch job loses K nodes one after another, the kinds of
    ``--kinds`` in turn (``host``: the endpoint's node while it lives, then any member),
    each SIGKILLed ``--gap A:B`` seconds after the job trained again at full size; a
    replacement node is started at once (as a scheduler would), its endpoint a live
    member's address. Prints each loss's recovery (every survivor training at N-1), the
    replacement's rejoin (every node training at N again), and for a member's loss the
    time until as many members answer healthy as before it (the window in which a second
    member's loss takes the quorum)."""
    lo, hi = (float(x) for x in args.gap.split(":"))
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    out = Path(tempfile.mkdtemp(prefix="relaunch-bench-lost-"))
    job = Job("relaunch", args.nodes, out)
    took: dict[str, list[float]] = {kind: [] for kind in kinds}
    refills: list[float | None] = []
    refill: _Refill | None = None
    kept = False
    print(f"{args.nodes} nodes x 1 worker, --nnodes={args.nodes - 1}:{args.nodes}, load "
          f"{args.load}, {args.sequence} nodes lost in sequence, {args.gap} s apart")  # fmt: skip
    try:
        live = list(range(args.nodes))
        if _wait_training(job, live, args.nodes, 0.0, 120) is None:
            raise RuntimeError("the job never trained at full size")
        for k in range(args.sequence):
            time.sleep(rng.uniform(lo, hi))
            kind = kinds[k % len(kinds)]
            members = job.members()
            voting = [m for m in live if m in members]
            others = [n for n in live if n not in members]
            if kind == "host" and 0 in live:
                victim = 0
            elif kind == "other" and others:
                victim = rng.choice(others)
            else:
                victim = rng.choice(voting or live)
            if refill is not None:  # the last member's loss: its seat, if filled by now
                refills.append(refill.finish())
            want = _healthy_members(job, live)
            t0 = time.time()
            job.kill(victim)
            live.remove(victim)
            refill = _Refill(job, live, want, t0) if victim in members else None
            at = _wait_training(job, live, args.nodes - 1, t0, args.limit)
            if at is None:
                print(f"{k + 1:>3} {kind:<7} node {victim}: not training again in "
                      f"{args.limit:g} s: job lost (the agents' logs: {out})")  # fmt: skip
                kept = True
                return
            endpoint = next(iter(job.members().values()), job.port)
            t1 = time.time()
            live.append(job.start(endpoint))
            back = _wait_training(job, live, args.nodes, t1, args.limit)
            took[kind].append(at - t0)
            shown = "not back" if back is None else f"{back - t1:.2f} s"
            print(f"{k + 1:>3} {kind:<7} node {victim}: survivors training in {at - t0:.2f} s; "
                  f"a replacement back in {shown}")  # fmt: skip
            if back is None:
                return
        for kind, got in took.items():
            if got:
                print(f"{kind}: median {median(got):.2f} s, max {max(got):.2f} s, of {len(got)}")
        if refill is not None:
            refills.append(refill.finish(wait=True))
            refill = None
        _print_refills(refills)
    finally:
        if refill is not None:  # the job was lost
            refills.append(refill.finish())
            _print_refills(refills)
        job.close()
        if not kept:
            shutil.rmtree(out, ignore_errors=True)


def quorum(args: argparse.Namespace) -> None:
    """``--quorum``: a majority of the store lost at once; seconds from the SIGKILLs until
    each survivor's agent exited, by kind (a member left, a node that is no member)."""
    print(f"{args.nodes} nodes x 1 worker, load {args.load}; two of three members SIGKILLed "
          f"at once (torchrun: the store's host and another node); seconds until each "
          f"surviving agent exited")  # fmt: skip
    for launcher in ("relaunch", "torchrun"):
        if args.only not in (None, launcher):
            continue
        for run in range(args.runs):
            with _training(launcher, args.nodes) as job:
                members = sorted(job.members()) if launcher == "relaunch" else [0, 1]
                lost = members[:2]
                t0 = time.monotonic()
                for node in lost:
                    job.kill(node)
                left = [n for n in range(args.nodes) if n not in lost]
                took = {n: f"not in {args.limit:.0f} s" for n in left}
                running = set(left)
                while running and time.monotonic() - t0 < args.limit:
                    for n in [n for n in running if job.procs[n].poll() is not None]:
                        took[n] = f"{time.monotonic() - t0:.2f} s"
                        running.discard(n)
                    time.sleep(0.02)
                said = [_last_error(job, n) for n in left]
                kinds = ["member" if n in members else "other" for n in left]
                print(f"{launcher} run {run + 1}: " + "; ".join(
                    f"node {n} ({k}) {took[n]}" for n, k in zip(left, kinds, strict=True)))  # fmt: skip
                print("    " + "\n    ".join(sorted(set(said))))


def _last_error(job: Job, node: int) -> str:
    lines = (job.out / f"agent_{node}.out").read_text(errors="replace").splitlines()
    errors = [x for x in lines if x.startswith(("relaunch: error:", "torch.distributed"))]
    return (errors[-1] if errors else (lines[-1] if lines else "(nothing)"))[:160]


def _healthy_members(job: Job, live: list[int]) -> int:
    """How many of the ``live`` nodes run an etcd member that answers healthy (a lost
    node's member may outlive it a moment: its keeper stops it when it sees the agent
    gone)."""
    ports = [p for n, p in job.members().items() if n in live]
    return sum(healthy(f"http://127.0.0.1:{p}", timeout=0.5) for p in ports)


class _Refill:
    """Polls, from the loss at ``t0`` on, until ``want`` etcd members of ``live`` nodes
    (a list the caller extends with the replacement) answer healthy again."""

    def __init__(self, job: Job, live: list[int], want: int, t0: float) -> None:
        self._job, self._live, self._want, self._t0 = job, live, want, t0
        self._at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-refill", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            if _healthy_members(self._job, list(self._live)) >= self._want:
                self._at = time.time()
                return

    def finish(self, *, wait: bool = False) -> float | None:
        """Seconds from the loss until the seat was filled; None when it was not by now
        (the next loss is about to come: the sequence never waits for this poll), or
        within 60 s of the loss with ``wait``."""
        if wait:
            self._thread.join(timeout=max(0.0, self._t0 + 60.0 - time.time()))
        self._stop.set()
        self._thread.join(timeout=10.0)
        return None if self._at is None else self._at - self._t0


def _print_refills(refills: list[float | None]) -> None:
    filled = [r for r in refills if r is not None]
    if not refills:
        return
    tail = (
        f", {len(refills) - len(filled)} not filled before the next loss"
        if len(filled) < len(refills)
        else ""
    )
    shown = ", ".join("-" if r is None else f"{r:.2f}" for r in refills)
    if filled:
        print(f"a lost member's seat filled again (healthy): median {median(filled):.2f} s, "
              f"max {max(filled):.2f} s, of {len(filled)}{tail} ({shown})")  # fmt: skip
    else:
        print(f"a lost member's seat never filled before the next loss ({shown})")


def _wait_training(
    job: Job, nodes: list[int], world: int, after: float, limit: float
) -> float | None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        at = job.training_at(nodes, world, after)
        if at is not None:
            return at
        time.sleep(0.05)
    return None


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
    parser.add_argument("--sequence", type=int, default=0, metavar="K",
                        help="relaunch only: one job loses K nodes one after another")  # fmt: skip
    parser.add_argument("--gap", default="1:5", help="seconds between recovery and next loss")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--floor", action="store_true",
                        help="relaunch only: the store's CPU at idle, then with no client")  # fmt: skip
    parser.add_argument("--quorum", action="store_true",
                        help="two of three members lost at once: how each survivor ends")  # fmt: skip
    args = parser.parse_args()
    unknown = set(args.kinds.split(",")) - {"host", "member", "other"}
    if unknown:
        parser.error(f"--kinds: expected host, member or other, got {sorted(unknown)}")
    in_loopback_netns()
    with busy_loops(args.load):
        if args.floor:
            floor(args)
        elif args.quorum:
            quorum(args)
        elif args.sequence:
            sequence(args)
        else:
            _table(args)


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
