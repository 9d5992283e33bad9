"""Tiered recovery under the relaunch agent: in-process restart first, and a worker that
died is not a reason to restart its healthy in-process peers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inprocess_ddp.py"


def run_example(
    tmp_path: Path, max_restarts: int
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """The example under relaunch, 3 workers: its result and the agent's events."""
    logs = tmp_path / "logs"
    r = subprocess.run(
        [sys.executable, "-m", "relaunch", "--standalone", "--nproc-per-node=3",
         f"--max-restarts={max_restarts}", f"--log-dir={logs}", str(EXAMPLE)],
        capture_output=True, text=True, timeout=220, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    events = [json.loads(x) for x in next(logs.glob("*/events.jsonl")).read_text().splitlines()]
    return r, events


@pytest.mark.timeout(240)
def test_inprocess_job_survives_exception_hang_and_sigkill_under_relaunch(tmp_path: Path) -> None:
    r, events = run_example(tmp_path, max_restarts=0)
    names = [e["name"] for e in events]
    # one attempt only: the survivors were never restarted as processes
    assert names.count("workers_started") == 1, names
    lost = [e["metadata"] for e in events if e["name"] == "worker_lost"]
    assert [(x["local_rank"], x["exitcode"]) for x in lost] == [(1, -9)]
    assert "workers_succeeded" in names
    assert r.stderr.count("finished: loss") == 2


@pytest.mark.timeout(240)
def test_the_sigkilled_rank_is_replaced_with_a_restart_budget(tmp_path: Path) -> None:
    r, events = run_example(tmp_path, max_restarts=1)
    names = [e["name"] for e in events]
    assert names.count("workers_started") == 1, names  # no process restart of the group
    respawned = [e["metadata"] for e in events if e["name"] == "worker_respawned"]
    assert [(m["local_rank"], m["incarnation"]) for m in respawned] == [(1, 1)]
    # all three finish, the replacement from the survivors' step, not from step 0
    assert r.stderr.count("finished: loss") == 3, r.stderr[-4000:]
    assert "rank 1 of 3 resumes at step 0" not in r.stderr.split("injecting sigkill")[-1]
    # The agent says which tier handled the death.
    assert "relaunch: rank 1 (local rank 1) died: killed by SIGKILL" in r.stderr
    assert "replaced in place" in r.stderr and "(tier: process)" in r.stderr
    assert "recoveries: 1 process" in r.stderr
