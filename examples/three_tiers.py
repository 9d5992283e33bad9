"""One DDP job, three faults, three tiers of recovery; no healthy process restarts.

    python examples/three_tiers.py            # drives the whole demo on this host
    python examples/three_tiers.py --steps 3000 --gap 4
    python examples/three_tiers.py --keep DIR   # the agents' logs, the ranks' steps

It starts a job of two nodes of two gloo workers (two ``relaunch`` agents, c10d on
127.0.0.1) and a spare node, all on this host, with this file as the training script
(``--worker``: DDP wrapped by ``relaunch.inprocess.Wrapper``; every rank keeps its
model and optimizer state in memory and a rank that is new in an iteration takes them
from a survivor with ``inprocess.broadcast_state``). Then it injects, a few seconds
apart:

1. an exception in rank 1: every rank restarts in-process (tier: in-process restart);
2. a SIGKILL of rank 3's process: its agent forks a replacement that joins the others'
   next iteration (tier: process);
3. a SIGKILL of the whole second node (agent, workers, their monitor processes): the
   spare takes its ranks and its workers join the survivors in-process (tier: node);

and prints which tier handled each fault, how long the job took to train again at full
size, how many steps were redone, and whether any healthy process restarted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RANKS = (0, 1, 2, 3)


# -- the training script (one worker) --------------------------------------------------
def worker(out: Path, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from relaunch import inprocess

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    held: dict[str, Any] = {"step": 0}

    @inprocess.Wrapper(
        soft_timeout=datetime.timedelta(seconds=10),
        hard_timeout=datetime.timedelta(seconds=20),
        heartbeat_timeout=datetime.timedelta(seconds=30),
        barrier_timeout=datetime.timedelta(seconds=120),
    )
    def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        assert call_wrapper is not None
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        state = {"model": model.state_dict(), "opt": optimizer.state_dict(), **held}
        # new ranks, and survivors a step behind after a fault, get the state of the
        # survivor with the highest step
        state = inprocess.broadcast_state(call_wrapper, state, version=held["step"])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["opt"])
        held["step"] = state["step"]
        ddp = DistributedDataParallel(model)
        log = (out / f"rank{rank}.jsonl").open("a", buffering=1)
        generator = torch.Generator().manual_seed(rank)
        while held["step"] < final_step(out, steps):
            flag = out / f"raise{rank}"
            if flag.exists():
                flag.unlink()
                raise RuntimeError("injected exception")
            x = torch.randn(32, 32, generator=generator)
            loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            with call_wrapper.atomic():
                optimizer.step()
                held["step"] += 1
            doc = {"t": time.time(), "rank": rank, "world": world, "step": held["step"],
                   "pid": os.getpid(), "it": call_wrapper.iteration}  # fmt: skip
            log.write(json.dumps(doc) + "\n")
            call_wrapper.ping()
            time.sleep(0.02)
        del ddp  # free DDP before its process group
        dist.destroy_process_group()

    train()


def final_step(out: Path, steps: int) -> int:
    """``steps``, or the step the driver wrote in ``stop_at`` after the last fault (every
    rank reads it before it gets there, so every rank ends at the same step)."""
    try:
        return min(steps, int((out / "stop_at").read_text()))
    except (OSError, ValueError):
        return steps


# -- the driver -----------------------------------------------------------------------
def rows(out: Path) -> list[dict[str, Any]]:
    found = []
    for path in out.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


def latest(out: Path) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r for r in sorted(rows(out), key=lambda r: r["t"])}


def back_at_full_size(out: Path, t0: float, timeout: float = 120) -> dict[int, dict[str, Any]]:
    """Each rank's first step at world 4 in a new iteration after ``t0``."""
    before = {r: x["it"] for r, x in latest(out).items()}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        first: dict[int, dict[str, Any]] = {}
        for r in sorted(rows(out), key=lambda r: r["t"]):
            if r["t"] > t0 and r["world"] == 4 and r["it"] != before.get(r["rank"]):
                first.setdefault(r["rank"], r)
        if len(first) == 4:
            return first
        time.sleep(0.05)
    raise SystemExit("the job did not train at full size again within 120 s")


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True)
    children: dict[int, list[int]] = {}
    for line in out.stdout.splitlines():
        p, pp = (int(x) for x in line.split())
        children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--gap", type=float, default=3.0, help="seconds between faults")
    parser.add_argument("--keep", metavar="DIR", help="write the agents' logs and the "
                        "ranks' step records into DIR and keep them (default: a temporary "
                        "directory, removed at the end)")  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.steps)
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with contextlib.ExitStack() as stack:
        if args.keep:
            out = Path(args.keep)
            out.mkdir(parents=True, exist_ok=True)
            if any(out.iterdir()):
                parser.error(f"--keep: {out} is not empty (its step records would mislead)")
        else:
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="three_tiers_")))
        agents: dict[str, subprocess.Popen[bytes]] = {}

        def start(name: str) -> None:
            cmd = [
                sys.executable, "-m", "relaunch", "--nnodes=2", "--nproc-per-node=2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=three-tiers", "--max-restarts=3", "--local-addr=127.0.0.1",
                __file__, "--worker", str(out), "--steps", str(args.steps),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            with (out / f"{name}.log").open("wb") as log:
                agents[name] = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )

        try:
            start("node0")
            time.sleep(0.5)  # node0 hosts the c10d store
            start("node1")
            print("training on 2 nodes x 2 workers; a spare node waits beside them")
            while len({r for r, x in latest(out).items() if x["step"] >= 30}) < 4:
                time.sleep(0.2)
            start("spare")
            time.sleep(args.gap + 5)  # the spare gets its fork server ready
            first_pids = {r: x["pid"] for r, x in latest(out).items()}
            report = []

            def measure(what: str, t0: float, last_step: int) -> None:
                first = back_at_full_size(out, t0)
                now = {r: x["pid"] for r, x in first.items()}
                new = sorted(r for r in RANKS if now[r] != pids[r])
                if not new:
                    tier = "in-process restart (every rank, same processes)"
                elif len(new) == 1:
                    tier = f"process (rank {new[0]} replaced; the others kept running)"
                else:
                    tier = f"node (ranks {new} came back on the spare; the others kept running)"
                seconds = max(x["t"] for x in first.values()) - t0
                redone = max(0, last_step + 1 - min(x["step"] for x in first.values()))
                report.append((what, tier, seconds, redone))
                print(f"  {what}: {tier}; full size again in {seconds:.2f} s, "
                      f"{redone} steps redone", flush=True)  # fmt: skip
                pids.update(now)

            pids = dict(first_pids)
            for what in ("exception in rank 1", "SIGKILL of rank 3", "SIGKILL of node 1"):
                time.sleep(args.gap)
                last_step = max(x["step"] for x in latest(out).values())
                t0 = time.time()
                if what.startswith("exception"):
                    (out / "raise1").touch()
                elif what == "SIGKILL of rank 3":
                    os.kill(latest(out)[3]["pid"], signal.SIGKILL)
                else:
                    node1 = agents["node1"]
                    for pid in [node1.pid, *descendants(node1.pid)]:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    node1.wait()
                measure(what, t0, last_step)
            # the demo is over: the job trains 50 more steps and ends
            (out / "stop_at.tmp").write_text(str(max(x["step"] for x in latest(out).values()) + 50))
            (out / "stop_at.tmp").rename(out / "stop_at")
            codes = {n: p.wait(timeout=300) for n, p in agents.items() if n != "node1"}
            kept = all(pids[r] == first_pids[r] for r in (0, 1))
            print("summary:")
            for what, tier, seconds, redone in report:
                print(f"  {what:<22} -> tier: {tier.split(' (')[0]:<20} {seconds:5.2f} s, "
                      f"{redone} steps redone")  # fmt: skip
            print(f"  ranks 0 and 1 kept their processes for the whole run: {kept}")
            print(f"  agents' exit codes: {codes}")
        finally:
            for proc in agents.values():
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()


if __name__ == "__main__":
    main()
