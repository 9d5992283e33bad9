"""The in-process monitor processes' heartbeat reads, against the store that hosts them:
every monitor reading every rank (before 2026-12-01) against the ranks that
``watched`` names (about log2 of the world), in the same run.

    python bench/inprocess_heartbeats.py [--ranks 64,256,1024] [--seconds 8] [--clients 4]

The store is the workers' store a relaunch agent hosts (``TCPStoreServer``, in a process
of its own). Each of ``--clients`` processes plays its share of the ranks' monitor
processes, one torch TCPStore connection each, doing what a monitor process does every
``monitor_process_interval`` (0.25 s, the default): one heartbeat and one read of the
heartbeats it watches, through relaunch's ``CoordinationStore``. Printed per world size
and way: checks done a second (the target is four per rank), the store process's CPU
(% of one core) and a check's round trip (median, 99th percentile), and the ratio of
the store's CPU per check. Two cores here: the clients and the store share them, so
where the store is saturated the checks a second fall short of the target (a monitor
process that checks late finds a dead rank late). Run by hand and alone (not in CI).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import STORE_SERVER, in_loopback_netns, median

from relaunch.procs import raise_open_files_limit

INTERVAL = 0.25  # monitor_process_interval's default
HERE = os.path.abspath(__file__)


def _watch(rank: int, world: int, way: str) -> list[int]:
    from relaunch.inprocess._core._monitor_process import watched

    if way == "all":
        return [r for r in range(world) if r != rank]
    return watched(rank, world)


def client(port: int, world: int, way: str, lo: int, hi: int, start: float, end: float) -> None:
    """Play the monitor processes of ranks ``lo``..``hi``-1 from ``start`` to ``end``
    (wall-clock times); print the round trips of the checks after ``start``."""
    import datetime

    from torch.distributed import TCPStore

    from relaunch.inprocess._core._coord import CoordinationStore

    timeout = datetime.timedelta(seconds=60)
    coords = {
        r: CoordinationStore(
            TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timeout),
            "bench",
        )
        for r in range(lo, hi)
    }
    watch = {r: _watch(r, world, way) for r in coords}
    for r, coord in coords.items():  # (the keys exist before the clock starts)
        coord.heartbeat(r)
        coord.heartbeats(watch[r])
    due = [(start + INTERVAL * r / world, r) for r in coords]
    heapq.heapify(due)
    trips: list[float] = []
    while True:
        when, r = heapq.heappop(due)
        if when >= end:
            break
        pause = when - time.time()
        if pause > 0:
            time.sleep(pause)
        t0 = time.perf_counter()
        coords[r].heartbeat(r)
        coords[r].heartbeats(watch[r])
        trips.append(time.perf_counter() - t0)
        heapq.heappush(due, (max(when + INTERVAL, time.time()), r))
    print(json.dumps(trips), flush=True)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(world: int, way: str, seconds: float, clients: int) -> dict[str, float]:
    store = subprocess.Popen(
        [sys.executable, "-c", STORE_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        assert store.stdout is not None
        port = int(store.stdout.readline())
        start = time.time() + 3.0 + world / 200  # (the clients connect meanwhile)
        end = start + seconds
        bounds = [world * i // clients for i in range(clients + 1)]
        for lo, hi in itertools.pairwise(bounds):
            args = [str(a) for a in (port, world, way, lo, hi, start, end)]
            procs.append(
                subprocess.Popen(
                    [sys.executable, HERE, "--client", *args], stdout=subprocess.PIPE, text=True
                )
            )
        time.sleep(max(0.0, start + 0.5 - time.time()))
        cpu0, t0 = _cpu_seconds(store.pid), time.monotonic()
        time.sleep(max(0.0, end - 0.5 - time.time()))
        cpu = (_cpu_seconds(store.pid) - cpu0) / (time.monotonic() - t0)
        trips: list[float] = []
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            trips += json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        store.communicate("", timeout=30)
    trips.sort()
    return {
        "checks": len(trips) / seconds,
        "cpu": 100 * cpu,
        "p50": median(trips),
        "p99": trips[min(len(trips) - 1, int(0.99 * len(trips)))],
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        port, world, way, lo, hi, start, end = sys.argv[2:9]
        client(int(port), int(world), way, int(lo), int(hi), float(start), float(end))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,256,1024")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    in_loopback_netns()
    raise_open_files_limit()  # (a connection per monitor process played)
    print(f"{'ranks':>6} {'way':>8} {'reads/check':>11} {'checks/s':>9} {'target':>7} "
          f"{'store CPU':>9} {'p50':>9} {'p99':>9}")  # fmt: skip
    for world in (int(w) for w in args.ranks.split(",")):
        got = {}
        for way in ("all", "watched"):
            got[way] = r = run(world, way, args.seconds, args.clients)
            keys = len(_watch(0, world, way))
            print(
                f"{world:>6} {way:>8} {keys:>11} {r['checks']:>9.0f} {4 * world:>7} "
                f"{r['cpu']:>8.1f}% {1e3 * r['p50']:>6.2f} ms {1e3 * r['p99']:>6.2f} ms",
                flush=True,
            )
        # (per check: a saturated store does fewer checks, not more CPU)
        cost = {w: r["cpu"] / max(r["checks"], 1e-9) for w, r in got.items()}
        ratio = cost["all"] / max(cost["watched"], 1e-9)
        print(f"{world:>6}  store CPU per check, all / watched: {ratio:.1f}x", flush=True)


if __name__ == "__main__":
    main()
