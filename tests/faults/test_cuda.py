"""The CUDA paths, run where a GPU is (skipped elsewhere): snapshots of CUDA tensors
(copied straight into the page-locked files on /dev/shm, through the pinned buffer on
disk; the copy stream, the optimizer's stream fenced behind the copy), workers
that use CUDA forked from the fork server after a SIGKILL, and NCCL aborted and set up
again by in-process restarts.

One GPU is enough: the snapshot job runs two ranks on gloo (CUDA tensors) on the same
device; NCCL runs one rank (it refuses two ranks on one device).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PY = sys.executable
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "snapshots.py"


def _cpu_copy(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _cpu_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cpu_copy(v) for v in state)
    return state


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_bitwise(got: Any, want: Any, path: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert (got.dtype, got.shape, got.device.type) == (want.dtype, want.shape, "cpu"), path
        assert torch.equal(_bytes(got), _bytes(want)), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            _assert_bitwise(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_bitwise(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


@pytest.mark.parametrize("where", ["dev-shm", "tmp-path"])
def test_a_cuda_state_is_snapshotted_bitwise_while_the_optimizer_goes_on(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The optimizer steps right after ``save`` returns, on the same tensors, while the
    copy of 1.6 GB to the host is still under way: its pre-step hook orders its writes
    after the copy, so the snapshot holds the values as of the save. On /dev/shm the
    copies land in the data file itself (its mapping page-locked), also in a retired
    snapshot's file reused; elsewhere they may go through the pinned buffer."""
    import tempfile

    from relaunch.checkpoint._saver import Saver, Where

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(8))).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(512, 4096, device="cuda")

    def step() -> None:
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    extra = {
        "transposed": torch.arange(12.0, device="cuda").reshape(3, 4).t(),
        "bf16": torch.randn(5, device="cuda", dtype=torch.bfloat16),
        "cpu": torch.arange(3),
        "plain": [7, "seven", None],
    }
    root = tempfile.mkdtemp(dir="/dev/shm") if where == "dev-shm" else str(tmp_path)
    saver = Saver(Where(root, "job", 0, 1, 2, None, None, threads=4))
    try:
        for n in range(1, 5):  # the third and fourth reuse the retired snapshots' files
            state = {"model": model.state_dict(), "opt": optimizer.state_dict(), "extra": extra}
            want = _cpu_copy(state)
            saver.save(n, state)
            step()
            step()
            saver.wait()
            _assert_bitwise(saver.read(n), want)
        saver.save(5, {"model": model.state_dict()}, blocking=True)
        want = _cpu_copy(model.state_dict())
        saver.wait()
        _assert_bitwise(saver.read(5), {"model": want})
    finally:
        saver.close()
        if where == "dev-shm":
            shutil.rmtree(root, ignore_errors=True)
    if where == "dev-shm":
        assert "cannot be page-locked" not in caplog.text


def test_cuda_buffers_the_next_forward_updates_are_snapshotted_as_of_the_save(
    tmp_path: Path,
) -> None:
    """BatchNorm's running statistics, updated by the next forward on the current
    stream while the copy stream still copies 1 GB of weights before them: cloned in
    ``save`` on the current stream, so the snapshot holds them as of the save. An
    average of the weights kept by hand (no optimizer fences it, and it is too large
    to clone) makes the save order the current stream after the copies instead."""
    from relaunch.checkpoint._saver import Saver, Where

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(16)), nn.BatchNorm1d(4096))
    model = model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 4096, device="cuda")
    model(x).pow(2).mean().backward()
    optimizer.step()
    average = [p.detach().clone() for p in model.parameters()]
    saver = Saver(Where(str(tmp_path), "job", 0, 1, 2, None, None, threads=4))
    try:
        for n in range(1, 4):
            state = {"model": model.state_dict(), "opt": optimizer.state_dict()}
            want = _cpu_copy(state)
            saver.save(n, state)
            for _ in range(4):
                model[-1](x * (n + 5))  # the next forwards, at once
            saver.wait()
            _assert_bitwise(saver.read(n), want)
        want = _cpu_copy({"average": average})
        saver.save(4, {"average": average})
        for a in average:
            a.add_(1.0)
        saver.wait()
        _assert_bitwise(saver.read(4), want)
    finally:
        saver.close()


def _run(tmp: Path, name: str, *script: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A 2-rank relaunch job of the snapshots example on the GPU: its rows and events."""
    out, logs = tmp / f"out-{name}", tmp / f"logs-{name}"
    out.mkdir()
    done = subprocess.run(
        [PY, "-m", "relaunch", "--standalone", "--nproc-per-node=2", "--max-restarts=2",
         "--monitor-interval=0.1", "--log-dir", str(logs), str(EXAMPLE), "--device", "cuda",
         "--params", "20", "--steps", "60", "--sleep", "0.1", "--log-to", str(out), *script],
        capture_output=True, text=True, timeout=240, cwd=tmp,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-5000:]
    rows = [
        json.loads(line) for p in out.glob("rank*.jsonl") for line in p.read_text().splitlines()
    ]
    events = [json.loads(line) for p in logs.glob("*/events.jsonl") for line in p.read_text().splitlines()]  # fmt: skip
    return rows, events


def test_a_killed_cuda_worker_is_forked_again_and_resumes_at_its_step(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed at step 45 (the fork server is up by then): both workers of
    the next attempt are forked from it and use CUDA, resume from their snapshots at
    step 45 or 46, and end with the fault-free run's weights, bit for bit."""
    clean, _ = _run(tmp_path, "clean")
    rows, events = _run(tmp_path, "killed", "--kill", "1:45")
    finals = {r["final"] for r in rows if "final" in r and r["attempt"] > 0}
    assert finals == {r["final"] for r in clean if "final" in r}, (finals, clean)
    resumed = {r["resumed_from"] for r in rows if r.get("attempt", 0) > 0 and "step" in r}
    assert resumed and all(45 <= s <= 46 for s in resumed), resumed
    started = [e["metadata"] for e in events if e["name"] == "workers_started"]
    assert [s["forked"] for s in started] == [[], [0, 1]], started


NCCL_SCRIPT = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from relaunch import inprocess

torch.cuda.set_device(0)

@inprocess.Wrapper(
    soft_timeout=datetime.timedelta(seconds=3),
    hard_timeout=datetime.timedelta(seconds=20),
    barrier_timeout=datetime.timedelta(seconds=60),
    health_check=inprocess.CudaHealthCheck(),
)
def train(call_wrapper=None):
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(f"iteration {call_wrapper.iteration}: all_reduce {t[0].item()}", flush=True)
    if call_wrapper.iteration == 0:
        raise RuntimeError("injected")
    if call_wrapper.iteration == 1:
        time.sleep(3600)  # woken at the soft timeout
    dist.destroy_process_group()
    return call_wrapper.iteration

print("returned", train(), flush=True)
"""


def test_nccl_is_aborted_and_set_up_again_in_process(tmp_path: Path) -> None:
    """An exception, then a hang: each time the NCCL communicator is aborted and the
    function called again in the same process, which sets NCCL up anew."""
    script = tmp_path / "nccl_train.py"
    script.write_text(textwrap.dedent(NCCL_SCRIPT))
    done = subprocess.run(
        [PY, "-m", "relaunch", "--standalone", "--nproc-per-node=1", str(script)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    for n in (0, 1, 2):
        assert f"iteration {n}: all_reduce 1.0" in done.stdout, done.stdout
    assert "returned 2" in done.stdout, done.stdout
