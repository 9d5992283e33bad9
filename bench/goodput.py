"""Goodput under a fixed fault rate: relaunch with a snapshot every step against
torchrun with the script's own disk checkpoints every K steps, in the same run.

    python bench/goodput.py [--steps 600] [--step-time 0.05] [--fault-every 8] [--every 50]
                            [--params 10]

One node, two gloo workers (``examples/snapshots.py``: DDP, a step of ``--step-time``
seconds), ``--max-restarts`` enough for every fault. A SIGKILL of a random worker every
``--fault-every`` seconds (the same schedule for both). Four runs: each launcher with
and without faults. Prints per launcher: wall time, faults, goodput (fault-free time /
wall time with faults), steps redone per fault (step executions beyond ``--steps``,
per fault), and the cost of saving per step (fault-free wall time against the same
script with no checkpoint at all, per step). ``--params M``: a model of about M million
parameters (Adam: its state is 3x that) instead of the example's tiny one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, in_loopback_netns

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "snapshots.py"


def run(launcher: str, args: argparse.Namespace, faults: bool, mode: str) -> dict[str, float]:
    """One job; ``mode``: "snapshot" (every step), "disk" (every K steps) or "none"."""
    out = Path(tempfile.mkdtemp(prefix="relaunch-goodput-"))
    script = [str(EXAMPLE), "--steps", str(args.steps), "--sleep", str(args.step_time),
              "--log-to", str(out), "--params", str(args.params)]  # fmt: skip
    if mode == "disk":
        script += ["--disk-every", str(args.every), "--disk-dir", str(out)]
    elif mode == "none":
        script += ["--disk-every", str(10**9), "--disk-dir", str(out)]
    head = [sys.executable, "-m", "relaunch"] if launcher == "relaunch" else ["torchrun"]
    cmd = [
        *head, "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1000",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=goodput",
        *script,
    ]  # fmt: skip
    # torchrun recovers only with a store of its own per round (without it, its
    # restarted workers hang: bench/launch_recovery.py)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    killed = 0
    try:
        next_fault = t0 + args.fault_every
        while proc.poll() is None:
            time.sleep(0.05)
            if time.monotonic() - t0 > args.limit:
                print(f"  note: {launcher} {mode} did not finish in {args.limit:g} s: stopped")
                break
            if faults and time.monotonic() >= next_fault:
                rows = _rows(out)
                latest = {r["rank"]: r["pid"] for r in rows if "pid" in r}
                if latest:
                    pid = latest[rng.choice(sorted(latest))]
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed += 1
                    except ProcessLookupError:
                        pass
                next_fault = time.monotonic() + args.fault_every
        wall = time.monotonic() - t0
        executed = sum(1 for r in _rows(out) if r.get("rank") == 0 and "step" in r)
        if proc.returncode != 0:
            print(f"  note: {launcher} {mode} exited {proc.returncode}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(out, ignore_errors=True)
    return {"wall": wall, "faults": killed, "executed": executed, "rc": proc.returncode}


def _rows(out: Path) -> list[dict[str, object]]:
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
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--limit", type=float, default=600.0, help="seconds a run may take")
    args = parser.parse_args()
    in_loopback_netns()
    size = f"{args.params:g}M parameters" if args.params else "a tiny model"
    print(f"{args.steps} steps of {args.step_time} s, {size}, a SIGKILL every {args.fault_every} s; "
          f"torchrun's script saves every {args.every} steps")  # fmt: skip
    print(f"{'launcher':<10} {'clean s':>8} {'faulted s':>10} {'faults':>7} {'goodput':>8} "
          f"{'redone/fault':>13} {'save ms/step':>13}")  # fmt: skip
    for launcher, mode in (("relaunch", "snapshot"), ("torchrun", "disk")):
        bare = run(launcher, args, False, "none")
        clean = run(launcher, args, False, mode)
        hit = run(launcher, args, True, mode)
        redone = (hit["executed"] - args.steps) / max(hit["faults"], 1)
        save = (clean["wall"] - bare["wall"]) / args.steps * 1e3
        print(f"{launcher:<10} {clean['wall']:8.1f} {hit['wall']:10.1f} {hit['faults']:7.0f} "
              f"{clean['wall'] / hit['wall']:8.1%} {redone:13.1f} {save:13.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
