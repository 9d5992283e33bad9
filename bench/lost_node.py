"""A lost node, relaunch vs torchrun, side by side: same job, same run.

    python bench/lost_node.py [--runs 3] [--settle 4]

Two nodes (two agents on this machine, c10d rendezvous on 127.0.0.1, --nnodes=1:2)
x 2 workers of a tiny DDP job on gloo. torchrun runs with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.

(a)/(b) SIGKILL the second node's agent and its workers (its process group, and each
    worker by pid: torchrun starts its workers in sessions of their own) during
    training. Measured on the survivor: time until it noticed (its workers were
    stopped) and time until it trained a step again (alone, world 2). Median of runs.
(c) Restart budget: --max-restarts 3, and one worker of the second node crashes 4
    times in a row. relaunch counts restarts per job (the 4th crash ends the job on
    both nodes, with one root-cause report); torchrun counts them per node.
Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt, free_port, in_loopback_netns, median

PY = sys.executable
LAUNCHERS = {
    "relaunch": [PY, "-m", "relaunch", "--local-addr=127.0.0.1"],
    "torchrun": [PY, "-m", "torch.distributed.run", "--local-addr=127.0.0.1"],
}

TRAIN = textwrap.dedent(
    """
    import os, sys, time
    out, crashes = sys.argv[1], int(sys.argv[2])
    node, local = os.environ["BENCH_NODE"], os.environ["LOCAL_RANK"]
    attempt, world = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["WORLD_SIZE"]
    log = open(os.path.join(out, f"steps_{node}_{local}.log"), "a", buffering=1)
    log.write(f"pid {os.getpid()} {attempt} {world} {time.time()}\\n")
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crash_log = os.path.join(out, "crashes.log")
    for step in range(100000):
        x = torch.randn(32, 32)
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        log.write(f"step {attempt} {world} {step} {time.time()}\\n")
        if crashes and node == "b" and local == "0" and step == 10:
            done = open(crash_log).read().count("crash") if os.path.exists(crash_log) else 0
            if done < crashes:
                with open(crash_log, "a") as f:
                    f.write(f"crash {time.time()}\\n")
                os._exit(3)
        if crashes and step >= 60:
            break
        time.sleep(0.02)
    del model, opt  # free DDP before its process group (a gloo teardown deadlock)
    dist.destroy_process_group()
    """
)


def _lines(out: Path, node: str) -> list[list[str]]:
    rows = []
    for path in sorted(out.glob(f"steps_{node}_*.log")):
        rows += [line.split() for line in path.read_text().splitlines()]
    return rows


def _pids(out: Path, node: str) -> set[int]:
    return {int(r[1]) for r in _lines(out, node) if len(r) == 5 and r[0] == "pid"}


def _steps(out: Path, node: str) -> list[tuple[str, int, float]]:
    return [
        (r[1], int(r[2]), float(r[4])) for r in _lines(out, node) if len(r) == 5 and r[0] == "step"
    ]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


class Job:
    """Two agents of one launcher; ``close()`` stops both and every worker."""

    def __init__(self, name: str, script: str, out: Path, *, restarts: int, crashes: int) -> None:
        self.out = out
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        port = free_port()
        for node in ("a", "b"):
            env = {
                **os.environ,
                "BENCH_NODE": node,
                "OMP_NUM_THREADS": "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "GLOO_SOCKET_IFNAME": "lo",
                "TMPDIR": str(out),  # the launchers' default log dirs go with the run's dir
            }
            cmd = [
                *LAUNCHERS[name], "--nnodes=1:2", "--nproc-per-node=2",
                f"--max-restarts={restarts}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench",
                script, str(out), str(crashes),
            ]  # fmt: skip
            with open(out / f"agent_{node}.out", "wb") as log:
                self.procs[node] = subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            if node == "a":  # a hosts the store: let it bind the port first
                deadline = time.monotonic() + 60
                while not self._listening(port):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name}: the first agent never listened")
                    time.sleep(0.05)

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def kill_node(self, node: str) -> None:
        pids = _pids(self.out, node)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[node].pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for node in self.procs:
            for pid in _pids(self.out, node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def lost_node(name: str, script: str, settle: float) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="relaunch_bench_") as tmp:
        out = Path(tmp)
        job = Job(name, script, out, restarts=3, crashes=0)
        try:
            deadline = time.monotonic() + 180
            while not all(len([s for s in _steps(out, n) if s[1] == 4]) >= 40 for n in "ab"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: the two nodes never trained together")
                time.sleep(0.1)
            time.sleep(settle)  # steady state (standbys warm)
            old = _pids(out, "a")
            job.kill_node("b")
            killed = time.time()
            noticed = trained = None
            deadline = time.monotonic() + 180
            while trained is None:
                if noticed is None and not any(_alive(pid) for pid in old):
                    noticed = time.time() - killed
                new = [t for _, w, t in _steps(out, "a") if w == 2 and t > killed]
                if new:
                    trained = min(new) - killed
                if time.monotonic() > deadline or job.procs["a"].poll() is not None:
                    raise RuntimeError(f"{name}: the survivor did not train again")
                time.sleep(0.01)
            return (noticed if noticed is not None else trained), trained
        finally:
            job.close()


def budget(name: str, script: str) -> str:
    with tempfile.TemporaryDirectory(prefix="relaunch_bench_") as tmp:
        out = Path(tmp)
        job = Job(name, script, out, restarts=3, crashes=4)
        try:
            codes = {n: p.wait(300) for n, p in job.procs.items()}
        except subprocess.TimeoutExpired:
            codes = {n: p.poll() for n, p in job.procs.items()}
        finally:
            job.close()
        crash_log = out / "crashes.log"
        times = [float(x.split()[1]) for x in crash_log.read_text().splitlines()]
        starts = {n: _restarted_steps(out, n) for n in ("a", "b")}

        def trained_after(node: str, t: float) -> set[int]:
            """World sizes of steps by workers started after ``t`` on ``node``."""
            return {world for started, world in starts[node] if started > t}

        survived = sum(1 for t in times if trained_after("a", t) and trained_after("b", t))
        last = {n: sorted(trained_after(n, times[-1])) for n in ("a", "b")} if times else {}
        reports = {
            n: (out / f"agent_{n}.out").read_text(errors="replace").count("Root Cause")
            for n in ("a", "b")
        }
        return (
            f"{len(times)} crashes, {survived} followed by training on both nodes; "
            f"world sizes trained after the last crash: {last}; exit codes {codes}; "
            f"'Root Cause' reports per node: {reports}"
        )


def _restarted_steps(out: Path, node: str) -> list[tuple[float, int]]:
    """(start time of the worker, world size) of every step of ``node``."""
    rows = []
    for path in sorted(out.glob(f"steps_{node}_*.log")):
        started = 0.0
        for parts in (line.split() for line in path.read_text().splitlines()):
            if len(parts) == 5 and parts[0] == "pid":
                started = float(parts[4])
            elif len(parts) == 5 and parts[0] == "step":
                rows.append((started, int(parts[2])))
    return rows


def lost_nodes(train: str, runs: int, settle: float) -> None:
    print("(a/b) 2 nodes x 2 workers, SIGKILL of one node (agent + workers)")
    noticed: dict[str, list[float]] = {n: [] for n in LAUNCHERS}
    trained: dict[str, list[float]] = {n: [] for n in LAUNCHERS}
    for _ in range(runs):
        for name in LAUNCHERS:  # interleaved, so drift hits both alike
            n, t = lost_node(name, train, settle)
            noticed[name].append(n)
            trained[name].append(t)
    for name in LAUNCHERS:
        print(f"    {name:9s} noticed:       {fmt(noticed[name])}")
        print(f"    {name:9s} trained again: {fmt(trained[name])}")
    for what, d in (("noticed", noticed), ("trained again", trained)):
        ratio = median(d["torchrun"]) / median(d["relaunch"])
        print(f"    {what}: torchrun/relaunch {ratio:.2f}x")


def main() -> None:
    in_loopback_netns()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="(a/b) runs; 0: skip (a/b)")
    parser.add_argument("--settle", type=float, default=4.0, help="seconds before the kill")
    parser.add_argument("--skip-budget", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relaunch_bench_") as tmp:
        train = os.path.join(tmp, "train.py")
        Path(train).write_text(TRAIN)
        if args.runs:
            lost_nodes(train, args.runs, args.settle)
        if not args.skip_budget:
            print("(c) --max-restarts 3, 4 successive worker crashes on one node")
            for name in LAUNCHERS:
                print(f"    {name:9s} {budget(name, train)}")


if __name__ == "__main__":
    main()
