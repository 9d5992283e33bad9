"""``relaunch.checkpoint.dcp`` with the real ``torch.distributed.checkpoint`` (DDP and
FSDP2 on gloo, two workers, ``get_state_dict``/``set_state_dict``): a SIGKILLed worker
costs the step in flight, and the job ends with the weights of a fault-free run, bit for
bit (DCP saves a replicated tensor on one rank only; the snapshot keeps every rank's;
with FSDP2 each rank restores its own shards, DTensors, one of them empty)."""

from __future__ import annotations

from pathlib import Path

import pytest

from multinode_support.examples import finals, resumed, run_example

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_killed_worker_resumes_at_its_step_with_the_fault_free_weights(
    parallel: str, tmp_path: Path
) -> None:
    # rank 1 dies after step 12's update, before its save: every rank resumes from 11
    flags = ["--fsdp"] if parallel == "fsdp" else []
    code, said, rows = run_example("dcp_train.py", tmp_path / "faulted", "--kill", "1:12", *flags)
    assert code == 0, said
    assert resumed(rows) == {12}, said
    assert "restored step 11 from memory" in said, said
    code, ref_said, ref_rows = run_example("dcp_train.py", tmp_path / "reference", *flags)
    assert code == 0, ref_said
    assert len(finals(rows)) == 1 and finals(rows) == finals(ref_rows), said
