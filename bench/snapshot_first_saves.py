"""What a process's first snapshots cost on a GPU: a new data file takes the pinned
buffer (made at the first save that needs it), a reused one's mapping is page-locked
once (then the CUDA copies land in it), by ``save`` or, ahead, by the writer.

    python bench/snapshot_first_saves.py [--params 1000] [--batch 8192]

A first process (a new job) saves 3 snapshots of a model with Adam (about 12 bytes of
state per parameter); a second one, with the same state and snapshot directory (a
restarted worker, its last life's snapshots in node memory), saves 4. Three training
steps follow each save. Printed per save: the milliseconds the training thread was
held in ``save()``, of the three steps, and of the wait for the snapshot after them.
Needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn


def child(root: str, million: int, batch: int, saves: int, first: int) -> None:
    os.environ.update(RELAUNCH_SNAPSHOT_DIR=root, RANK="0", WORLD_SIZE="1")
    from relaunch import checkpoint

    torch.set_float32_matmul_precision("high")
    width = 2048
    layers = max(1, round(million * 1e6 / (width * width)))
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device="cuda")

    def step() -> None:
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    torch.cuda.synchronize()
    rows = []
    for i in range(saves):
        t0 = time.perf_counter()
        checkpoint.save(first + i, {"model": model.state_dict(), "opt": optimizer.state_dict()})
        t1 = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        checkpoint.wait()
        t3 = time.perf_counter()
        rows.append(f"{(t1 - t0) * 1e3:7.0f} {(t2 - t1) * 1e3:9.0f} {(t3 - t2) * 1e3:7.0f}")
    print("\n".join(f"{first + i:5d} {row}" for i, row in enumerate(rows)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=int, default=1000, help="millions of parameters")
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument(
        "--child", nargs=3, metavar=("ROOT", "SAVES", "FIRST"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        root, saves, first = args.child
        child(root, args.params, args.batch, int(saves), int(first))
        return
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None,
                            prefix="relaunch-bench-first-saves-")  # fmt: skip
    try:
        print(f"{args.params}M parameters, {torch.cuda.get_device_name()}")
        print(f"{'step':>5} {'save ms':>7} {'3 steps':>9} {'wait ms':>7}")
        for title, saves, first in (("a new job", 3, 0), ("its worker restarted", 4, 3)):
            print(f"-- {title}", flush=True)
            subprocess.run(
                [sys.executable, __file__, "--params", str(args.params), "--batch", str(args.batch),
                 "--child", root, str(saves), str(first)],
                check=True,
            )  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
