"""The pause a snapshot costs a training step: ``relaunch.checkpoint.save`` (node memory,
/dev/shm) beside ``torch.save`` to a file, for models of about 10M and 100M parameters
with Adam (state: weights + two moments, 3x the parameters), on the CPU or a GPU: square
layers of ``--width`` (2048: a few large tensors; 256: thousands of small ones, whose
count, not their bytes, is what a save pays for).

    python bench/snapshot_save.py [--sizes 10,100] [--reps 5] [--rounds 4] [--width 2048]
                                  [--device cuda --batch 8192] [--no-torch-save]

Prints, per size: one training step (forward, backward, Adam) without snapshots, the
same with ``save()`` after every step (the last one waited for); the pause: the time
the training thread is held per step (in ``save()``, and waiting before the optimizer
step for the copy of the previous save to finish), also as a share of the step; the
slowdown: the difference of the two step times, which is more than the pause where
the writer thread's copy and checksum compete with the step for cores and memory
bandwidth (on a GPU node the step runs on the GPU and the copy does not compete); a
snapshot alone: ``save()`` until the snapshot is complete with nothing else running
(the shortest step a snapshot every step can hide behind); and one ``torch.save`` of
the same state to a file. On a GPU (``--device cuda``, TF32
matrix products) the state's CUDA tensors are copied to node memory on a copy
stream beside the next step, and the optimizer's stream waits for that copy: the
pause is then the wait for the previous snapshot to be whole (``save`` waits for it)
where a snapshot takes longer than a step; ``--batch`` sets the step's size.

The step times come from blocks of ``--reps`` steps, without and with snapshots taken
in turn, ``--rounds`` times (a GPU's clock drifts by a few % over a minute: blocks taken
minutes apart measured that drift, not the snapshots); the slowdown is the median over
the rounds of each round's difference, and ``noise`` the spread of the plain blocks.
On a GPU a third block in each round copies the same tensors to the host with nothing
but torch (one pinned buffer, a side stream, the optimizer's stream waiting for it):
``floor`` is that bare copy's slowdown, what any snapshot of the state costs the step.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn


def build(
    million: int, device: torch.device, width: int = 2048
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    layers = max(1, round(million * 1e6 / (width * width)))
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optimizer, width


_steps = itertools.count()


class BareCopy:
    """The floor on a GPU: every CUDA tensor of the state copied to one pinned host
    buffer on a side stream after the step's work, the optimizer's stream waiting for
    it, and nothing else (no file, no checksum)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self.buffer: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None

    def before_step(self) -> None:
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)

    def copy(self, state: dict[str, object]) -> None:
        tensors = [t for t in _tensors(state) if t.is_cuda]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        offset = 0
        with torch.cuda.stream(self.stream):
            for t in tensors:
                flat = t.detach().reshape(-1).view(torch.uint8)
                self.buffer[offset : offset + flat.numel()].copy_(flat, non_blocking=True)
                offset += flat.numel()
        self.done = torch.cuda.Event()
        self.done.record(self.stream)


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    reps: int,
    mode: str,
    bare: BareCopy | None = None,
) -> tuple[float, float]:
    """Seconds per step of ``reps`` steps, with a snapshot after each (``mode`` "save"),
    the bare copy after each ("copy"), or nothing ("plain"); and the seconds per step
    the training thread was held by the snapshots. The last snapshot's checksum and
    rename, which a long run overlaps with its next step, are waited for after the
    clock stops."""
    from relaunch import checkpoint

    held = 0.0
    sync = torch.cuda.synchronize if x.is_cuda else lambda: None
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        step = next(_steps)  # steps grow, as in training (a step saved again is a restart's)
        model(x).pow(2).mean().backward()
        t = time.perf_counter()
        checkpoint.wait_copied()  # what the optimizer's pre-step hook would wait for
        held += time.perf_counter() - t
        if mode == "copy" and bare is not None:
            bare.before_step()
        optimizer.step()
        optimizer.zero_grad()
        state = {"model": model.state_dict(), "opt": optimizer.state_dict()}
        t = time.perf_counter()
        if mode == "save":
            checkpoint.save(step, state)
        elif mode == "copy" and bare is not None:
            bare.copy(state)
        held += time.perf_counter() - t
    sync()
    seconds = time.perf_counter() - t0
    checkpoint.wait()
    return seconds / reps, held / reps


