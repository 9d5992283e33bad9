"""DDP (or FSDP2: ``--fsdp``) training that saves with ``torch.distributed.checkpoint``
into the node's snapshots every step: a fault costs the step in flight.

    relaunch --nproc-per-node 2 --max-restarts 1 examples/dcp_train.py --kill 1:12
    relaunch --nproc-per-node 2 --max-restarts 1 examples/dcp_train.py --fsdp --kill 1:12

The lines that matter::

    reader = SnapshotReader()                       # the newest step every rank holds
    if reader.step is not None:
        dcp.load(state, storage_reader=reader)
    ...
    dcp.save(state, storage_writer=SnapshotWriter(step))

With ``--fsdp`` each rank holds a shard of every parameter and of its optimizer state
(DTensors, the last layer's split unevenly) and restores its own.
``--kill RANK:STEP`` SIGKILLs that rank after that step's update, before its save (first
attempt only); ``--log-to DIR`` writes one JSON line per step and rank and the final
weights' digest.
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
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from relaunch.checkpoint.dcp import SnapshotReader, SnapshotWriter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill", metavar="RANK:STEP", default=None)
    parser.add_argument("--log-to", default=None)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (sharded) instead of DDP")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    if args.fsdp:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    start = 0
    reader = SnapshotReader()
    if reader.step is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip
        start = reader.step + 1
    log = open(os.path.join(args.log_to, f"rank{rank}.jsonl"), "a") if args.log_to else None  # noqa: SIM115
    kill = tuple(int(v) for v in args.kill.split(":")) if args.kill else None
    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(step * 1000 + rank)  # the same batch per step
        x = torch.randn(8, 16, generator=gen)
        loss = (model(x) - x.sum(dim=1, keepdim=True).sin()).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if attempt == 0 and kill == (rank, step):
            os.kill(os.getpid(), signal.SIGKILL)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=SnapshotWriter(step))
        if log is not None:
            row = {"rank": rank, "world": world, "step": step, "attempt": attempt,
                   "resumed_from": start, "pid": os.getpid(), "t": time.time()}  # fmt: skip
            log.write(json.dumps(row) + "\n")
            log.flush()
    from relaunch import checkpoint

    checkpoint.wait()
    whole = [p.full_tensor() if args.fsdp else p for p in model.parameters()]  # type: ignore[operator]
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in whole)).hexdigest()
    if log is not None:
        log.write(json.dumps({"rank": rank, "final": digest}) + "\n")
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
