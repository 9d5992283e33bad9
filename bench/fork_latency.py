"""Fork latency: a replacement worker forked from the fork server vs a fresh interpreter.

    python bench/fork_latency.py [--runs 20] [--fresh-runs 3] [--modules torch,...]

A fork server (``relaunch.procs.ForkServer``, as the agent starts it) preloads
``--modules`` (what a DDP worker imports). Then one worker at a time is started the way
the agent starts a replacement (``relaunch.procs.WorkerProcesses``): forked from the
server (``--runs`` times), and as a fresh interpreter through the same runner
(``--fresh-runs`` times). The worker's script imports the same modules, then writes
``time.monotonic()`` (one clock for every process of the machine). Printed per
variant, median and max of:

- request -> pid: until the agent has the new worker (``start()`` returned);
- request -> script: until the script ran its first line after its imports;

and, for the forked workers, the server's own ``fork()`` (from its log).

No network is used. Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _common import median

from relaunch.procs import Entrypoint, ForkServer, ProcessSpec, WorkerProcesses

MODULES = "torch,torch.distributed,torch.nn.parallel,torch.optim"


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.001)


def start_one(out: Path, script: Path, n: int, server: ForkServer | None) -> tuple[float, float]:
    """Start one worker (forked from ``server``, or fresh); (request->pid, request->script)."""
    stamp = out / f"stamp_{n}"
    spec = ProcessSpec(
        local_rank=0,
        env={**os.environ, "STAMP": str(stamp), "OMP_NUM_THREADS": "1"},
        stdout=str(out / "worker.out"),
        stderr=str(out / "worker.err"),
    )
    procs = WorkerProcesses(
        Entrypoint(kind="script", target=str(script)), [spec], fork_server=server
    )
    t0 = time.monotonic()
    try:
        procs.start()
        started = time.monotonic() - t0
        if server is not None and procs.forked != [0]:
            raise SystemExit(f"the fork server did not fork: {procs.fork_refused}")
        wait(lambda: stamp.exists() and stamp.stat().st_size > 0, 300, "the worker's script")
        ran = float(stamp.read_text()) - t0
        wait(lambda: all(c is not None for c in procs.poll().values()), 60, "the worker's exit")
    finally:
        codes = procs.close(grace=5.0)
    if codes != {0: 0}:
        raise SystemExit(f"the worker failed: {codes}; see {out / 'worker.err'}")
    return started, ran


def report(name: str, starts: list[float], runs: list[float]) -> None:
    print(
        f"{name:<7} n={len(runs):<3} request -> pid: median {median(starts) * 1e3:7.1f} ms, "
        f"max {max(starts) * 1e3:7.1f} ms   request -> script: median "
        f"{median(runs) * 1e3:7.1f} ms, max {max(runs) * 1e3:7.1f} ms",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="forked workers")
    parser.add_argument("--fresh-runs", type=int, default=3, help="fresh interpreters")
    parser.add_argument("--modules", default=MODULES, help="comma-separated, to preload")
    args = parser.parse_args()
    modules = [m for m in args.modules.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="fork_latency_") as tmp:
        out = Path(tmp)
        preload = out / "modules.txt"
        preload.write_text("\n".join(modules) + "\n")
        script = out / "worker.py"
        script.write_text(
            "".join(f"import {m}\n" for m in modules)
            + "import os, time\n"
            + "with open(os.environ['STAMP'], 'w') as f:\n"
            + "    f.write(repr(time.monotonic()))\n"
        )
        t0 = time.monotonic()
        server = ForkServer(
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            preload_file=str(preload),
            log_file=str(out / "server.log"),
        )
        try:
            while not server.ready:
                if not server.alive():
                    raise SystemExit(f"the fork server died:\n{server.log_tail()}")
                server.pump(0.05)
            print(f"fork server ready in {time.monotonic() - t0:.2f} s: {', '.join(modules)}")
            forked = [start_one(out, script, n, server) for n in range(args.runs)]
            fresh = [start_one(out, script, args.runs + n, None) for n in range(args.fresh_runs)]
        finally:
            server.close()
        report("forked", [s for s, _ in forked], [r for _, r in forked])
        forks = [
            float(x)
            for x in re.findall(r"^forked \d+ in ([\d.]+) s$", server.log_tail(1 << 20), re.M)
        ]
        if forks:
            print(
                f"        fork() in the server: median {median(forks) * 1e3:.1f} ms, "
                f"max {max(forks) * 1e3:.1f} ms"
            )
        if fresh:
            report("fresh", [s for s, _ in fresh], [r for _, r in fresh])


if __name__ == "__main__":
    main()
