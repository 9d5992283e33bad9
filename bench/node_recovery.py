"""Tiered recovery, node tier: a whole node SIGKILLed, a spare takes its place, vs torchrun.

    python bench/node_recovery.py --faults 3 --gap 1:5 [--load 2] [--seed 1]

The 2x2 gloo job of ``tiered_recovery.py`` (two agents of two workers on this host, c10d
on 127.0.0.1) plus a spare agent, side by side in one run:

(a) ``relaunch --max-restarts N``, training function wrapped by
    ``relaunch.inprocess.Wrapper``: the rendezvous leaves the lost node's rank vacant,
    the spare takes it, its workers (forked from the fork server it started while
    waiting) join the survivors' next in-process iteration and get the model,
    optimizer state and step from a survivor (``inprocess.broadcast_state``);
(b) ``torchrun --max-restarts N`` with a spare: the survivors' workers fail, every
    worker restarts, the spare joins the next round; the state in memory is lost.

Each fault SIGKILLs the node that does not host the c10d store (its agent and every
process under it: workers, monitor processes, fork server). A new spare starts as soon
as the job is back at full size; the next fault comes ``--gap`` seconds later (so a
short gap may find the spare still starting). Per fault: seconds from the SIGKILL to
every rank having completed a step at full size (world 4) in its new iteration or
process; steps redone; healthy processes restarted.

``--snapshots`` (case a only): every rank also saves a snapshot each step
(``relaunch.checkpoint.save``, whose next save waits until the node's ring successor
holds a copy); per fault, the longest pause of any rank between two steps from full
size until the next fault. Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import JsonLines, fmt, free_port, in_loopback_netns
from tiered_recovery import PY, TRAIN, Fault, again, print_results, wait_until

from relaunch.procs._sys import descendants


class Job:
    """The launchers of one case: a host node, a second node, spares; by start order."""

    def __init__(
        self, kind: str, out: Path, script: str, restarts: int, snapshots: bool = False
    ) -> None:
        self.kind, self.out, self.script, self.restarts = kind, out, script, restarts
        self.snapshots = snapshots
        self.port = free_port()
        self.nodes: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        a = self.kind == "a"
        launcher = [PY, "-m", "relaunch"] if a else [PY, "-m", "torch.distributed.run"]
        logs = self.out / f"logs{len(self.nodes)}"
        ours = ["--local-addr=127.0.0.1", f"--log-dir={logs}"] if a else []
        cmd = [
            *launcher, "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id=node{self.port}",
            f"--max-restarts={self.restarts}", "--monitor-interval=0.1", *ours,
            self.script, "inprocess" if a else "plain", str(self.out),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "BENCH_SNAPSHOTS": "1" if a and self.snapshots else "0"}  # fmt: skip
        with (self.out / f"launcher{len(self.nodes)}.txt").open("wb") as log:
            proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.nodes.append(proc)
        return proc

    def kill_node(self, proc: subprocess.Popen[bytes]) -> None:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> bool:
        (self.out / "finish").write_text("")
        ok = True
        for proc in self.nodes:
            if proc.returncode is not None:
                continue
            try:
                ok = proc.wait(60) == 0 and ok
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                ok = False
        return ok


def run(kind: str, args: argparse.Namespace, script: str) -> tuple[list[Fault], bool]:
    rng = random.Random(args.seed)
    lo, hi = (float(x) for x in args.gap.split(":"))
    faults: list[Fault] = []
    with tempfile.TemporaryDirectory(prefix="relaunch_node_") as tmp:
        out = Path(tmp)
        if args.keep:
            out = Path(args.keep) / kind
            out.mkdir(parents=True)
        job = Job(kind, out, script, args.faults + 1, args.snapshots)
        pauses: list[float] = []
        rows = JsonLines(out)
        try:
            job.start()
            time.sleep(0.5)  # the first one hosts the c10d store
            second = job.start()
            wait_until(
                lambda: {r["rank"] for r in rows.poll() if r["step"] >= 20} == {0, 1, 2, 3},
                180,
                "the job to train",
                out,
            )
            spare = job.start()
            time.sleep(args.spare_wait)
            recovered: float | None = None  # when the job was at full size again
            for _ in range(args.faults):
                time.sleep(rng.uniform(lo, hi))
                if recovered is not None and args.snapshots:
                    pauses.append(longest_pause(rows.poll(), recovered, time.time()))
                    print(f"    ({kind}) longest pause of a rank from full size to the next "
                          f"fault: {pauses[-1]:.2f} s", flush=True)  # fmt: skip
                latest = {r["rank"]: r for r in rows.poll() if r["world"] == 4}
                before = {r: (x["pid"], x["it"]) for r, x in latest.items()}
                last_step = max(x["step"] for x in latest.values())
                survivors = {latest[r]["pid"] for r in (0, 1)}
                t0 = time.time()
                job.kill_node(second)
                end = time.monotonic() + 180
                while (first := again(rows, t0, before)) is None:
                    if time.monotonic() > end:
                        raise RuntimeError(f"({kind}) not at full size again after 180 s")
                    time.sleep(0.02)
                full = max(r["t"] for r in first.values()) - t0
                recovered = t0 + full
                lost = max(0, last_step + 1 - min(r["step"] for r in first.values()))
                restarted = len(survivors - {first[r]["pid"] for r in (0, 1)})
                faults.append(Fault(2, full, lost, restarted))
                print(
                    f"    ({kind}) SIGKILL node 1: full size in {full:.2f} s, {lost} steps "
                    f"redone, {restarted} healthy processes restarted",
                    flush=True,
                )
                second, spare = spare, job.start()  # the spare is node 1 now; a new spare
            if recovered is not None and args.snapshots:
                time.sleep(rng.uniform(lo, hi))
                pauses.append(longest_pause(rows.poll(), recovered, time.time()))
                print(f"    ({kind}) longest pause of a rank from full size on: "
                      f"{pauses[-1]:.2f} s", flush=True)  # fmt: skip
        finally:
            ok = job.stop()
    if pauses:
        print(f"  ({kind}) longest pause after recovery: {fmt(pauses)}")
    return faults, ok


def longest_pause(rows: list[dict[str, Any]], start: float, end: float) -> float:
    """The longest time one rank went without a step at full size in [start, end] (a
    rank that stopped stepping: until ``end``)."""
    longest = 0.0
    for rank in {r["rank"] for r in rows}:
        times = sorted(r["t"] for r in rows if r["rank"] == rank and r["world"] == 4)
        times = [start, *(t for t in times if start <= t <= end), end]
        longest = max([longest, *(b - a for a, b in itertools.pairwise(times))])
    return longest


def main() -> None:
    in_loopback_netns()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--faults", type=int, default=3)
    parser.add_argument("--gap", default="1:5", help="seconds after recovery, MIN:MAX")
    parser.add_argument("--spare-wait", type=float, default=10.0, help="before the 1st fault")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the job")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cases", default="ab")
    parser.add_argument("--keep", help="keep the launchers' output and the step logs here")
    parser.add_argument("--snapshots", action="store_true",
                        help="(a) saves a snapshot every step; prints the pauses after recovery")  # fmt: skip
    args = parser.parse_args()
    load = [
        subprocess.Popen([PY, "-c", "while True: pass"], start_new_session=True)
        for _ in range(args.load)
    ]
    try:
        with tempfile.TemporaryDirectory(prefix="relaunch_node_") as tmp:
            script = os.path.join(tmp, "train.py")
            Path(script).write_text(TRAIN)
            print(
                f"SIGKILL of the non-host node with a spare waiting, {args.faults} faults, "
                f"gap {args.gap} s, load {args.load}, seed {args.seed}"
            )
            print("  (a) relaunch, tiered (the spare's workers join in-process)")
            print("  (b) torchrun, process restart with the spare")
            results = {kind: run(kind, args, script) for kind in args.cases}
        print_results(results)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
