"""A third agent with the job's --rdzv-id but another program is refused: one line on
its side, one on the job's, and the job goes on at its size (2 real agents, c10d)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from multinode_support.cluster import Cluster, free_port

pytestmark = pytest.mark.timeout(150)


def test_a_node_running_another_program_is_refused(tmp_path: Path) -> None:
    port = free_port()
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"127.0.0.1:{port}")
    go = tmp_path / "go"
    other = tmp_path / "other.py"
    other.write_text("print('a stranger')\n")
    try:
        for node in ("a", "b"):
            cluster.start(node, f"go={go}", "steps=2", nnodes="2:3", nproc=1)
        cluster.wait_for("both nodes training", lambda: len({r.node for r in cluster.steps()}) == 2)
        stranger = subprocess.run(
            [sys.executable, "-m", "relaunch", "--nnodes=2:3", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=job", "--local-addr=127.0.0.1",
             str(other)],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )  # fmt: skip
        assert stranger.returncode == 1, stranger.stderr
        errors = [x for x in stranger.stderr.splitlines() if x.startswith("relaunch: error:")]
        assert len(errors) == 1 and "refused" in errors[0] and "other.py" in errors[0]
        cluster.wait_for(
            "the refusal in the job's log",
            lambda: all("refused node" in cluster.output(n) for n in ("a", "b")),
            timeout=30,
        )
        # Training goes on after both agents read the refusal (each node trains more steps
        # than it had then), so any reaction to the stranger had its chance to show.
        seen = {n: len(cluster.steps(n)) for n in ("a", "b")}
        cluster.wait_for(
            "training to go on after the refusal",
            lambda: all(len(cluster.steps(n)) >= seen[n] + 10 for n in ("a", "b")),
        )
        go.touch()
        assert cluster.wait_exit("a") == 0, cluster.outputs()
        assert cluster.wait_exit("b") == 0, cluster.outputs()
        assert {r.world for r in cluster.steps()} == {2}  # never restarted with the stranger
        assert {r.restart for r in cluster.steps()} == {0}
        for node in ("a", "b"):  # one round, no membership restart either
            names = [e["name"] for e in cluster.events(node)]
            assert names.count("rendezvous_complete") == 1, names
            assert "membership_changed" not in names, names
    finally:
        cluster.close()
