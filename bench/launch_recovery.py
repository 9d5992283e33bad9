"""Launch overhead and recovery time: relaunch vs torchrun, side by side, same job, same run.

    python bench/launch_recovery.py [--runs-launch 5] [--runs-recovery 3]

(a) launch overhead: ``--standalone --nproc-per-node=2`` on a no-op script (median).
(b) recovery: 4 workers of a tiny DDP job on gloo; SIGKILL one worker; time until
    every rank has completed a training step again (median). torchrun runs with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which it does not recover at all.
Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt, in_loopback_netns, median

PY = sys.executable
LAUNCHERS = {
    "relaunch": [PY, "-m", "relaunch"],
    "torchrun": [PY, "-m", "torch.distributed.run"],
}

TRAIN = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = sys.argv[1]
    rank = int(os.environ["RANK"]); attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    log = open(os.path.join(out, f"steps_{rank}.log"), "a", buffering=1)
    log.write(f"pid {os.getpid()} {attempt}\\n")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(100000):
        x = torch.randn(32, 32)
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        log.write(f"step {attempt} {step} {time.time()}\\n")
        time.sleep(0.02)
    """
)


def launch_overhead(name: str, noop: str, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(
            [*LAUNCHERS[name], "--standalone", "--nproc-per-node=2", noop],
            check=True,
            capture_output=True,
        )
        times.append(time.perf_counter() - t0)
    return times


def _read_steps(out: Path, world: int) -> dict[int, list[tuple[str, int, float]]]:
    steps: dict[int, list[tuple[str, int, float]]] = {}
    for rank in range(world):
        path = out / f"steps_{rank}.log"
        rows = []
        if path.exists():
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 4 and parts[0] == "step":
                    rows.append((parts[1], int(parts[2]), float(parts[3])))
        steps[rank] = rows
    return steps


def _pid_of(out: Path, rank: int) -> int:
    lines = [
        line.split()
        for line in (out / f"steps_{rank}.log").read_text().splitlines()
        if line.startswith("pid")
    ]
    return int(lines[-1][1])


def recovery(name: str, script: str, settle: float) -> float:
    world = 4
    with tempfile.TemporaryDirectory(prefix="relaunch_bench_") as tmp:
        out = Path(tmp)
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [
                *LAUNCHERS[name],
                "--standalone",
                f"--nproc-per-node={world}",
                "--max-restarts=3",
                script,
                str(out),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 120
            while not all(len(s) >= 20 for s in _read_steps(out, world).values()):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{name}: job did not start training")
                time.sleep(0.1)
            time.sleep(settle)  # let the job reach its steady state (standbys warm up)
            os.kill(_pid_of(out, 1), signal.SIGKILL)
            killed_at = time.time()
            deadline = time.monotonic() + 180
            while True:
                steps = _read_steps(out, world)
                firsts = []
                for rows in steps.values():
                    after = [t for a, _, t in rows if a != "0" and t > killed_at]
                    if after:
                        firsts.append(min(after))
                if len(firsts) == world:
                    return max(firsts) - killed_at
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{name}: job did not recover")
                time.sleep(0.01)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> None:
    in_loopback_netns()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs-launch", type=int, default=5)
    parser.add_argument("--runs-recovery", type=int, default=3)
    parser.add_argument(
        "--settle", type=float, default=6.0, help="seconds of training before the kill"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relaunch_bench_") as tmp:
        noop = os.path.join(tmp, "noop.py")
        Path(noop).write_text("pass\n")
        train = os.path.join(tmp, "train.py")
        Path(train).write_text(TRAIN)
        print("(a) launch overhead, --standalone --nproc-per-node=2, no-op script")
        launch: dict[str, list[float]] = {}
        for name in LAUNCHERS:
            launch[name] = launch_overhead(name, noop, args.runs_launch)
            print(f"    {name:9s} {fmt(launch[name])}")
        print(
            f"    ratio relaunch/torchrun: {median(launch['relaunch']) / median(launch['torchrun']):.2f}x (target <= 0.7x)"
        )
        print("(b) SIGKILL of 1 of 4 workers -> every rank trained a step again")
        rec: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
        for _ in range(args.runs_recovery):
            for name in LAUNCHERS:  # interleaved, so drift hits both alike
                rec[name].append(recovery(name, train, args.settle))
        for name in LAUNCHERS:
            print(f"    {name:9s} {fmt(rec[name])}")
        print(
            f"    speed-up torchrun/relaunch: {median(rec['torchrun']) / median(rec['relaunch']):.2f}x (target >= 4x)"
        )


if __name__ == "__main__":
    main()
