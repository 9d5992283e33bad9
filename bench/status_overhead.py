"""CPU of one agent with and without ``--status-port`` (page read every second), beside
torchrun's agent on the same job, in the same run.

    python bench/status_overhead.py [--runs 3] [--seconds 20]

The job: one node, ``--nproc-per-node=2``, c10d rendezvous hosted by the agent (so the
page's store reads land in the measured process), workers that train a tiny model on
gloo for the whole window. The agent's CPU (user + system, all its threads, from
/proc/PID/stat) is measured over ``--seconds`` once the workers run. With the page on,
a client fetches the page every second (a browser showing it). Prints the median CPU in percent
of one core per variant and the page's cost (with - without). Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, in_loopback_netns, median

PY = sys.executable
TICKS = os.sysconf("SC_CLK_TCK")

TRAIN = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    open(os.path.join(sys.argv[1], f"up{os.environ['RANK']}"), "w").close()
    model = torch.nn.Linear(32, 32)
    end = time.time() + float(sys.argv[2])
    while time.time() < end:
        loss = model(torch.randn(8, 32)).sum(); loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        time.sleep(0.05)
    dist.destroy_process_group()
    """
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def poll_page(port: int, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:  # what a browser showing the page does
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                r.read()
        except OSError:
            pass


def one(variant: str, tmp: Path, seconds: float) -> float:
    out = Path(tempfile.mkdtemp(dir=tmp))
    script = out / "train.py"
    script.write_text(TRAIN)
    port, page = free_port(), free_port()
    launcher = (
        [PY, "-m", "torch.distributed.run"] if variant == "torchrun" else [PY, "-m", "relaunch"]
    )
    cmd = [*launcher, "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench", "--monitor-interval=0.1"]  # fmt: skip
    if variant == "relaunch+page":
        cmd.append(f"--status-port={page}")
    cmd += [str(script), str(out), str(seconds + 15)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    stop = threading.Event()
    poller = threading.Thread(target=poll_page, args=(page, stop), name="bench-page-poller")
    try:
        deadline = time.time() + 120
        while not all((out / f"up{r}").exists() for r in (0, 1)):
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{variant}: the workers did not start")
            time.sleep(0.1)
        time.sleep(2)  # settled
        if variant == "relaunch+page":
            poller.start()
        before = cpu_seconds(proc.pid)
        time.sleep(seconds)
        return 100 * (cpu_seconds(proc.pid) - before) / seconds
    finally:
        stop.set()
        if poller.is_alive():
            poller.join(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    in_loopback_netns()
    variants = ("relaunch", "relaunch+page", "torchrun")
    results: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):  # interleaved: drift hits every variant alike
            for variant in variants:
                results[variant].append(one(variant, Path(tmp), args.seconds))
                print(
                    f"run {run} {variant:14s} {results[variant][-1]:6.2f} % of a core", flush=True
                )
    print(f"\nagent CPU over {args.seconds:g} s, median of {args.runs} (percent of one core):")
    for variant in variants:
        print(f"  {variant:14s} {median(results[variant]):6.2f} %")
    cost = median(results["relaunch+page"]) - median(results["relaunch"])
    ratio = median(results["relaunch"]) / max(median(results["torchrun"]), 1e-9)
    print(f"  page cost (relaunch+page - relaunch): {cost:+.2f} % of a core")
    print(f"  relaunch / torchrun agent CPU: {ratio:.2f}")


if __name__ == "__main__":
    main()
