"""``relaunch.checkpoint.hf`` with the real Hugging Face Trainer (a tiny Llama, two gloo
workers): a SIGKILLed worker costs the step in flight, and the job ends with the
weights of a fault-free run, bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from multinode_support.examples import finals, resumed, run_example

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(300)


def test_a_killed_worker_resumes_at_its_step_with_the_fault_free_weights(tmp_path: Path) -> None:
    code, said, rows = run_example("hf_trainer.py", tmp_path / "faulted", "--kill", "1:12")
    assert code == 0, said
    # rank 1 died at the end of step 12, before its snapshot: every rank resumed from
    # step 11, the newest both held; step 12 is the one step done again (counted when
    # rank 0's snapshot of it was whole before the group's stop reached rank 0: the
    # snapshot writer runs beside the next step, so either may come first)
    assert resumed(rows) == {11}, said
    assert re.search(
        r"restored step 11 from memory, (1 step|0 steps) redone \(ranks 0, 1\)", said
    ), said
    code, ref_said, ref_rows = run_example("hf_trainer.py", tmp_path / "reference")
    assert code == 0, ref_said
    assert len(finals(rows)) == 1 and finals(rows) == finals(ref_rows), said
