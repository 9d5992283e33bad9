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
    # the exception, the hang and the death were each recovered in place (the
    # survivors' wrapper restarted: iterations 1, 2 and 3), which the summary says
    assert "faults: 1 lost; recoveries: none; in-process restarts: 3;" in r.stderr, r.stderr


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


TREE = """
import datetime, logging, os, sys, time
import torch, torch.distributed as dist
from relaunch import inprocess

logging.basicConfig(level=logging.WARNING)
S = datetime.timedelta(seconds=1)
initial = int(os.environ["RANK"])
ra = inprocess.rank_assignment
tree = ra.Tree([
    ra.Layer(min_ranks=1, key_or_fn="root", flag=ra.LayerFlag.RESERVE),
    ra.Layer(min_ranks=1, max_ranks=2, key_or_fn=lambda s: "host", flag=ra.LayerFlag.RESERVE),
])

@inprocess.Wrapper(rank_assignment=tree, soft_timeout=10 * S, hard_timeout=20 * S,
                   barrier_timeout=60 * S, heartbeat_timeout=30 * S, completion_timeout=60 * S)
def train(call_wrapper=None):
    it = call_wrapper.iteration
    dist.init_process_group("gloo")
    print(f"iteration {it} initial {initial} world {dist.get_world_size()}", flush=True)
    for step in range(20):
        if it == 0 and initial == 1 and step == 5:
            os.kill(os.getpid(), 9)
        t = torch.ones(1)
        dist.all_reduce(t)
        call_wrapper.ping()
        time.sleep(0.05)
    dist.destroy_process_group()
    return "trained"

print(f"rank {initial} result {train()}", flush=True)
"""


@pytest.mark.timeout(240)
def test_a_replacement_under_a_tree_assignment_ends_without_restarting_the_others(
    tmp_path: Path,
) -> None:
    """NVIDIA's Tree takes a lost rank's place with a reserve of its host, and no new
    process in: the agent's replacement of the SIGKILLed rank asked to join all the
    same, and each of its requests restarted the others' iteration, for a minute (its
    barrier timeout). It ends at once now, and the reserve trains in the rank's place."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    r = subprocess.run(
        [sys.executable, "-m", "relaunch", "--standalone", "--nproc-per-node=3",
         "--max-restarts=1", f"--log-dir={tmp_path / 'logs'}", str(script)],
        capture_output=True, text=True, timeout=220, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    said = r.stdout + r.stderr
    assert r.returncode == 0, said[-4000:]
    iterations = [int(line.split()[1]) for line in r.stdout.splitlines()
                  if line.startswith("iteration ")]  # fmt: skip
    assert max(iterations) == 1, said[-4000:]  # one restart, for the SIGKILL
    assert "rank 0 result trained" in r.stdout and "rank 2 result trained" in r.stdout, said
    assert "a replacement is not admitted" in said, said[-4000:]
