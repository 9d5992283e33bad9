"""Each attempt gets a fresh store on a fresh port: no attempt sees another's keys
(the failure mode of pytorch issue 135712)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

WORKER = textwrap.dedent(
    """
    import datetime, json, os, sys
    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    port = int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], port, is_master=False,
        timeout=datetime.timedelta(seconds=30),
    )
    saw_key = store.check(["set_in_attempt_0"])
    if attempt == 0:
        store.set("set_in_attempt_0", "1")
        saw_key = store.check(["set_in_attempt_0"])  # the store works: the key is there
    with open(os.path.join(sys.argv[1], f"attempt{attempt}.json"), "w") as f:
        json.dump({"port": port, "saw_key": saw_key}, f)
    sys.exit(1 if attempt == 0 else 0)
    """
)


@pytest.mark.timeout(120)
def test_each_attempt_gets_a_fresh_store_on_a_fresh_port(tmp_path: Path) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    argv = ["--standalone", "--nproc-per-node=1", "--max-restarts=1"]
    result = subprocess.run(
        [sys.executable, "-m", "relaunch", *argv, str(tmp_path / "worker.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    first, second = (json.loads((tmp_path / f"attempt{n}.json").read_text()) for n in (0, 1))
    assert first["saw_key"] is True
    assert first["port"] != second["port"]
    assert second["saw_key"] is False
