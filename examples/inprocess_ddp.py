"""A DDP job on gloo that survives an exception, a hang and a SIGKILL, in-process.

    python examples/inprocess_ddp.py --spawn 3      # plain processes, no launcher
    relaunch --standalone --nproc-per-node 3 examples/inprocess_ddp.py
    relaunch --standalone --nproc-per-node 3 --max-restarts 1 examples/inprocess_ddp.py
    python -m torch.distributed.run --standalone --nproc-per-node 3 examples/inprocess_ddp.py

Faults are injected on rank 1 (set ``--no-faults`` to train quietly):
iteration 0 raises an exception, iteration 1 hangs in ``time.sleep(3600)`` (woken
at the soft timeout), iteration 2 is SIGKILLed (the others go on with 2 ranks).
Every rank keeps an in-memory checkpoint of the model at each step, so a restart
resumes from the last step every surviving rank completed, with no file I/O, no
new process and no re-import.

Under ``relaunch --max-restarts 1`` the SIGKILLed rank is replaced: its agent forks a
new process that joins the next iteration and takes the checkpoint of a surviving rank
(``inprocess.broadcast_state``), so the job finishes at 3 ranks, from the step it was
at. torchrun stops every worker when one dies, so under torchrun the job survives the
exception and the hang, and the SIGKILL ends it. With ``--spawn`` (standalone: the
coordination store is hosted by rank 0's monitor process) it survives all three.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from relaunch import inprocess

log = logging.getLogger("inprocess_ddp")


class Checkpoint:
    """The last consistent training state, kept in memory across restarts."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.optimizer_state: dict[str, Any] | None = None
        self.step = 0


def inject(args: argparse.Namespace, iteration: int, step: int) -> None:
    if args.no_faults or int(os.environ["RANK"]) != 1 or step != 5:
        return
    fault = {0: "exception", 1: "hang", 2: "sigkill"}.get(iteration)
    if fault is not None:
        log.warning("injecting %s at iteration %s, step %s", fault, iteration, step)
    if fault == "exception":
        raise RuntimeError("injected exception")
    if fault == "hang":
        time.sleep(3600)
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


def make_train(args: argparse.Namespace, ckpt: Checkpoint) -> Any:
    @inprocess.Wrapper(
        soft_timeout=datetime.timedelta(seconds=args.soft_timeout),
        hard_timeout=datetime.timedelta(seconds=args.soft_timeout * 2),
        heartbeat_timeout=datetime.timedelta(seconds=10),
        barrier_timeout=datetime.timedelta(seconds=60),
        health_check=inprocess.CudaHealthCheck(),
    )
    def train(call_wrapper: inprocess.CallWrapper | None = None) -> float:
        assert call_wrapper is not None
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        # A replacement process (relaunch --max-restarts N replaces a rank whose process
        # died) starts with nothing: it takes the checkpoint of a surviving rank, in
        # memory; after a restart, a survivor a step behind takes it too. In the
        # first iteration, with no new rank, this returns at once, without a collective.
        state = inprocess.broadcast_state(
            call_wrapper,
            {
                "model": ckpt.model.state_dict(),
                "optimizer": ckpt.optimizer_state,
                "step": ckpt.step,
            },
            version=ckpt.step,
        )
        ckpt.model.load_state_dict(state["model"])
        ckpt.optimizer_state, ckpt.step = state["optimizer"], state["step"]
        model = DistributedDataParallel(copy.deepcopy(ckpt.model))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        if ckpt.optimizer_state is not None:
            optimizer.load_state_dict(ckpt.optimizer_state)
        log.warning(
            "iteration %s: rank %s of %s resumes at step %s",
            call_wrapper.iteration,
            rank,
            world,
            ckpt.step,
        )
        generator = torch.Generator().manual_seed(rank)
        loss = torch.zeros(())
        for step in range(ckpt.step, args.steps):
            inject(args, call_wrapper.iteration, step)
            x = torch.randn(64, 32, generator=generator)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with call_wrapper.atomic():  # a restart never sees half a checkpoint
                ckpt.model.load_state_dict(model.module.state_dict())
                ckpt.optimizer_state = copy.deepcopy(optimizer.state_dict())
                ckpt.step = step + 1
            call_wrapper.ping()
        del model, optimizer  # free DDP before its process group (see train_ddp.py)
        dist.destroy_process_group()
        return float(loss.detach())

    return train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--soft-timeout", type=float, default=3.0)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--spawn", type=int, default=0, help="start this many ranks here")
    args = parser.parse_args()
    if args.spawn:
        raise SystemExit(spawn(args.spawn))
    logging.basicConfig(
        level=logging.WARNING, format=f"[{os.environ.get('RANK', '?')}] %(name)s: %(message)s"
    )
    started = time.monotonic()
    loss = make_train(args, Checkpoint())()
    log.warning("finished: loss %s in %.1f s", loss, time.monotonic() - started)


def spawn(world: int) -> int:
    """Start ``world`` ranks of this script as plain processes; return the worst exit code."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [a for a in sys.argv[1:] if not a.startswith("--spawn")]
    if "--spawn" in sys.argv:
        index = sys.argv.index("--spawn")
        argv = sys.argv[1:index] + sys.argv[index + 2 :]
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    codes = [p.wait() for p in procs]
    print(f"exit codes: {codes}")
    return 0 if sum(c == 0 for c in codes) >= world - 1 else 1


if __name__ == "__main__":
    main()
