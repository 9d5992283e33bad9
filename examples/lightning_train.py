"""A PyTorch Lightning job with a snapshot after every step (a small regression model,
DDP on gloo, CPU): a fault costs the step in flight, not the work since the last
checkpoint.

    relaunch --nproc-per-node=2 --max-restarts=1 examples/lightning_train.py --kill 1:12

The line that matters::

    trainer = Trainer(..., callbacks=[snapshots.SnapshotCallback()])

``--kill RANK:STEP`` SIGKILLs that rank after that step in the first attempt, before
the step's snapshot; ``--log-to DIR`` writes one JSON line per step and rank
(``rank<r>.jsonl``) and the final weights' digest. ``--batches-per-epoch`` sets the
epoch length (Lightning resumes a step in the middle of an epoch from the epoch's
first batch unless the data loader keeps its state).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from relaunch.checkpoint import lightning as snapshots


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


class Faults(pl.Callback):
    """Logs each step; kills this rank at ``kill`` in the first attempt."""

    def __init__(self, kill: tuple[int, int] | None, log_to: str | None, sleep: float) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.kill, self.sleep, self.start = kill, sleep, 0
        self._out = None
        if log_to:
            self._out = open(os.path.join(log_to, f"rank{self.rank}.jsonl"), "a")  # noqa: SIM115

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.start = trainer.global_step  # 0, or the step resumed from

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        step = trainer.global_step
        if self._out is not None:
            row = {"rank": self.rank, "attempt": self.attempt, "step": step,
                   "resumed_from": self.start, "pid": os.getpid(), "t": time.time()}  # fmt: skip
            self._out.write(json.dumps(row) + "\n")
            self._out.flush()
        if self.attempt == 0 and self.kill == (self.rank, step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.sleep:
            time.sleep(self.sleep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batches-per-epoch", type=int, default=4)
    parser.add_argument("--kill", default=None, metavar="RANK:STEP")
    parser.add_argument("--log-to", default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--replicated", action="store_true",
                        help="SnapshotCallback(replicated=True): DDP's state is every rank's, "
                             "so it is restored after the world's size changed too")  # fmt: skip
    args = parser.parse_args()
    kill = tuple(int(v) for v in args.kill.split(":")) if args.kill else None
    world = int(os.environ.get("WORLD_SIZE", "1"))

    pl.seed_everything(0, workers=True, verbose=False)
    g = torch.Generator().manual_seed(0)
    n = 8 * world * args.batches_per_epoch
    x = torch.randn(n, 16, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    snapshot = snapshots.SnapshotCallback(replicated=args.replicated)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        strategy="ddp" if world > 1 else "auto", max_steps=args.steps,
        callbacks=[Faults(kill, args.log_to, args.sleep), snapshot],
        enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
    )  # fmt: skip
    model = Model()
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True))
    digest = hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    ).hexdigest()
    if args.log_to:
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(args.log_to, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"rank": rank, "final": digest}) + "\n")
    print(f"rank {os.environ.get('RANK', '0')}: done, weights {digest[:16]}", flush=True)


if __name__ == "__main__":
    main()
