"""A Hugging Face Trainer job with a snapshot after every step (a tiny Llama, random
tokens, gloo on the CPU): a fault costs the step in flight, not the work since the
last checkpoint-N.

    relaunch --nproc-per-node=2 --max-restarts=1 examples/hf_trainer.py --kill 1:12

The two lines that matter::

    trainer = Trainer(..., callbacks=[hf.SnapshotCallback()])
    trainer.train(resume_from_checkpoint=hf.resume_from(trainer))

``--kill RANK:STEP`` SIGKILLs that rank at the end of that step in the first attempt,
before the step's snapshot; ``--log-to DIR`` writes one JSON line per step and rank
(``rank<r>.jsonl``) and the final weights' digest.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import shutil
import signal
import tempfile
import time
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from relaunch.checkpoint import hf


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Faults(TrainerCallback):  # type: ignore[misc]
    """Logs each step; kills this rank at ``kill`` in the first attempt."""

    def __init__(self, kill: tuple[int, int] | None, log_to: str | None, sleep: float) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.kill, self.sleep, self.start = kill, sleep, None
        self.log = None
        if log_to:
            self.log = open(os.path.join(log_to, f"rank{self.rank}.jsonl"), "a")  # noqa: SIM115

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.start = state.global_step  # 0, or the step resumed from

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.log is not None:
            row = {"rank": self.rank, "attempt": self.attempt, "step": state.global_step,
                   "resumed_from": self.start, "pid": os.getpid(), "t": time.time()}  # fmt: skip
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()
        if self.attempt == 0 and self.kill == (self.rank, state.global_step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.sleep:
            time.sleep(self.sleep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill", default=None, metavar="RANK:STEP")
    parser.add_argument("--log-to", default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--replicated", action="store_true",
                        help="resume_from(trainer, replicated=True): DDP's state is every "
                             "rank's, so it is restored after the world's size changed too")  # fmt: skip
    args = parser.parse_args()
    kill = tuple(int(v) for v in args.kill.split(":")) if args.kill else None

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    out = tempfile.mkdtemp(prefix="relaunch-hf-example-")  # the Trainer saves nothing there
    atexit.register(shutil.rmtree, out, True)
    training = TrainingArguments(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1000, save_strategy="no", report_to=[],
        use_cpu=True, ddp_backend="gloo", seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(256, 16, config.vocab_size),
        callbacks=[Faults(kill, args.log_to, args.sleep), hf.SnapshotCallback()],
    )
    trainer.train(resume_from_checkpoint=hf.resume_from(trainer, replicated=args.replicated))
    digest = hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in trainer.model.parameters())
    ).hexdigest()
    if args.log_to:
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(args.log_to, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"rank": rank, "final": digest}) + "\n")
    print(f"rank {os.environ.get('RANK', '0')}: done, weights {digest[:16]}", flush=True)


if __name__ == "__main__":
    main()
