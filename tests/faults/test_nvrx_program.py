"""A program written for NVIDIA's in-process wrapper the way its documentation writes
one, under ``relaunch --nproc-per-node 3`` (torchrun's plain single-node command): it
hosts its own multi-tenant TCPStore at MASTER_PORT + 1 in the wrapped function, gives
the wrapper MASTER_PORT + 2, builds DDP on gloo in every iteration, and faults in five
iterations in a row. A failed DDP backward can keep the iteration's group, and so that
store with the old group's keys, alive in C++; each iteration's groups have names of
their own, so the next iteration never reads those keys (before: gloo connected to the
previous iteration's addresses and the ranks waited until their timeouts)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROGRAM = textwrap.dedent(
    """
    import datetime, logging, os
    import torch
    from relaunch import inprocess

    @inprocess.Wrapper(
        store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 2},
        initialize=inprocess.initialize.RetryController(max_iterations=8),
        soft_timeout=datetime.timedelta(seconds=20), hard_timeout=datetime.timedelta(seconds=40),
    )
    def main(call_wrapper: inprocess.CallWrapper = None):
        iteration = call_wrapper.iteration
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = torch.distributed.TCPStore(
            host_name=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]) + 1,
            world_size=world, is_master=rank == 0, multi_tenant=True, wait_for_workers=True,
            use_libuv=True,
        )
        torch.distributed.init_process_group(
            "gloo", store=store, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=10),
        )
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
        for step in range(30):
            if iteration < 5 and step == 10 and rank == 1 + iteration % 2:
                raise RuntimeError(f"fault in iteration {iteration} on rank {rank}")
            model.zero_grad()
            model(torch.rand(8, 16)).square().mean().backward()
            call_wrapper.ping()
        print(f"rank {rank} finished in iteration {iteration}", flush=True)

    logging.basicConfig(level=logging.WARNING)
    main()
    """
)


@pytest.mark.timeout(200)
def test_an_nvidia_style_program_with_its_own_store_recovers_from_every_fault(
    tmp_path: Path,
) -> None:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "3", str(script)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    for rank in range(3):
        assert f"rank {rank} finished in iteration 5" in done.stdout, output[-6000:]
    assert "connectFullMesh" not in output and "Timed out waiting" not in output
    assert "soft timeout" not in output and "hard timeout" not in output
