"""``relaunch.checkpoint.lightning`` with the real PyTorch Lightning (DDP on gloo, two
workers): a SIGKILLed worker costs the step in flight; resumed after a step that ends
an epoch, the job ends with the weights of a fault-free run, bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from multinode_support.examples import finals, resumed, run_example

pytest.importorskip("pytorch_lightning")

pytestmark = pytest.mark.timeout(300)

EXAMPLE = "lightning_train.py"


def test_a_killed_worker_resumes_at_its_step(tmp_path: Path) -> None:
    # four batches an epoch: rank 1 dies after step 9, before its snapshot; every rank
    # resumes from step 8 (the end of an epoch), step 9 is the one step done again
    code, said, rows = run_example(EXAMPLE, tmp_path / "faulted", "--kill", "1:9")
    assert code == 0, said
    assert resumed(rows) == {8}, said
    # (one step redone when rank 0's snapshot of step 9 was whole before the group's
    # stop reached it: its writer runs beside the next step, so either may come first)
    assert re.search(
        r"restored step 8 from memory, (1 step|0 steps) redone \(ranks 0, 1\)", said
    ), said
    code, ref_said, ref_rows = run_example(EXAMPLE, tmp_path / "reference")
    assert code == 0, ref_said
    assert len(finals(rows)) == 1 and finals(rows) == finals(ref_rows), said
    # in the middle of an epoch: still one step redone (Lightning replays the epoch's
    # batches from its first with a plain DataLoader, so no bitwise check here)
    code, said, rows = run_example(EXAMPLE, tmp_path / "mid-epoch", "--kill", "1:10")
    assert code == 0, said
    assert resumed(rows) == {9}, said
