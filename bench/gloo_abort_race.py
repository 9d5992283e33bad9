"""Stress: do two gloo ranks that abort an allreduce loop always get out of it?

    python bench/gloo_abort_race.py [--trials 30] [--load 0] [--skew-ms 30]
                                    [--release-ms 50] [--at-once]

Each trial starts two processes that run ``dist.all_reduce`` in a loop on a gloo
group; each aborts itself with ``AbortTorchDistributed`` from a thread at a random
moment, the second up to ``--skew-ms`` after the first (as every rank's monitor
thread does on the same interruption), then releases its held connections
``--release-ms`` after its loop failed (the wrapper's restart releases once every rank
reached its termination barrier, or after 0.2 s) and exits. A
rank still running 15 s after it started is hung (gloo's timeout is 120 s).
``--at-once`` releases right after the abort (the connections close at once), to
compare. ``--load N`` runs N busy loops beside. Prints how many ranks hung.
Run by hand, not in CI (``inprocess/NOTES.md``, Known issues, has the figures).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, in_loopback_netns

RANK = textwrap.dedent(
    """
    import datetime, os, random, sys, threading, time
    import torch, torch.distributed as dist
    from relaunch.inprocess import AbortTorchDistributed, State
    from relaunch.inprocess._core import _sockets

    rank, port, trial = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    skew, release, at_once = float(sys.argv[4]), float(sys.argv[5]), sys.argv[6] == "1"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    _sockets.mark_baseline()  # the store's connection is spared
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    tensor = torch.ones(8)
    dist.all_reduce(tensor)
    draw = random.Random(trial)
    delay, first = draw.uniform(0.05, 0.3), draw.randrange(2)
    delay += 0 if rank == first else draw.uniform(0, skew)
    state = State(rank=rank, world_size=2, initial_rank=rank, initial_world_size=2)

    def abort():
        time.sleep(delay)
        AbortTorchDistributed()(state)
        if at_once:
            _sockets.release_held()

    threading.Thread(target=abort, name="bench-abort", daemon=True).start()
    try:
        while True:
            dist.all_reduce(tensor)
    except RuntimeError:
        pass
    time.sleep(release)
    _sockets.release_held()
    time.sleep(0.3)  # the peer may still be reading
    os._exit(0)
    """
)


def trial(index: int, args: argparse.Namespace) -> int:
    """Run one trial; return how many of its two ranks hung."""
    port = free_port()
    extra = [str(args.skew_ms / 1000), str(args.release_ms / 1000), "1" if args.at_once else "0"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(port), str(index), *extra],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in (0, 1)
    ]
    deadline, hung = time.monotonic() + 15, 0
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung += 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return hung


def main() -> None:
    in_loopback_netns()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--load", type=int, default=0, help="busy loops beside the ranks")
    parser.add_argument("--skew-ms", type=float, default=30.0)
    parser.add_argument("--release-ms", type=float, default=50.0)
    parser.add_argument("--at-once", action="store_true", help="close at the abort")
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        hung = sum(trial(i, args) for i in range(args.trials))
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    how = "closed at the abort" if args.at_once else f"held {args.release_ms:g} ms past the loop"
    print(f"{args.trials} trials, {args.load} busy loops, connections {how}: "
          f"{hung} of {2 * args.trials} ranks hung")  # fmt: skip


if __name__ == "__main__":
    main()
