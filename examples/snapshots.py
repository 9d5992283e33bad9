"""DDP training that loses at most one step per fault: a snapshot every step.

    relaunch --nproc-per-node 2 --max-restarts 3 examples/snapshots.py --steps 300

Every step ends with ``checkpoint.save(step, state)``: the tensors are copied into the
node's snapshot directory (node memory, /dev/shm) and the call returns. When a worker
dies (``kill -9`` one of them while it runs), the agent restarts the group and every
rank resumes with ``checkpoint.load()`` from the newest step all ranks hold: at most
the step in flight is redone. ``--checkpoint-dir DIR`` on the ``relaunch`` line also
copies the snapshots to DIR in the background; a job started again with the same
``--rdzv-id`` and ``--checkpoint-dir`` resumes from there.

Options for trying faults: ``--kill RANK:STEP`` makes that rank SIGKILL itself at that
step (first attempt only); ``--log-to DIR`` writes one line per step and rank.
``--device cuda`` trains on the GPU (``cuda:LOCAL_RANK`` modulo the GPUs there are;
deterministic kernels, so a resumed run's weights are bit for bit a fault-free run's):
the snapshots then copy CUDA tensors, through pinned memory, beside the next step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from relaunch import checkpoint


def _started() -> float:
    """When this process began (its fork), in ``time.time()``'s clock: Linux only."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


# the parts of a (re)start, written to --log-to: where a fault's seconds go
PHASES = {"exec": _started(), "imported": time.time()}


def build_model(millions: float) -> nn.Module:
    """The tiny default model, or about ``millions`` million parameters."""
    if millions <= 0:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    width = 1024
    hidden = max(1, round(millions * 1e6 / (width * width + width)))
    layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(hidden):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill", metavar="RANK:STEP", default=None)
    parser.add_argument("--kill-after-save", action="store_true",
                        help="kill right after that step's save() returned (mid-save)")  # fmt: skip
    parser.add_argument("--extra-mb", type=int, default=0,
                        help="an extra tensor of this many MB in the state")  # fmt: skip
    parser.add_argument("--params", metavar="MILLIONS", type=float, default=0.0,
                        help="a model of about this many million parameters (hidden "
                             "layers 1024 wide) instead of the tiny default")  # fmt: skip
    parser.add_argument("--log-to", metavar="DIR", default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument(
        "--linger",
        metavar="RANK:SECONDS",
        default=None,
        help="a run from step 0: RANK waits SECONDS after its last step (a "
        "node lost while the others wait at the exit barrier)",
    )
    parser.add_argument("--disk-every", metavar="K", type=int, default=0,
                        help="no snapshots: rank 0 torch.saves to --disk-dir every K steps "
                             "(the usual script, for comparison; runs under torchrun)")  # fmt: skip
    parser.add_argument("--disk-dir", default=None)
    parser.add_argument("--replicated", action="store_true",
                        help="load(replicated=True): the state is the same on every rank, so "
                             "it is restored after the world's size changed too")  # fmt: skip
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", default="gloo", help="the process group's backend")
    args = parser.parse_args()

    device = torch.device("cpu")
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        )
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    PHASES["group"] = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    extra = torch.zeros(args.extra_mb * (1 << 18), device=device)  # float32: 4 bytes each
    start = 0
    disk = os.path.join(args.disk_dir or ".", "ckpt.pt")
    if args.disk_every:
        restored = torch.load(disk, weights_only=True) if os.path.exists(disk) else None
    else:
        restored = checkpoint.load(replicated=args.replicated)
    PHASES["loaded"] = time.time()
    torch.manual_seed(0)
    if restored is None:
        model = build_model(args.params).to(device)
    else:
        # a restart: every weight comes from the snapshot, so the model is built on the
        # meta device (no memory, no random init) and takes the restored tensors as
        # they are (at 100M parameters on CPU, 1-2 s less per restart, and a faster
        # first step: the weights' memory is already the process's)
        with torch.device("meta"):
            model = build_model(args.params)
        model.load_state_dict(restored[1]["model"], assign=True)
        model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if restored is not None:
        done, state = restored
        optimizer.load_state_dict(state["optimizer"])
        start = done + 1
    PHASES["built"] = time.time()
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    log = open(os.path.join(args.log_to, f"rank{rank}.jsonl"), "a") if args.log_to else None  # noqa: SIM115
    if log is not None:
        log.write(json.dumps({"rank": rank, "attempt": attempt, "phases": PHASES}) + "\n")
    kill_rank, kill_step = (int(x) for x in args.kill.split(":")) if args.kill else (-1, -1)
    for step in range(start, args.steps):
        # the same batch for the same (rank, step), whatever happened before
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(8, 16, generator=gen).to(device)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if attempt == 0 and rank == kill_rank and step == kill_step and not args.kill_after_save:
            # the previous step's snapshot is whole (its writer may lag a loaded
            # machine by a step): the step in flight is the one lost
            checkpoint.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if args.extra_mb:
            state["extra"] = extra
        if attempt == 0 and step == kill_step and args.kill_after_save:
            # every rank holds the step before whole before any starts this one, so
            # only the killed rank's snapshot of this step is cut short (killed right
            # after save() returns, while its writer still copies)
            checkpoint.wait()
            dist.barrier()
        if not args.disk_every:
            checkpoint.save(step, state)
        elif rank == 0 and (step + 1) % args.disk_every == 0:
            torch.save((step, state), disk + ".tmp")
            os.replace(disk + ".tmp", disk)
        if attempt == 0 and rank == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if log is not None:
            doc = {"rank": rank, "world": world, "step": step, "attempt": attempt,
                   "resumed_from": start, "pid": os.getpid(), "t": time.time()}  # fmt: skip
            log.write(json.dumps(doc) + "\n")
            log.flush()
        if args.sleep:
            time.sleep(args.sleep)
    if not args.disk_every:
        checkpoint.wait()
    digest = hashlib.sha256(
        b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
    ).hexdigest()
    if log is not None:
        log.write(json.dumps({"rank": rank, "final": digest, "attempt": attempt}) + "\n")
        log.close()
    if args.linger and start == 0 and rank == int(args.linger.split(":")[0]):
        time.sleep(float(args.linger.split(":")[1]))
    if rank == 0:
        print(f"trained {args.steps} steps (resumed at step {start}); weights {digest[:16]}")
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
