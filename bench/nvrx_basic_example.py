"""NVIDIA's ``examples/inprocess/basic_example.py``, unchanged, under ``relaunch``.

    python bench/nvrx_basic_example.py <nvidia-resiliency-ext> [--runs 2]
        [--iterations 3000] [--fault-prob 0.003] [--nproc 3]

Runs ``relaunch --nproc-per-node 3 <nvidia-resiliency-ext>/examples/inprocess/
basic_example.py --device cpu`` with ``PYTHONPATH=bench/nvrx_compat`` (NVIDIA's module
names aliased to ``relaunch.inprocess``, nothing else added), each run with a checkpoint
directory of its own. Every rank raises with probability ``--fault-prob`` at each step
(0.003 x 3 ranks: a fault every ~100 steps), the wrapper restarts every rank in-process
and the example resumes from its last checkpoint (every 100 steps). Prints, per run:
the in-process restarts (iterations rank 0 ended), the example's own "restart
latency" lines (from the fault to the faulting rank running the wrapped function
again) as median / max, whether the job finished, and the launcher's exit code. Run
by hand, not in CI.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import in_loopback_netns

BENCH = Path(__file__).resolve().parent


def run_once(example: Path, args: argparse.Namespace, checkpoints: Path) -> list[float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH / "nvrx_compat"), *filter(None, [env.get("PYTHONPATH")])]
    )
    cmd = [
        sys.executable, "-m", "relaunch", "--nproc-per-node", str(args.nproc), str(example),
        "--device", "cpu", "--total-iterations", str(args.iterations),
        "--fault-prob", str(args.fault_prob), "--path", str(checkpoints),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    latencies = [float(x) for x in re.findall(r"\| restart latency: ([\d.]+)s$", log, re.M)]
    restarts = len(re.findall(r"rank 0: iteration \d+ ends", log))
    last = f"iteration={args.iterations - 1} "
    finished = any(last in line for line in log.splitlines() if "rank=0 " in line)
    summary = (
        f"median {statistics.median(latencies):.3f} s, max {max(latencies):.3f} s"
        if latencies
        else "none"
    )
    print(
        f"run: {restarts} in-process restarts, restart latency ({len(latencies)} faults): "
        f"{summary}; finished: {finished}; exit code {proc.returncode}; {wall:.0f} s",
        flush=True,
    )
    if proc.returncode != 0 or not finished:
        print(log[-4000:], file=sys.stderr)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("nvrx", type=Path, help="a checkout of NVIDIA/nvidia-resiliency-ext")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--fault-prob", type=float, default=0.003)
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = parser.parse_args()
    example = args.nvrx.resolve() / "examples" / "inprocess" / "basic_example.py"
    if not example.is_file():
        raise SystemExit(f"no {example}")
    in_loopback_netns()
    every: list[float] = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="nvrx_basic_") as tmp:
            every += run_once(example, args, Path(tmp))
    if every:
        print(
            f"all runs: {len(every)} faults, restart latency median "
            f"{statistics.median(every):.3f} s, max {max(every):.3f} s"
        )


if __name__ == "__main__":
    main()
