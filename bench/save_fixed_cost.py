"""What every snapshot save costs whatever the state's size: a tiny model, a save per step.

    python bench/save_fixed_cost.py [--saves 1000] [--load 2] [--rounds 2]

One process, one torch thread: two ``Linear`` layers and Adam, ``checkpoint``'s Saver
writing into a folder of /dev/shm with a node limit set (as the agent always sets it).
Prints per round: the time the training thread spends in ``save()``, how much longer
a step is with a save than without, and the process's CPU per save (the writer's
included). ``--load N`` runs N busy loops beside it (cores kept busy, as a data
loader's workers or the other ranks keep them). Run by hand, not in CI; to compare
with another commit, run it with ``PYTHONPATH=<that checkout>/src``.
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

from relaunch.checkpoint._layout import Where
from relaunch.checkpoint._saver import Saver


def measure(saves: int) -> tuple[float, float, float]:
    """(ms in save(), ms more per step, ms of CPU per save)."""
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="relaunch-bench-save-")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters())
    where = Where(root=root, job="bench", rank=0, world_size=1, keep=2, limit=32 << 30,
                  durable=None)  # fmt: skip
    saver = Saver(where)
    x = torch.randn(8, 16)

    def step() -> None:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()

    try:
        for i in range(50):  # warm
            step()
            saver.save(i, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        saver.wait()
        in_save = 0.0
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(50, 50 + saves):
            step()
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": i}
            t = time.perf_counter()
            saver.save(i, state)
            in_save += time.perf_counter() - t
        saver.wait()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        bare_cpu, bare_wall = time.process_time(), time.perf_counter()
        for _ in range(saves):
            step()
        bare_cpu, bare_wall = time.process_time() - bare_cpu, time.perf_counter() - bare_wall
    finally:
        saver.close()
        shutil.rmtree(root, ignore_errors=True)
    ms = 1000.0 / saves
    return in_save * ms, (wall - bare_wall) * ms, (cpu - bare_cpu) * ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=1000)
    parser.add_argument("--load", type=int, default=0, help="busy loops beside the job")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        print(f"{args.saves} saves of a tiny model, {args.load} busy loop(s) beside it")
        print(f"{'round':>5} {'in save() ms':>13} {'step + ms':>10} {'CPU ms/save':>12}")
        for r in range(args.rounds):
            held, longer, cpu = measure(args.saves)
            print(f"{r + 1:>5} {held:>13.3f} {longer:>10.3f} {cpu:>12.3f}", flush=True)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    print(f"relaunch from {os.path.dirname(sys.modules['relaunch'].__file__ or '')}")


if __name__ == "__main__":
    main()
