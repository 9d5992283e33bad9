"""A script whose last act is ``checkpoint.save()`` (no ``wait()``): the save completes
as the worker exits. The interpreter's shutdown stops the thread pools before the
atexit hook that waits for the save runs; the writer's copy and checksum, handed to
its pool, failed there, and the job's last step was lost with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = textwrap.dedent(
    """
    import torch
    from relaunch import checkpoint

    got = checkpoint.load()
    model = torch.nn.Linear(4000, 4000)  # 64 MB of weights, in flight as it exits
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4000)).sum().backward()
    opt.step()
    checkpoint.save(0 if got is None else got[0] + 1, model.state_dict())
    """
)


def test_the_last_save_of_a_script_that_ends_is_complete(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    snapshots = tmp_path / "snapshots"
    cmd = [
        sys.executable, "-m", "relaunch", "--standalone", "--nproc-per-node=1",
        f"--snapshot-dir={snapshots}", str(script),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "Exception ignored" not in said and "could not be written" not in said, said
    assert (snapshots / "rank-00000" / "step-000000000000" / "manifest.json").exists(), said
    assert "snapshots: newest step 0" in said, said
