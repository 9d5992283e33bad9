"""Snapshots for the Hugging Face ``Trainer``: one after every optimizer step, and a
resume from the newest one, through the Trainer's own resume path.

    from relaunch.checkpoint import hf

    trainer = Trainer(model, args, ..., callbacks=[hf.SnapshotCallback()])
    trainer.train(resume_from_checkpoint=hf.resume_from(trainer))

:class:`SnapshotCallback` saves, at the end of every ``every``-th optimizer step, what
a ``checkpoint-N`` folder holds (the model's and the optimizer's state, the learning
rate scheduler's, the trainer state, the random generators') with
``relaunch.checkpoint.save`` (node memory, a copy on a peer node, no pickle).
:func:`resume_from` agrees with the other ranks on the newest step every rank holds
whole (``relaunch.checkpoint.load``) and writes it as a ``checkpoint-N`` folder in
this process's temporary directory, which ``Trainer.train(resume_from_checkpoint=...)``
resumes from exactly as from its own (the model, the optimizer, the scheduler, the
step, the data skipped, the random generators); None on a fresh start. The folder is
removed once training went on. A half-written snapshot is never restored.

Models the ``Trainer`` wraps itself are supported (single process, DDP); DeepSpeed and
FSDP keep their own sharded checkpoints.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import random
import shutil
import tempfile
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from relaunch import checkpoint
from relaunch.checkpoint._formats import check_every, restored_as, tagged
from relaunch.errors import SnapshotError

__all__ = ["SnapshotCallback", "resume_from"]

FORMAT = "relaunch.hf"
VERSION = 1
# the names of a Trainer checkpoint folder (transformers.trainer)
_STATE, _OPTIMIZER, _SCHEDULER, _WEIGHTS = (
    "trainer_state.json",
    "optimizer.pt",
    "scheduler.pt",
    "pytorch_model.bin",
)


class SnapshotCallback(TrainerCallback):
    """A snapshot of the Trainer's state after every ``every``-th optimizer step."""

    def __init__(self, every: int = 1) -> None:
        self.every = check_every(every, "hf.SnapshotCallback")
        self.resumed_from: str | None = None
        """The folder :func:`resume_from` wrote (removed once training went on)."""

    def on_step_end(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        self._forget_resume_folder()
        if state.global_step % self.every or model is None or optimizer is None:
            return
        # as the Trainer's own save does: the control's state goes in the trainer state
        state.stateful_callbacks["TrainerControl"] = control.state()
        snapshot = tagged(
            FORMAT,
            VERSION,
            model=model.state_dict(),
            optimizer=optimizer.state_dict(),
            scheduler=None if lr_scheduler is None else lr_scheduler.state_dict(),
            trainer_state=json.dumps(dataclasses.asdict(state), sort_keys=True),
            rng=_rng_state(),
        )
        checkpoint.save(state.global_step, snapshot)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._forget_resume_folder()
        checkpoint.wait()  # the last snapshot complete in node memory before the end

    def _forget_resume_folder(self) -> None:
        folder, self.resumed_from = self.resumed_from, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def resume_from(trainer: Any, *, replicated: bool = False) -> str | None:
    """The folder to pass as ``resume_from_checkpoint`` (None: a fresh start). Every
    rank must call it (the ranks agree over the default process group, which the
    Trainer's arguments set up under relaunch). ``replicated=True`` for plain data
    parallel training (no FSDP, no DeepSpeed): the state is the same on every rank, and
    is restored after a change of the world's size too (``checkpoint.load``)."""
    callback = next(
        (c for c in trainer.callback_handler.callbacks if isinstance(c, SnapshotCallback)), None
    )
    if callback is None:
        raise SnapshotError(
            "resume_from: the trainer has no hf.SnapshotCallback among its callbacks"
        )
    trainer.args.device  # noqa: B018  (sets up the default process group under relaunch)
    loaded = checkpoint.load(replicated=replicated)
    restored = restored_as(loaded, FORMAT, VERSION, "hf.SnapshotCallback")
    if restored is None:
        return None
    step, snap = restored
    folder = tempfile.mkdtemp(prefix=f"relaunch-hf-checkpoint-{step}-")
    atexit.register(shutil.rmtree, folder, True)
    with open(os.path.join(folder, _STATE), "w", encoding="utf-8") as f:
        f.write(snap["trainer_state"])
    torch.save(snap["model"], os.path.join(folder, _WEIGHTS))
    torch.save(snap["optimizer"], os.path.join(folder, _OPTIMIZER))
    if snap["scheduler"] is not None:
        torch.save(snap["scheduler"], os.path.join(folder, _SCHEDULER))
    args = trainer.args
    rng = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
    torch.save(_rng_for_trainer(snap["rng"]), os.path.join(folder, rng))
    callback.resumed_from = folder
    return folder


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": (version, tuple(internal), gauss),
        "numpy": (
            str(name),
            torch.from_numpy(np.array(keys, copy=True)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.random.get_rng_state_all()
    return out


def _rng_for_trainer(saved: dict[str, Any]) -> dict[str, Any]:
    """The random generators' states as the Trainer's ``rng_state*.pth`` holds them."""
    name, keys, pos, has_gauss, cached = saved["numpy"]
    out = {
        "python": saved["python"],
        "numpy": (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached),
        "cpu": saved["cpu"],
    }
    with contextlib.suppress(KeyError):
        out["cuda"] = saved["cuda"]
    return out
