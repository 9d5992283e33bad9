"""A per-job secret (``--rdzv-conf secret_file=PATH``): 2 real agents on c10d (its TCP
store: ``store_members=0``; the hostile client speaks torch's wire protocol) sign every
record; a node without the secret, or with another, cannot join (one line); an unsigned
write over the state by a raw torch client is refused, logged once, and once the valid
record is back the agents say so and the job goes on."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from multinode_support.cluster import Cluster, free_port

pytestmark = pytest.mark.timeout(150)

KEY = "relaunch/rdzv/job/state"
REFUSED = "not signed with this job's secret"
VALID = "the state is valid again"


def secret(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def outsider(tmp: Path, port: int, conf: str) -> str:
    (tmp / "never.py").write_text("raise SystemExit('must never run')\n")
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "--nnodes=2:3", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=job", "--local-addr=127.0.0.1",
         f"--rdzv-conf={','.join(c for c in (conf, 'store_members=0') if c)}",
         str(tmp / "worker.py"), str(tmp / "steps"), "train"],
        capture_output=True, text=True, timeout=60, cwd=tmp,
        env={**os.environ, "TMPDIR": str(tmp), "MN_NODE": "x"},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    errors = [x for x in done.stderr.splitlines() if x.startswith("relaunch: error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def test_records_are_signed_and_outsiders_refused(tmp_path: Path) -> None:
    good = secret(tmp_path / "secret", "a job secret of enough bytes\n")
    bad = secret(tmp_path / "other", "another secret, also long enough\n")
    port = free_port()
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"127.0.0.1:{port}")
    go = tmp_path / "go"
    nodes = ("a", "b")
    # keep_alive_max_attempt=20: the agents go on with their last valid state for 10 s
    # (not 2 s) while the state is refused: on a loaded machine they may take a while to
    # notice, and the valid record is put back only once both did.
    conf = f"secret_file={good},keep_alive_max_attempt=20,store_members=0"
    try:
        for node in nodes:
            cluster.start(node, f"go={go}", "steps=2", nnodes="2:3", nproc=1, conf=conf)
        cluster.wait_for("both nodes training", lambda: len({r.node for r in cluster.steps()}) == 2)
        hostile = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        signed = hostile.get(KEY)
        assert b"relaunch-mac1:" in signed  # the state is signed
        assert "secret" in outsider(tmp_path, port, "")  # no secret: it says so
        assert "does not verify" in outsider(tmp_path, port, f"secret_file={bad}")
        shown = subprocess.run(
            [sys.executable, "-m", "relaunch", "status", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=job", f"--rdzv-conf=secret_file={good}", "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["world"]["nodes"] == 2
        unsigned = signed[: signed.index(b"\x00relaunch-mac1:")]
        hostile.set(KEY, unsigned)  # valid JSON, not signed
        cluster.wait_for(
            "both agents to refuse the unsigned state",
            lambda: all(REFUSED in cluster.output(n) for n in nodes),
        )
        hostile.set(KEY, signed)
        cluster.wait_for(
            "both agents to read the signed state again",
            lambda: all(VALID in cluster.output(n) for n in nodes),
        )
        go.touch()
        assert cluster.wait_exit("a") == 0, cluster.outputs()
        assert cluster.wait_exit("b") == 0, cluster.outputs()
        for node in nodes:
            out = cluster.output(node)
            assert out.count(REFUSED) == 1, out  # once, not once per poll
            assert out.count(VALID) == 1 and out.index(REFUSED) < out.index(VALID), out
        assert {(r.restart, r.world) for r in cluster.steps()} == {(0, 2)}  # never restarted
        del hostile
    finally:
        cluster.close()


def test_a_short_secret_is_refused_before_anything_starts(tmp_path: Path) -> None:
    short = secret(tmp_path / "short", "tiny")
    (tmp_path / "never.py").write_text("raise SystemExit('must never run')\n")
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "--nnodes=1", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-conf=secret_file={short}",
         str(tmp_path / "never.py")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "secret_file" in done.stderr and "16 bytes" in done.stderr
