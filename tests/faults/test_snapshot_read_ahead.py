"""A restarted worker's snapshot is read back while its script starts: the runner
begins the read before the script runs, ``checkpoint.load()`` takes it (and says so
in its log line), and the state is the one saved."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from multinode_support.examples import run_script

pytestmark = pytest.mark.timeout(180)

SCRIPT = textwrap.dedent(
    """
    import logging, os, sys
    import torch, torch.distributed as dist
    from relaunch import checkpoint

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    dist.init_process_group("gloo")
    got = checkpoint.load()
    start = 0 if got is None else got[0] + 1
    for step in range(start, 3):
        checkpoint.save(step, {"x": torch.full((1000,), float(step)), "step": step})
    checkpoint.wait()
    dist.barrier()  # the other rank's step 2 is complete too before this one fails
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        sys.exit(3)  # after three snapshots: the restart reads them back
    assert got is not None and got[0] == 2, got
    print(f"rank {dist.get_rank()} resumed with x={got[1]['x'][0].item()}", flush=True)
    dist.destroy_process_group()
    """
)


def test_a_restarted_worker_takes_the_snapshot_read_while_it_started(tmp_path: Path) -> None:
    code, said = run_script(tmp_path, SCRIPT)
    assert code == 0, said
    for rank in (0, 1):
        assert f"rank {rank}: restored step 2 from memory (read ahead" in said, said
        assert f"rank {rank} resumed with x=2.0" in said, said
