"""What a snapshot's pinned buffer costs a restarted CUDA worker: made at its first
save, and unlocked by the driver when the process dies (before its agent sees it die).

    python bench/pinned_buffer.py [--sizes 1.15,12] [--runs 2]

Per size (GB) and way, each in a fresh process that has set up CUDA: the seconds to
make the buffer, a copy from the GPU into it (GB/s, ``non_blocking``), and the seconds
from the process's SIGKILL to its parent's ``waitpid`` returning. Ways: ``torch``
(``torch.empty(pin_memory=True)``: rounded up to a power of two, locked on one
thread) and ``relaunch`` (``checkpoint._staging.PinnedBuffer``: the exact size,
faulted in on threads, then ``cudaHostRegister``). Needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

CHILD = r"""
import sys, time, torch
from relaunch.checkpoint._fill import Filler
from relaunch.checkpoint._staging import PinnedBuffer
way, nbytes = sys.argv[1], int(float(sys.argv[2]) * 1e9)
source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
if way == "torch":
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
else:
    holder = PinnedBuffer(nbytes, Filler(8))
    buffer = holder.tensor
made = time.perf_counter() - t0
t0 = time.perf_counter()
buffer.copy_(source, non_blocking=True)
torch.cuda.synchronize()
copied = time.perf_counter() - t0
print(f"{made:.3f} {nbytes / copied / 1e9:.1f} {int(buffer.is_pinned())}", flush=True)
time.sleep(3600)
"""


def one(way: str, size: float) -> tuple[float, float, int, float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, way, str(size)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if len(line) != 3:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{way} {size} GB: the child printed {line}")
    time.sleep(0.5)
    t0 = time.perf_counter()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return float(line[0]), float(line[1]), int(line[2]), time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1.15,12", help="GB, comma-separated")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    print(
        f"{'GB':>6} {'way':<9} {'make s':>7} {'copy GB/s':>10} {'pinned':>7} {'kill->reaped s':>15}"
    )
    for size in (float(s) for s in args.sizes.split(",")):
        for way in ("torch", "relaunch"):
            rows = [one(way, size) for _ in range(args.runs)]
            made, rate, pinned, reaped = (statistics.median(col) for col in zip(*rows, strict=True))
            print(f"{size:6.2f} {way:<9} {made:7.3f} {rate:10.1f} {pinned:7.0f} {reaped:15.3f}")


if __name__ == "__main__":
    main()
