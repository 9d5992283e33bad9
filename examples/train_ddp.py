"""A small DDP training job on gloo (CPU) that survives an injected failure.

Run it under relaunch (or torchrun):

    relaunch --standalone --nproc-per-node=2 --max-restarts=1 examples/train_ddp.py --steps 40 --fail-at-step 15

On the first attempt, rank ``--fail-rank`` raises at ``--fail-at-step``; the
agent restarts the workers, which resume from the last checkpoint and finish.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from relaunch.errors import record


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fail-at-step", type=int, default=-1, help="-1: never fail")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument(
        "--checkpoint", default="", help="checkpoint file (default: a temp file per run)"
    )
    parser.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    return parser.parse_args()


def checkpoint_path(args: argparse.Namespace) -> str:
    if args.checkpoint:
        return str(args.checkpoint)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    return os.path.join(tempfile.gettempdir(), f"relaunch_demo_{run_id}.pt")


@record
def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    path = checkpoint_path(args)
    start = 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        if rank == 0:
            print(f"[attempt {attempt}] resumed from step {start}", flush=True)
    gen = torch.Generator().manual_seed(1234 + rank)
    w_true = torch.arange(16, dtype=torch.float32) / 16
    for step in range(start, args.steps):
        if step == args.fail_at_step and rank == args.fail_rank and attempt == 0:
            raise RuntimeError(f"injected failure at step {step} on rank {rank}")
        x = torch.randn(64, 16, generator=gen)
        y = (x @ w_true).unsqueeze(1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_time)
        if rank == 0 and (step + 1) % args.checkpoint_every == 0:
            tmp = path + ".tmp"
            torch.save(
                {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp
            )
            os.replace(tmp, path)
        if rank == 0 and step % 5 == 0:
            print(
                f"[attempt {attempt}] step {step:3d} loss {loss.item():.4f} (world {world})",
                flush=True,
            )
    dist.barrier()
    if rank == 0:
        print(
            f"[attempt {attempt}] done: {args.steps} steps, final loss {loss.item():.4f}",
            flush=True,
        )
        if os.path.exists(path) and not args.checkpoint:
            os.remove(path)
    # Free DDP before its process group: if its reducer held the group's last
    # reference, gloo's threads would be joined under the GIL (a rare deadlock).
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
