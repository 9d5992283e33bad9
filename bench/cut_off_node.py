"""A node cut off from the network, relaunch vs torchrun, side by side: same job, same run.

    python bench/cut_off_node.py [--runs 2] [--load 2] [--limit 90]

Two nodes, each in a network namespace of its own (veth pairs into a bridge, made and
removed here; needs root), c10d rendezvous with the store on node 0, ``--nnodes
1:2`` x 1 gloo worker. Once both train, node 1's link is set down: a cable pulled, no
close ever reaches either side. Measured from the cut:

- ``others``: node 0's worker training again (alone, world 1);
- ``cut-off``: node 1's agent exiting by itself (its workers stopped), or not within
  ``--limit`` seconds. A node that cannot reach its job any more should say so and
  free its machine (its GPUs) for the scheduler, not sit in a store read.

torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. Run by hand, not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import fmt, in_loopback_netns

from multinode_support.cluster import WORKER
from multinode_support.netns import Net
from relaunch.procs._sys import descendants

PY = sys.executable
LAUNCHERS = {
    "relaunch": [PY, "-m", "relaunch", "--no-warm-standby"],
    "torchrun": [PY, "-m", "torch.distributed.run"],
}
PORT = 29455


def _worlds(out: Path, node: str) -> set[int]:
    """The world sizes of the steps node ``node``'s workers logged."""
    worlds = set()
    for path in out.glob(f"steps_{node}_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 7 and parts[0] == "step":
                worlds.add(int(parts[4]))
    return worlds


def one_cut(name: str, tmp: Path, run: int, limit: float) -> tuple[float | None, float | None]:
    """Seconds from the cut until node 0 trains alone, and until node 1's agent exits
    (None: not within ``limit``)."""
    work = tmp / f"{name}_{run}"
    out = work / "steps"
    out.mkdir(parents=True)
    script = work / "worker.py"
    script.write_text(WORKER)
    go = work / "go"
    net = Net(2, tag="co", octet=217)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, ns in enumerate(net.spaces):
            cmd = [
                "ip", "netns", "exec", ns, *LAUNCHERS[name],
                "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={net.addr(0)}:{PORT}",
                f"--rdzv-id=cut{run}", f"--local-addr={net.addr(i)}", "--monitor-interval=0.1",
                f"--rdzv-conf=is_host={int(i == 0)},join_timeout=60,last_call_timeout=1",
                str(script), str(out), "train", f"go={go}", "steps=3",
            ]  # fmt: skip
            env = {
                **os.environ, "MN_NODE": str(i), "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": net.inner(i), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            }  # fmt: skip
            with open(work / f"agent_{i}.out", "wb") as log:
                procs.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
                )  # fmt: skip
        deadline = time.monotonic() + 120
        while _worlds(out, "0") != {2} or _worlds(out, "1") != {2}:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{name}: the two nodes never trained together ({work})")
            time.sleep(0.1)
        cut = time.monotonic()
        net.cut(1)
        others = exited = None
        while time.monotonic() - cut < limit and (others is None or exited is None):
            if others is None and 1 in _worlds(out, "0"):
                others = time.monotonic() - cut
            if exited is None and procs[1].poll() is not None:
                exited = time.monotonic() - cut
            time.sleep(0.05)
        return others, exited
    finally:
        go.touch()
        _stop(procs)
        net.remove()


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Every agent and worker of the run gone (torchrun's workers in sessions of their own)."""
    pids = [pid for proc in procs for pid in (proc.pid, *descendants(proc.pid))]
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    end = time.monotonic() + 15
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for proc in procs:
        proc.wait(timeout=30)


def main() -> None:
    in_loopback_netns()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the job")
    parser.add_argument("--limit", type=float, default=90.0, help="seconds to wait after the cut")
    parser.add_argument("--only", choices=tuple(LAUNCHERS), help="one launcher only")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: it makes network namespaces")
    busy = [subprocess.Popen([PY, "-c", "while True: pass"]) for _ in range(args.load)]
    results: dict[str, tuple[list[float], list[float], int]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="relaunch-cut-") as tmp:
            for name in [args.only] if args.only else list(LAUNCHERS):
                others, exits, stuck = [], [], 0
                for run in range(args.runs):
                    o, e = one_cut(name, Path(tmp), run, args.limit)
                    if o is not None:
                        others.append(o)
                    if e is None:
                        stuck += 1
                    else:
                        exits.append(e)
                    print(f"{name} run {run}: others training again "
                          f"{'-' if o is None else f'{o:.2f} s'}, cut-off agent exited "
                          f"{'not within the limit' if e is None else f'{e:.2f} s'}",
                          flush=True)  # fmt: skip
                results[name] = (others, exits, stuck)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    print(f"\nnode 1 cut off (2 nodes, c10d store on node 0, load {args.load}), from the cut:")
    for name, (others, exits, stuck) in results.items():
        print(f"  {name:8s} others training again: {fmt(others)}")
        print(f"  {name:8s} cut-off agent exited:   {fmt(exits)}"
              f"{f'; {stuck} of {args.runs} not within {args.limit:g} s' if stuck else ''}")  # fmt: skip


if __name__ == "__main__":
    main()