def in_turn(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, reps: int, rounds: int
) -> dict[str, list[tuple[float, float]]]:
    """Blocks of ``reps`` steps per mode, the modes taken in turn, ``rounds`` times."""
    modes = ["plain", "save"] + (["copy"] if x.is_cuda else [])
    bare = BareCopy() if x.is_cuda else None
    for mode in modes:  # warm: Adam's state, the first files, the pinned buffer
        train(model, optimizer, x, 3, mode, bare)
    blocks: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            blocks[mode].append(train(model, optimizer, x, reps, mode, bare))
    return blocks


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def slowdown(blocks: dict[str, list[tuple[float, float]]], mode: str) -> float:
    """The median over the rounds of the block's step time against the round's plain."""
    return statistics.median(
        max(b[0] / p[0] - 1.0, 0.0) for b, p in zip(blocks[mode], blocks["plain"], strict=True)
    )


def snapshot_alone(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Seconds from ``save()`` until its snapshot is complete, nothing else running."""
    from relaunch import checkpoint

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    checkpoint.save(next(_steps), {"model": model.state_dict(), "opt": optimizer.state_dict()})
    checkpoint.wait()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10,100", help="millions of parameters")
    parser.add_argument("--reps", type=int, default=5, help="steps per block")
    parser.add_argument("--rounds", type=int, default=4, help="blocks per mode, in turn")
    parser.add_argument("--batch", type=int, default=64, help="rows per step")
    parser.add_argument(
        "--width", type=int, default=2048, help="the layers' width (256: thousands of tensors)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-torch-save", action="store_true", help="skip torch.save")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="relaunch-bench-snap-", dir=base)
    disk = tempfile.mkdtemp(prefix="relaunch-bench-torchsave-")
    os.environ.update(RELAUNCH_SNAPSHOT_DIR=root, RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name()}, batch {args.batch}, TF32")

    print(f"{'params':>8} {'state MB':>9} {'step s':>8} {'with save s':>12} {'pause ms':>9} "
          f"{'pause/step':>11} {'slowdown/step':>14} {'floor':>6} {'noise':>6} {'alone ms':>9} "
          f"{'torch.save ms':>14}")  # fmt: skip
    try:
        for million in (int(x) for x in args.sizes.split(",")):
            model, optimizer, width = build(million, device, args.width)
            x = torch.randn(args.batch, width, device=device)

            blocks = in_turn(model, optimizer, x, args.reps, args.rounds)
            plain = statistics.median(b[0] for b in blocks["plain"])
            saving = statistics.median(b[0] for b in blocks["save"])
            pause = statistics.median(b[1] for b in blocks["save"])
            spread = [b[0] for b in blocks["plain"]]
            noise = (max(spread) - min(spread)) / plain
            floor = slowdown(blocks, "copy") if "copy" in blocks else float("nan")
            alone = statistics.median(snapshot_alone(model, optimizer) for _ in range(3))
            torch_save = float("nan")
            if not args.no_torch_save:
                t0 = time.perf_counter()
                torch.save(
                    {"model": model.state_dict(), "opt": optimizer.state_dict()},
                    os.path.join(disk, "ckpt.pt"),
                )
                torch_save = time.perf_counter() - t0
            n = sum(p.numel() for p in model.parameters())
            mb = 3 * n * 4 / 2**20
            slower = slowdown(blocks, "save")
            print(f"{n / 1e6:7.1f}M {mb:9.0f} {plain:8.2f} {saving:12.2f} {pause * 1e3:9.1f} "
                  f"{pause / plain:10.1%} {slower:14.1%} {_share(floor):>6} {noise:6.1%} "
                  f"{alone * 1e3:9.1f} {torch_save * 1e3:14.0f}")  # fmt: skip
            del model, optimizer, x
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
