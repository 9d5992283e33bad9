"""``relaunch.checkpoint.dcp`` with the real ``torch.distributed.checkpoint`` (DDP on
gloo, two workers, ``get_state_dict``/``set_state_dict``): a SIGKILLed worker costs
the step in flight, and the job ends with the weights of a fault-free run, bit for bit
(DCP saves a replicated tensor on one rank only; the snapshot keeps every rank's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dcp_train.py"


def _run(tmp: Path, name: str, *args: str) -> tuple[int, str, list[dict[str, object]]]:
    out = tmp / name
    out.mkdir()
    cmd = [
        sys.executable, "-m", "relaunch", "--standalone", "--nproc-per-node=2",
        "--max-restarts=1", "--monitor-interval=0.1", str(EXAMPLE), "--log-to", str(out), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    rows = [
        json.loads(line) for p in out.glob("rank*.jsonl") for line in p.read_text().splitlines()
    ]
    return proc.returncode, proc.stdout + proc.stderr, rows


def test_a_killed_worker_resumes_at_its_step_with_the_fault_free_weights(tmp_path: Path) -> None:
    # rank 1 dies after step 12's update, before its save: every rank resumes from 11
    code, said, rows = _run(tmp_path, "faulted", "--kill", "1:12")
    assert code == 0, said
    resumed = {r["resumed_from"] for r in rows if r.get("attempt") == 1 and "step" in r}
    assert resumed == {12}, (resumed, said)
    assert "restored step 11 from memory" in said, said
    code, ref_said, ref_rows = _run(tmp_path, "reference")
    assert code == 0, ref_said
    finals = {r["final"] for r in rows if "final" in r}
    assert len(finals) == 1 and finals == {r["final"] for r in ref_rows if "final" in r}, said
