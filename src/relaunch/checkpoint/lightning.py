"""Snapshots for PyTorch Lightning: one after every training step, and a resume from the
newest one, through Lightning's own restore path. One line:

    from relaunch.checkpoint import lightning as snapshots

    trainer = Trainer(..., callbacks=[snapshots.SnapshotCallback()])
    trainer.fit(model, datamodule)          # resumes by itself after a fault

:class:`SnapshotCallback` saves, after every ``every``-th optimizer step, what a
Lightning checkpoint holds (``Trainer``'s own ``dump_checkpoint``: weights, optimizer
and scheduler states, loop progress, callbacks' states) with
``relaunch.checkpoint.save`` (node memory, a copy on a peer node, no pickle). When the
trainer sets up (the default process group is there by then), the ranks agree on the
newest step every rank holds whole (``relaunch.checkpoint.load``) and hand it to the
trainer as the checkpoint to restore, exactly as ``fit(ckpt_path=...)`` would. A
half-written snapshot is never restored.

Lightning resumes a step in the middle of an epoch from the epoch's first batch unless
the data loader keeps its own state (``torchdata``'s ``StatefulDataLoader``): with a
plain ``DataLoader`` the steps are not redone but the batches are not the ones a
fault-free run would have seen. Checked with pytorch-lightning 2.6 (the restore sets the
checkpoint connector's loaded checkpoint, the one thing this module reaches into).
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning import Callback

from relaunch import checkpoint
from relaunch.checkpoint._formats import check_every, restored_as, tagged

__all__ = ["SnapshotCallback"]

FORMAT = "relaunch.lightning"
VERSION = 1


class SnapshotCallback(Callback):
    """A snapshot of the trainer's state after every ``every``-th optimizer step, and the
    newest one restored when ``fit`` starts (``restore=False``: never). ``replicated=True``
    for a strategy whose state is the same on every rank (DDP, not FSDP or DeepSpeed):
    it is restored after a change of the world's size too (``checkpoint.load``)."""

    def __init__(self, every: int = 1, *, restore: bool = True, replicated: bool = False) -> None:
        self.every = check_every(every, "lightning.SnapshotCallback")
        self.restore = restore
        self.replicated = replicated
        self.restored_step: int | None = None
        """The step restored when ``fit`` started (None: a fresh start)."""
        self._saved: int | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or not self.restore:
            return
        loaded = checkpoint.load(replicated=self.replicated)
        restored = restored_as(loaded, FORMAT, VERSION, "lightning.SnapshotCallback")
        if restored is None:
            return
        step, snap = restored
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = snap["checkpoint"]  # restored as fit(ckpt_path=) does
        self.restored_step = step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._saved or step % self.every:
            return  # no optimizer step in this batch (gradient accumulation), or not due
        dumped = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint.save(step, tagged(FORMAT, VERSION, checkpoint=dumped))
        self._saved = step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        checkpoint.wait()  # the last snapshot complete in node memory before the end
