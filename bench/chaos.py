"""Faults in sequence on one long job: relaunch vs torchrun, side by side, same run.

    python bench/chaos.py --faults 6
    python bench/chaos.py --faults 50 --gap 1:3 --kinds kill,raise,stop --load 2

Two nodes (two agents on this machine, c10d on 127.0.0.1) x 2 workers of a tiny DDP
job on gloo. From a fixed seed, N faults, each ``--gap`` seconds after the job
recovered from the previous one, on a random worker of the current world:

- ``kill``: SIGKILL the worker;   ``raise``: the worker raises at its next step;
- ``stop``: SIGSTOP the worker (relaunch runs with ``--hang-timeout``; torchrun can
  only wait for the collective timeout, ``--collective-timeout``);
- ``node``: SIGKILL the second node (agent and workers; ``--nnodes 1:2``); the
  survivor trains alone, then the node is started again and rejoins (not timed).

Recovery is timed from the fault to every rank of the new world having completed a
step in a new attempt. After the last fault the job is told to finish; it completed
when its launchers exit 0 and every rank finished. Orphans: processes of the run
(found by an environment marker) still alive after the launchers exited.
torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, in_loopback_netns

PY = sys.executable
NODES = ("a", "b")
TRAIN = textwrap.dedent(
    """
    import datetime, os, sys, time
    out, timeout = sys.argv[1], float(sys.argv[2])
    node, local = os.environ["BENCH_NODE"], os.environ["LOCAL_RANK"]
    attempt, world = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["WORLD_SIZE"]
    me = f"{node}_{local}"
    log = open(os.path.join(out, f"steps_{me}.log"), "a", buffering=1)
    log.write(f"pid {os.getpid()} {attempt} {world} {time.time()}\\n")
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    finish, fault = os.path.join(out, "finish"), os.path.join(out, f"raise_{me}")
    step = 0
    while True:
        loss = model(torch.randn(32, 32)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        log.write(f"step {attempt} {world} {step} {time.time()}\\n")
        step += 1
        if os.path.exists(fault):
            os.unlink(fault)
            raise RuntimeError(f"chaos: {me} raises at step {step}")
        t = torch.tensor([float(os.path.exists(finish))])
        dist.all_reduce(t)
        if t.item() > 0:
            break
        time.sleep(0.02)
    log.write(f"done {attempt} {world} {step} {time.time()}\\n")
    del model, opt
    dist.destroy_process_group()
    """
)


@dataclass
class _Rank:
    offset: int = 0
    pid: int = 0
    steps: list[tuple[float, str]] = field(default_factory=list)
    """(time, world) of the current worker's last steps."""
    done: bool = False


class Job:
    """Two agents of one launcher; ``close()`` stops both and everything they started."""

    def __init__(self, name: str, args: argparse.Namespace, out: Path) -> None:
        self.name, self.args, self.out = name, args, out
        self.marker = uuid.uuid4().hex
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ranks: dict[str, _Rank] = {}
        for node in NODES:
            self.start(node)
            if node == "a":
                self._wait_listening()

    def cmd(self) -> list[str]:
        a = self.args
        base = [PY, "-m", "relaunch" if self.name == "relaunch" else "torch.distributed.run"]
        nnodes = "1:2" if "node" in a.kinds else "2:2"
        cmd = [
            *base, "--local-addr=127.0.0.1", f"--nnodes={nnodes}", "--nproc-per-node=2",
            f"--max-restarts={2 * a.faults + 2}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=chaos",
        ]  # fmt: skip
        if self.name == "relaunch" and "stop" in a.kinds:
            cmd.append(f"--hang-timeout={a.hang_timeout}")
        return [*cmd, str(self.out / "train.py"), str(self.out), str(a.collective_timeout)]

    def start(self, node: str) -> None:
        env = {
            **os.environ,
            "BENCH_NODE": node,
            "BENCH_CHAOS": self.marker,
            "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "TMPDIR": str(self.out),
        }
        with open(self.out / f"agent_{self.name}_{node}.out", "ab") as log:
            self.procs[node] = subprocess.Popen(
                self.cmd(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 1),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: the first agent never listened")

    # -- what the workers wrote (read incrementally: the logs grow all run long) ---------
    def _scan(self, me: str) -> _Rank:
        rank = self.ranks.setdefault(me, _Rank())
        path = self.out / f"steps_{me}.log"
        try:
            with open(path, "rb") as f:
                f.seek(rank.offset)
                data = f.read()
        except OSError:
            return rank
        end = data.rfind(b"\n") + 1
        rank.offset += end
        for line in data[:end].decode().splitlines():
            r = line.split()
            if len(r) != 5:
                continue
            if r[0] == "pid":
                rank.pid, rank.steps = int(r[1]), []
            elif r[0] == "step":
                rank.steps.append((float(r[4]), r[2]))
                del rank.steps[:-50]
            elif r[0] == "done":
                rank.done = True
        return rank

    def latest(self, me: str) -> int:
        """The pid of the rank's current worker (0 before it started)."""
        return self._scan(me).pid

    def stepped_since(self, me: str, t0: float, old_pid: int | None, world: str) -> bool:
        """A worker other than ``old_pid`` completed a step in ``world`` after ``t0``."""
        rank = self._scan(me)
        if rank.pid in (0, old_pid):
            return False
        return any(t > t0 and w == world for t, w in rank.steps)

    def wait_world(self, ranks: list[str], world: str, t0: float, before: dict[str, int],
                   timeout: float) -> float | None:  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.stepped_since(me, t0, before.get(me), world) for me in ranks):
                return time.time() - t0
            if any(p.poll() is not None for n, p in self.procs.items() if f"{n}_0" in ranks):
                return None
            time.sleep(0.01)
        return None

    # -- the end ---------------------------------------------------------------------
    def finish(self, timeout: float) -> bool:
        (self.out / "finish").write_text("")
        deadline = time.monotonic() + timeout
        ok = True
        for proc in self.procs.values():
            try:
                ok &= proc.wait(max(0.1, deadline - time.monotonic())) == 0
            except subprocess.TimeoutExpired:
                ok = False
        return ok

    def orphans(self) -> list[int]:
        found = []
        needle = f"BENCH_CHAOS={self.marker}".encode()
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
        return found

    def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in self.orphans():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run(name: str, args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    lo, hi = (float(x) for x in args.gap.split(":"))
    kinds = args.kinds.split(",")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    failed: list[str] = []
    with contextlib.ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix="relaunch_chaos_")
        if args.keep:
            print(f"    {name}: files kept in {tmp}")
        else:
            stack.callback(shutil.rmtree, tmp, True)
        out = Path(tmp)
        (out / "train.py").write_text(TRAIN)
        job = Job(name, args, out)
        try:
            ranks = [f"{n}_{i}" for n in NODES for i in range(2)]
            if job.wait_world(ranks, "4", 0.0, {}, 180) is None:
                raise RuntimeError(f"{name}: the job never trained")
            time.sleep(args.settle)
            for i in range(args.faults):
                kind = rng.choice(kinds)
                target = rng.choice(ranks)
                time.sleep(rng.uniform(lo, hi))
                before = {me: job.latest(me) for me in ranks}
                pid = before[target]
                t0 = time.time()
                if kind == "kill":
                    os.kill(pid, signal.SIGKILL)
                elif kind == "stop":
                    os.kill(pid, signal.SIGSTOP)
                elif kind == "raise":
                    (out / f"raise_{target}").write_text("")
                else:  # node: the second node, agent and workers
                    os.killpg(job.procs["b"].pid, signal.SIGKILL)
                    for me in ("b_0", "b_1"):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(job.latest(me), signal.SIGKILL)
                    job.procs["b"].wait()
                survivors = ["a_0", "a_1"] if kind == "node" else ranks
                world = "2" if kind == "node" else "4"
                took = job.wait_world(survivors, world, t0, before, args.fault_timeout)
                if took is None:
                    failed.append(f"fault {i} ({kind} {target}) not recovered")
                    break
                times[kind].append(took)
                print(
                    f"    {name:8s} fault {i + 1:2d} {kind:5s} {target}: {took:6.2f} s", flush=True
                )
                if kind == "node":
                    job.start("b")
                    t1 = time.time()
                    if job.wait_world(ranks, "4", t1, {}, args.fault_timeout) is None:
                        failed.append(f"fault {i}: node b did not rejoin")
                        break
            completed = not failed and job.finish(120)
            completed &= all(job._scan(me).done for me in ranks)
            # Left behind by launchers that exited on their own (not counted after a kill).
            orphans: list[int] | None = job.orphans() if completed else None
        finally:
            job.close()
    return {"times": times, "failed": failed, "completed": completed, "orphans": orphans}


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return f"median {statistics.median(values):5.2f} s, max {max(values):5.2f} s (n={len(values)})"


def main() -> None:
    in_loopback_netns()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--faults", type=int, default=6)
    p.add_argument("--gap", default="2:5", help="seconds between recovery and next fault, A:B")
    p.add_argument("--kinds", default="kill,raise,stop", help="of kill,raise,stop,node")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--load", type=int, default=0, help="busy processes beside the job")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="relaunch's, for stop")
    p.add_argument("--collective-timeout", type=float, default=30.0)
    p.add_argument("--fault-timeout", type=float, default=240.0)
    p.add_argument("--settle", type=float, default=3.0)
    p.add_argument("--launchers", default="relaunch,torchrun")
    p.add_argument("--keep", action="store_true", help="keep the run's files (logs, steps)")
    args = p.parse_args()
    bad = set(args.kinds.split(",")) - {"kill", "raise", "stop", "node"}
    if bad:
        p.error(f"--kinds: unknown {sorted(bad)}")
    load = [
        subprocess.Popen([PY, "-c", "while True: pass"], start_new_session=True)
        for _ in range(args.load)
    ]
    results = {}
    try:
        print(f"{args.faults} faults ({args.kinds}), gap {args.gap} s, seed {args.seed}, "
              f"load {args.load}")  # fmt: skip
        for name in args.launchers.split(","):
            results[name] = run(name, args)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    print()
    for name, r in results.items():
        times: dict[str, list[float]] = r["times"]  # type: ignore[assignment]
        n = sum(len(v) for v in times.values())
        print(f"{name}: recovered {n}/{args.faults}, completed: {r['completed']}, "
              f"orphans: {'n/a' if r['orphans'] is None else len(r['orphans'])}")  # type: ignore[arg-type]  # fmt: skip
        for kind, values in times.items():
            print(f"    {kind:5s} {_stats(values)}")
        for line in r["failed"]:  # type: ignore[attr-defined]
            print(f"    FAILED: {line}")
    if "relaunch" in results and "torchrun" in results:
        for kind in args.kinds.split(","):
            a = results["relaunch"]["times"][kind]  # type: ignore[index]
            b = results["torchrun"]["times"][kind]  # type: ignore[index]
            if a and b:
                ratio = statistics.median(b) / statistics.median(a)
                print(f"    {kind}: torchrun/relaunch median {ratio:.1f}x")


if __name__ == "__main__":
    main()
