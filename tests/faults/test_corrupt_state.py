"""A hostile neighbour writes over the rendezvous state of a running job (2 real agents,
c10d, a raw torch TCPStore client): the agents log it once, not per poll; restored in
time, they say it is valid again and training goes on; left corrupt, the agents stop
their workers and end with one line naming the key. Impossible-but-valid JSON (ghost
nodes with heartbeats far in the future) is refused the same way, not obeyed."""

from __future__ import annotations

import datetime
import json
import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist

from multinode_support.cluster import Cluster, free_port

pytestmark = pytest.mark.timeout(150)

KEY = "relaunch/rdzv/job/state"
NOTICED = "this node goes on with the last valid state"  # the line that says "corrupt"
VALID = "the state is valid again"


def start(tmp: Path, conf: str = "") -> tuple[Cluster, Path, dist.TCPStore]:
    port = free_port()
    cluster = Cluster(tmp, backend="c10d", endpoint=f"127.0.0.1:{port}")
    go = tmp / "go"
    for node in ("a", "b"):
        cluster.start(node, f"go={go}", "steps=2", nproc=1, conf=conf)
    cluster.wait_for("both nodes training", lambda: len({r.node for r in cluster.steps()}) == 2)
    hostile = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    return cluster, go, hostile


def test_a_state_overwritten_and_restored_in_time_is_logged_once(tmp_path: Path) -> None:
    # Each agent reads the state every keep-alive beat (0.5 s); it goes on with its last
    # valid state for 20 beats (10 s, not the default 2 s): a loaded machine's agents may
    # take a while to notice, and the state is restored only once both did.
    cluster, go, hostile = start(tmp_path, conf="keep_alive_max_attempt=20")
    nodes = ("a", "b")
    try:
        good = hostile.get(KEY)
        hostile.set(KEY, b"\x80\x04garbage that is not a state")
        cluster.wait_for(
            "both agents to notice the corruption",
            lambda: all(NOTICED in cluster.output(n) for n in nodes),
        )
        hostile.set(KEY, good)
        cluster.wait_for(
            "both agents to read a valid state again",
            lambda: all(VALID in cluster.output(n) for n in nodes),
        )
        go.touch()
        assert cluster.wait_exit("a") == 0, cluster.outputs()
        assert cluster.wait_exit("b") == 0, cluster.outputs()
        for node in nodes:
            out = cluster.output(node)
            # once, not once per poll or per reader (the agent's loop and its keep-alive)
            assert out.count(NOTICED) == 1 and out.count("is corrupt or not ours") == 1, out
            assert out.count(VALID) == 1 and out.index(NOTICED) < out.index(VALID), out
        assert {(r.restart, r.world) for r in cluster.steps()} == {(0, 2)}  # never restarted
    finally:
        del hostile
        cluster.close()


def started_pids(cluster: Cluster) -> list[int]:
    """Every worker pid the agents started (from their ``workers_started`` events)."""
    pids: list[int] = []
    for node in cluster.procs:
        for event in cluster.events(node):
            if event["name"] == "workers_started":
                metadata = event["metadata"]
                assert isinstance(metadata, dict)
                pids += metadata["pids"].values()
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


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
            assert out.count(NOTICED) == 1, out  # once, not once per poll
        # the workers were stopped: none of the processes the agents started is left
        pids = started_pids(cluster)
        assert len(pids) == 2 and not [p for p in pids if alive(p)], pids
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
        for node in ("a", "b"):
            os.killpg(cluster.procs[node].pid, signal.SIGTERM)
        # (how soon: bench/hostile_input.py; a stuck store took 99-115 s)
        codes = {node: cluster.wait_exit(node, timeout=60) for node in ("a", "b")}
        assert codes == {"a": 128 + signal.SIGTERM, "b": 128 + signal.SIGTERM}, cluster.outputs()
    finally:
        del hostile
        cluster.close()
