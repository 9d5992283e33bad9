"""``checkpoint.load(replicated=True)`` for a rank that holds nothing: the snapshot
crosses the process group from a rank that holds it.

    python bench/replicated_restore.py [--sizes 64,256,1024] [--repeat 3]

For each size (MB of float32 state): one rank saves it into a node directory in
/dev/shm (the world then had one rank); then two ranks load it, rank 0 on that
directory and rank 1 on an empty one (a node that joined): rank 1 receives the files
over gloo on loopback and reads them back (length and CRC-32 checked). Prints each
rank's ``load()`` seconds (median of ``--repeat``), and rank 1's MB/s. Beside it, the
same two ranks each reading their own copy (no transfer: the plain restart). Run by
hand, not in CI; in a loopback-only network namespace of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import in_loopback_netns

WORKER = textwrap.dedent(
    r"""
    import json, os, sys, time
    import torch, torch.distributed as dist
    from relaunch import checkpoint

    mode, mb = sys.argv[1], int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        store = dist.FileStore(os.environ["STORE"], world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    if mode == "save":
        checkpoint.save(0, {"w": torch.ones(mb << 18)})
        checkpoint.wait()
    else:
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        got = checkpoint.load(replicated=True)
        took = time.perf_counter() - t0
        assert got is not None and got[1]["w"].numel() == mb << 18
        print(json.dumps({"rank": rank, "seconds": took}), flush=True)
        dist.destroy_process_group()
    """
)


def _run(tmp: Path, mode: str, roots: list[Path], mb: int) -> list[float]:
    store = tmp / f"store-{len(list(tmp.glob('store-*')))}"
    procs = []
    for rank, root in enumerate(roots):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(roots)), "STORE": str(store),
            "RELAUNCH_SNAPSHOT_DIR": str(root), "TORCHELASTIC_RUN_ID": "bench",
            "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        cmd = [sys.executable, "-c", WORKER, mode, str(mb)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    seconds = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"a rank exited {proc.returncode}")
        seconds += [json.loads(line)["seconds"] for line in out.splitlines() if line]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="64,256,1024", help="MB of state, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    in_loopback_netns()
    print(f"{'MB':>6} {'received: rank 1 s':>19} {'rank 0 s':>9} {'MB/s':>7} {'both own s':>11}")
    for mb in (int(s) for s in args.sizes.split(",")):
        sent, held, own = [], [], []
        for _ in range(args.repeat):
            tmp = Path(tempfile.mkdtemp(prefix="relaunch-bench-rep-", dir="/dev/shm"))
            try:
                a, b = tmp / "node-a", tmp / "node-b"
                _run(tmp, "save", [a], mb)
                s0, s1 = _run(tmp, "load", [a, b], mb)
                held.append(s0)
                sent.append(s1)
                shutil.rmtree(b)
                shutil.copytree(a, b)  # now each rank's node holds a copy: no transfer
                own.append(max(_run(tmp, "load", [a, b], mb)))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        s1, s0 = statistics.median(sent), statistics.median(held)
        print(f"{mb:>6} {s1:>19.2f} {s0:>9.2f} {mb / s1:>7.0f} {statistics.median(own):>11.2f}")


if __name__ == "__main__":
    main()
