"""``inprocess.broadcast_state`` makes survivors that diverged by a step agree again.

A fault can end an iteration after the last collective of a step completed on some
ranks and failed on others: those made one more step. Two gloo ranks under the
Wrapper (an agent-style TCPStore hosted by the test): in iteration 0, rank ``LAG``
takes part in the all-reduce of step ``AT`` and then raises before counting it, so
the other rank is one step ahead (at the end of the job: it has returned). Without
reconciliation the job restarts forever; with it, both ranks end at the same step
with the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

WORKER = textwrap.dedent(
    r"""
    import datetime, json, os, sys
    import torch, torch.distributed as dist
    from relaunch import inprocess

    STEPS, LAG, AT = int(os.environ["STEPS"]), int(os.environ["LAG"]), int(os.environ["AT"])
    MODE = os.environ["MODE"]  # "version" or "digest"
    held = {"w": torch.zeros(3), "step": 0}

    def emit(**doc):
        print(json.dumps(doc), flush=True)

    @inprocess.Wrapper(
        soft_timeout=datetime.timedelta(seconds=5),
        hard_timeout=datetime.timedelta(seconds=10),
        heartbeat_timeout=datetime.timedelta(seconds=5),
        barrier_timeout=datetime.timedelta(seconds=30),
        completion_timeout=datetime.timedelta(seconds=30),
        termination_grace_time=datetime.timedelta(seconds=1),
    )
    def train(call_wrapper=None):
        dist.init_process_group("gloo")
        rank, it = dist.get_rank(), call_wrapper.iteration
        mine = {"w": held["w"].clone(), "step": held["step"]}
        version = held["step"] if MODE == "version" else None
        got = inprocess.broadcast_state(call_wrapper, mine, version=version)
        emit(event="state", iteration=it, rank=rank, step=got["step"], own=got is mine)
        held["w"], held["step"] = got["w"], got["step"]
        if it > 3:
            raise SystemExit("no agreement after 3 restarts")
        while held["step"] < STEPS:
            g = torch.full((3,), float(rank + 1))
            dist.all_reduce(g)
            if it == 0 and rank == LAG and held["step"] == AT:
                raise RuntimeError("injected: failed after the collective")
            held["w"] += g
            held["step"] += 1
        dist.destroy_process_group()
        emit(event="done", rank=rank, step=held["step"], w=held["w"].tolist())

    train()
    """
)


def _run(tmp_path: Path, *, lag: int, at: int, mode: str) -> list[list[dict[str, Any]]]:
    import torch.distributed as dist

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    try:
        for r in range(2):
            env = dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(server.port),
                TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RUN_ID=f"bcast-{tmp_path.name}",
                STEPS="6",
                LAG=str(lag),
                AT=str(at),
                MODE=mode,
                OMP_NUM_THREADS="1",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, f"rc={proc.returncode}\n{out}\n{err[-3000:]}"
            outs.append([json.loads(x) for x in out.splitlines() if x.startswith("{")])
        return outs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        del server


def _check(outs: list[list[dict[str, Any]]]) -> None:
    done = [next(e for e in events if e["event"] == "done") for events in outs]
    assert [d["step"] for d in done] == [6, 6], outs
    assert done[0]["w"] == done[1]["w"] == [18.0] * 3, outs  # 6 steps of 1 + 2


def _states_in_iteration_1(outs: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    return [[e for e in ev if e["event"] == "state" and e["iteration"] == 1] for ev in outs]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["version", "digest"])
def test_a_rank_a_step_behind_at_the_end_takes_the_finished_rank_s_state(
    tmp_path: Path, mode: str
) -> None:
    # rank 1 fails after the collective of the last step: rank 0 has returned
    outs = _run(tmp_path, lag=1, at=5, mode=mode)
    _check(outs)
    after = _states_in_iteration_1(outs)
    assert after[0][0]["own"] and after[0][0]["step"] == 6, outs  # the source keeps its own
    assert not after[1][0]["own"] and after[1][0]["step"] == 6, outs  # rank 1 takes step 6


@pytest.mark.timeout(120)
def test_the_rank_ahead_is_the_source_by_version(tmp_path: Path) -> None:
    # rank 0 lags: by version, rank 1 (one step ahead) is the source, and no step is lost
    outs = _run(tmp_path, lag=0, at=2, mode="version")
    _check(outs)
    after = _states_in_iteration_1(outs)
    assert [a[0]["step"] for a in after] == [3, 3], outs
    assert [a[0]["own"] for a in after] == [False, True], outs


@pytest.mark.timeout(120)
def test_without_versions_the_lowest_survivor_is_the_source(tmp_path: Path) -> None:
    # rank 0 lags, no versions: rank 1 goes back to rank 0's state (one step redone)
    outs = _run(tmp_path, lag=0, at=2, mode="digest")
    _check(outs)
    after = _states_in_iteration_1(outs)
    assert [a[0]["step"] for a in after] == [2, 2], outs
    assert [a[0]["own"] for a in after] == [True, False], outs


def test_a_version_that_is_not_an_int_is_refused() -> None:
    from relaunch import inprocess

    with pytest.raises(TypeError, match="version must be an int"):
        inprocess.broadcast_state(None, {}, version="3")  # type: ignore[arg-type]
