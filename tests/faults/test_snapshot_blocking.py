"""``save(step, state, blocking=True)`` returns once the snapshot is complete in node
memory: a worker SIGKILLed the moment it returns resumes at that step, on every rank
(the other rank's snapshot of the step is whole before, and the agent stops it).
(It used to wait for the tensors' copy only; the checksum, the manifest and the
folder's rename then died with the worker, and the restart began afresh.)"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from multinode_support.examples import run_script

pytestmark = pytest.mark.timeout(180)

SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    import torch, torch.distributed as dist
    from relaunch import checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got = checkpoint.load()
    if got is None:
        checkpoint.save(3, {"w": torch.full((1 << 20,), 3.0), "step": 3})
        state = {"w": torch.full((1 << 20,), 7.0), "step": 4}
        if rank == 1:  # whole before rank 0 saves it: the agent stops this rank later
            checkpoint.save(4, state, blocking=True)
        dist.barrier()
        if rank == 0:
            checkpoint.save(4, state, blocking=True)
            os.kill(os.getpid(), signal.SIGKILL)  # the moment the save returned
        time.sleep(120)
    step, state = got
    assert step == 4 and state["step"] == 4 and bool((state["w"] == 7.0).all()), got
    print(f"rank {dist.get_rank()} resumed at step {step}", flush=True)
    dist.destroy_process_group()
    """
)


def test_a_worker_killed_as_its_blocking_save_returns_resumes_at_that_step(
    tmp_path: Path,
) -> None:
    code, said = run_script(tmp_path, SCRIPT)
    assert code == 0, said
    for rank in (0, 1):
        assert f"rank {rank} resumed at step 4" in said, said
