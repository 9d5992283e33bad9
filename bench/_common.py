"""Shared helpers for the benchmarks: run in a loopback-only network namespace, medians."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys


def in_loopback_netns() -> None:
    """Re-execute this script in a new network namespace with only ``lo`` up.

    torch's TCPStore does a reverse DNS lookup per connection; on some machines one
    in ~25 stalls for 5 s. A loopback-only namespace removes that noise. Skipped
    when not permitted or when RELAUNCH_BENCH_NETNS=0.
    """
    if os.environ.get("RELAUNCH_BENCH_NETNS") in ("0", "done") or not shutil.which("unshare"):
        return
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        print("note: cannot create a network namespace; running on the host network")
        return
    env = {**os.environ, "RELAUNCH_BENCH_NETNS": "done"}
    cmd = [
        "unshare",
        "-n",
        "sh",
        "-c",
        'ip link set lo up && exec "$@"',
        "sh",
        sys.executable,
        *sys.argv,
    ]
    raise SystemExit(subprocess.call(cmd, env=env))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(values: list[float]) -> str:
    return f"median {median(values):6.2f} s  (runs: {', '.join(f'{v:.2f}' for v in values)})"
