"""A hostile neighbour writes over the rendezvous state of a running job (2 real agents,
c10d, a raw torch TCPStore client): the agents log it once, not per poll; restored in
time, training goes on; left corrupt, the agents stop their workers and end with one
line naming the key. Impossible-but-valid JSON (ghost nodes with heartbeats far in
the future) is refused the same way, not obeyed."""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from multinode_support.cluster import Cluster, free_port

pytestmark = pytest.mark.timeout(150)

KEY = "relaunch/rdzv/job/state"


def start(tmp: Path) -> tuple[Cluster, Path, dist.TCPStore]:
    port = free_port()
    cluster = Cluster(tmp, backend="c10d", endpoint=f"127.0.0.1:{port}")
    go = tmp / "go"
    for node in ("a", "b"):
        cluster.start(node, f"go={go}", "steps=2", nproc=1)
    cluster.wait_for("both nodes training", lambda: len({r.node for r in cluster.steps()}) == 2)
    hostile = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    return cluster, go, hostile


def test_a_state_overwritten_and_restored_in_time_is_logged_once(tmp_path: Path) -> None:
    cluster, go, hostile = start(tmp_path)
    try:
        good = hostile.get(KEY)
        hostile.set(KEY, b"\x80\x04garbage that is not a state")
        time.sleep(0.6)  # several polls of both agents
        hostile.set(KEY, good)
        go.touch()
        assert cluster.wait_exit("a") == 0, cluster.outputs()
        assert cluster.wait_exit("b") == 0, cluster.outputs()
        for node in ("a", "b"):
            out = cluster.output(node)
            assert out.count("is corrupt or not ours") <= 2, out  # the reader and keep-alive
            assert "valid again" in out or "is corrupt" not in out
    finally:
        del hostile
        cluster.close()


@pytest.mark.parametrize("kind", ["garbage", "ghosts"])
def test_a_state_left_corrupt_ends_the_job_with_one_line(tmp_path: Path, kind: str) -> None:
    cluster, _, hostile = start(tmp_path)
    try:
        if kind == "garbage":
            bad = b"not json at all"
        else:  # valid JSON, impossible values
            doc = json.loads(hostile.get(KEY))
            doc["round"] = -5
            doc["last_heartbeats_ms"]["ghost_1_0"] = 10**18
            bad = json.dumps(doc).encode()
        hostile.set(KEY, bad)
        codes = {node: cluster.wait_exit(node, timeout=60) for node in ("a", "b")}
        assert codes == {"a": 1, "b": 1}, cluster.outputs()
        for node in ("a", "b"):
            out = cluster.output(node)
            assert f"'{KEY}'" in out, out
            assert "relaunch/agent" not in out and "relaunch/rendezvous" not in out, out
            assert out.count("this node goes on with the last valid state") <= 2, out
        # the workers were stopped: nothing trains any more
        last = max(r.step for r in cluster.steps())
        time.sleep(0.5)
        assert max(r.step for r in cluster.steps()) == last
    finally:
        del hostile
        cluster.close()


def test_a_44_mb_state_is_refused_and_the_job_stops_promptly(tmp_path: Path) -> None:
    cluster, _, hostile = start(tmp_path)
    try:
        with pytest.raises(Exception):  # noqa: B017 (the server drops that client)
            hostile.set(KEY, b"[" + b"0," * (22 * 1024 * 1024) + b"0]")
            hostile.get(KEY)
        steps = len(cluster.steps())
        cluster.wait_for("training to go on", lambda: len(cluster.steps()) > steps + 4)
        t0 = time.monotonic()
        for node in ("a", "b"):
            os.killpg(cluster.procs[node].pid, signal.SIGTERM)
        codes = {node: cluster.wait_exit(node, timeout=60) for node in ("a", "b")}
        assert codes == {"a": 128 + signal.SIGTERM, "b": 128 + signal.SIGTERM}, cluster.outputs()
        assert time.monotonic() - t0 < 30  # not the 99-115 s of a stuck store
    finally:
        del hostile
        cluster.close()
