"""Issue 3 acceptance, faults: a node lost, a spare stepping in, a corrupt rendezvous state.

Real ``relaunch`` agents as separate processes on a c10d TCP store; gloo workers write
one line per step (see ``tests/multinode_support``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.cluster import Cluster, free_port
from relaunch.store.tcp import TCPStoreClient

pytestmark = pytest.mark.timeout(180)

STATE_KEY = "relaunch/rdzv/job/state"  # src/relaunch/rendezvous/_backend.py, run id "job"
HEARTBEAT = "keep_alive_interval=0.25,keep_alive_max_attempt=8"


@pytest.fixture
def c10d(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, backend="c10d", endpoint=f"127.0.0.1:{free_port()}")
    try:
        yield cluster
    finally:
        cluster.close()


def read_state(cluster: Cluster) -> dict[str, object] | None:
    host, port = cluster.endpoint.split(":")
    try:
        with TCPStoreClient(host, int(port), timeout=10) as client:
            raw = client.get(STATE_KEY)
    except OSError:
        return None
    except Exception:
        return None
    doc: dict[str, object] | None = json.loads(raw) if raw else None
    return doc


def test_agent_killed_with_its_workers_survivor_finishes_alone(
    c10d: Cluster, tmp_path: Path
) -> None:
    go = tmp_path / "go"  # workers train on until it exists, then 3 more steps
    for node, host in (("a", 1), ("b", 0)):
        c10d.start(
            node, f"go={go}", "steps=3", nnodes="1:2", nproc=1, max_restarts=2,
            conf=f"is_host={host},{HEARTBEAT}",
        )  # fmt: skip
    c10d.wait_for(
        "both nodes training together",
        lambda: {r.node for r in c10d.steps() if r.world == 2} == {"a", "b"},
    )
    c10d.kill("b")  # no goodbye: its workers die with it
    c10d.wait_for("the survivor training alone", lambda: c10d.steps("a")[-1].world == 1)
    go.touch()
    assert c10d.wait_exit("a") == 0, c10d.outputs()
    rows = c10d.steps("a")
    assert rows[-1].world == 1 and rows[-1].rank == 0 and rows[-1].total == 1
    names = [e.get("name") for e in c10d.events("a")]
    assert "membership_changed" in names or "workers_failed" in names, names
    assert names.count("rendezvous_complete") >= 2  # re-rendezvous after the loss
    assert "workers_succeeded" in names


def test_losing_the_store_host_ends_the_job_with_one_clear_line(
    c10d: Cluster, tmp_path: Path
) -> None:
    go = tmp_path / "go"  # never created: the job trains until the store host is lost
    for node, host in (("a", 1), ("b", 0)):
        c10d.start(
            node, f"go={go}", nnodes="1:2", nproc=2, max_restarts=2, warm=True,
            conf=f"is_host={host},{HEARTBEAT},heartbeat_timeout=2",
        )  # fmt: skip
    c10d.wait_for(
        "both nodes training together",
        lambda: {r.node for r in c10d.steps() if r.world == 4} == {"a", "b"},
    )
    c10d.kill("a")  # the node hosting the c10d store
    assert c10d.wait_exit("b", timeout=60) == 1, c10d.outputs()
    out = c10d.output("b")
    assert "the node hosting the c10d rendezvous store was lost" in out, out
    assert "--rdzv-backend etcd" in out
    assert "store_lost" in [e.get("name") for e in c10d.events("b")]


def test_spare_steps_in_for_a_killed_participant(c10d: Cluster, tmp_path: Path) -> None:
    go = tmp_path / "go"
    args = (f"go={go}", "steps=3")
    for node, host in (("a", 1), ("b", 0)):
        c10d.start(node, *args, nnodes="2:2", nproc=1, max_restarts=2,
                   conf=f"is_host={host},{HEARTBEAT}")  # fmt: skip
    c10d.wait_for(
        "two nodes training", lambda: {r.node for r in c10d.steps() if r.world == 2} == {"a", "b"}
    )
    c10d.start("c", *args, nnodes="2:2", nproc=1, max_restarts=2, conf=f"is_host=0,{HEARTBEAT}")

    def spare_registered() -> bool:
        state = read_state(c10d)
        return bool(state and state.get("redundancy_list"))

    c10d.wait_for("the third agent on the redundancy list", spare_registered)
    assert c10d.steps("c") == []  # a spare: no worker started
    c10d.kill("b")
    c10d.wait_for("the spare training", lambda: bool(c10d.steps("c")))
    go.touch()
    assert c10d.wait_exit("a") == 0, c10d.outputs()
    assert c10d.wait_exit("c") == 0, c10d.outputs()  # the spare exits too, with 0
    last_a, last_c = c10d.steps("a")[-1], c10d.steps("c")[-1]
    assert last_a.world == last_c.world == 2
    assert {last_a.rank, last_c.rank} == {0, 1}
    assert last_a.total == last_c.total == 3


def test_corrupt_state_is_one_clear_line(c10d: Cluster) -> None:
    # a waits for a second node that never comes; its keep-alive reads the state
    c10d.start("a", "steps=3", nnodes="2", nproc=1, conf=f"is_host=1,{HEARTBEAT}")
    c10d.wait_for("the rendezvous state in the store", lambda: read_state(c10d) is not None)
    host, port = c10d.endpoint.split(":")
    with TCPStoreClient(host, int(port), timeout=10) as client:
        client.set(STATE_KEY, b"\x00\xffnot json{")
    assert c10d.wait_exit("a", timeout=60) != 0, c10d.outputs()
    text = c10d.output("a")
    lines = [line for line in text.splitlines() if line.startswith("relaunch: error:")]
    assert len(lines) == 1, text
    assert STATE_KEY in lines[0] and "corrupt" in lines[0], text
    assert text.count("this node goes on with the last valid state") == 1, text  # once
    assert "Traceback" not in text, text
    assert c10d.steps() == []


def test_unneeded_spare_exits_with_the_job(c10d: Cluster, tmp_path: Path) -> None:
    go = tmp_path / "go"
    conf = f"{HEARTBEAT},close_timeout=5"  # were the spare not told, the host waits 5 s only
    for node, host in (("a", 1), ("b", 0), ("c", 0)):
        c10d.start(node, f"go={go}", "steps=3", nnodes="2:2", nproc=1,
                   conf=f"is_host={host},{conf}")  # fmt: skip

    def spare_registered() -> bool:
        state = read_state(c10d)
        return bool(state and state.get("redundancy_list"))

    c10d.wait_for("two nodes training", lambda: len({r.node for r in c10d.steps()}) == 2)
    c10d.wait_for("the third agent on the redundancy list", spare_registered)
    go.touch()
    codes = {node: c10d.wait_exit(node) for node in ("a", "b", "c")}
    assert codes == {"a": 0, "b": 0, "c": 0}, c10d.outputs()  # the spare too: no hang
    assert len({r.node for r in c10d.steps()}) == 2
    assert {r.world for r in c10d.steps()} == {2}


def test_a_hang_is_blamed_on_the_rank_that_stopped_first_job_wide(c10d: Cluster) -> None:
    # Node a's local rank 1 hangs; every other rank blocks in the all_reduce it never
    # joins, a moment later. Node a's agent looks once a second, node b's ten times: b
    # finds its blocked ranks past the timeout first and ends the job (no restarts
    # left). The job's report still names a's rank, which stopped first.
    for node, host, interval in (("a", 1, "1"), ("b", 0, "0.1")):
        c10d.start(
            node, "hang=a:1:3", "steps=8", nproc=2, max_restarts=0,
            conf=f"is_host={host},{HEARTBEAT}",
            flags=("--hang-timeout=3", f"--monitor-interval={interval}"),
        )  # fmt: skip
    assert c10d.wait_exit("b", timeout=120) == 1, c10d.outputs()
    assert c10d.wait_exit("a", timeout=60) == 1, c10d.outputs()
    causes = [
        (node, int(rank), cause)
        for node in ("a", "b")
        for event in c10d.events(node)
        if event.get("name") == "workers_failed"
        for rank, cause in event["metadata"]["causes"].items()  # type: ignore[index, union-attr]
    ]
    hung = [(r, c) for n, r, c in causes if n == "a" and c["local_rank"] == 1]
    assert hung and hung[0][1]["message"].startswith("Hang: no Python code ran"), causes
    rank = hung[0][0]
    # the status page's root cause: the earliest of the killed (a hang's exit is SIGKILL)
    killed = [(r, c) for _, r, c in causes if c["exitcode"] < 0 and c["exitcode"] != -15]
    assert min(killed, key=lambda rc: rc[1]["time"])[0] == rank, causes
    # the report each agent prints: root cause first
    for node in ("a", "b"):
        report = c10d.output(node).split("Root Cause (first observed failure):")[-1]
        root = report.split("Other Failures:")[0]
        assert f"rank      : {rank} (local_rank: 1)" in root, c10d.output(node)
        assert "Hang: no Python code ran" in root, c10d.output(node)


# -- faults as the job ends -----------------------------------------------------------
# A node whose workers finished waits for the others at the exit barrier; the round is
# done only once every node arrived. Until then a failure anywhere runs the round again.


def test_a_failure_after_another_node_finished_runs_the_round_again(c10d: Cluster) -> None:
    # Rank 3 (node b) dies a second after the end, when node a's workers are done.
    for node, host in (("a", 1), ("b", 0)):
        c10d.start(node, "steps=3", "end_crash=3", max_restarts=1, conf=f"is_host={host}")
    assert c10d.wait_exit("a") == 0, c10d.outputs()
    assert c10d.wait_exit("b") == 0, c10d.outputs()
    names = [e.get("name") for e in c10d.events("a")]
    assert "workers_succeeded" in names and "round_reopened" in names, names
    assert {r.rank for r in c10d.steps() if r.restart == 1} == {0, 1, 2, 3}
    assert "exit barrier" not in c10d.output("a"), c10d.output("a")


def test_a_failure_with_no_restarts_left_ends_the_finished_node_at_once(
    c10d: Cluster,
) -> None:
    for node, host in (("a", 1), ("b", 0)):
        c10d.start(node, "steps=3", "end_crash=3", conf=f"is_host={host}")
    assert c10d.wait_exit("b") == 1, c10d.outputs()
    assert c10d.wait_exit("a") == 1, c10d.outputs()  # (not after the exit barrier's 300 s)
    out = c10d.output("a")
    assert "Root Cause" in out and "rank      : 3" in out and "exitcode  : 3" in out, out


def test_a_node_that_waited_to_rejoin_ends_with_the_job(c10d: Cluster) -> None:
    # c is a spare; after rank 3's end-of-job failure two of the three nodes run the
    # round again, and the third one ends with the job, not as a failure.
    for node, host in (("a", 1), ("b", 0)):
        c10d.start(node, "steps=3", "end_crash=3", max_restarts=1, conf=f"is_host={host}")
    c10d.wait_for("a and b training", lambda: len(c10d.steps()) >= 4)
    c10d.start("c", "steps=3", "end_crash=3", max_restarts=1, conf="is_host=0")
    assert [c10d.wait_exit(n) for n in ("a", "b", "c")] == [0, 0, 0], c10d.outputs()
    assert {r.rank for r in c10d.steps() if r.restart == 1} == {0, 1, 2, 3}
    assert "Error" not in c10d.outputs(), c10d.outputs()


def test_a_node_joining_as_the_job_ends_restarts_nobody(c10d: Cluster, tmp_path: Path) -> None:
    release = tmp_path / "release"  # node b's workers end once it exists
    for node, host in (("a", 1), ("b", 0)):
        c10d.start(node, "steps=3", f"linger=b:{release}", nnodes="2:3", conf=f"is_host={host}")
    c10d.wait_for(
        "node a done, node b's workers still running",
        lambda: "workers_succeeded" in [e.get("name") for e in c10d.events("a")],
    )
    c10d.start("c", "steps=3", f"linger=b:{release}", nnodes="2:3", conf="is_host=0")

    def c_waits() -> bool:  # (three nodes: the store is an embedded etcd; ask status)
        done = subprocess.run(
            [sys.executable, "-m", "relaunch", "status", f"--rdzv-endpoint={c10d.endpoint}",
             "--rdzv-id=job", "--timeout=3", "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return done.returncode == 0 and json.loads(done.stdout)["world"]["nodes_waiting"] > 0

    c10d.wait_for("node c waiting to join", c_waits)
    release.touch()
    assert [c10d.wait_exit(n) for n in ("a", "b", "c")] == [0, 0, 0], c10d.outputs()
    for node in ("a", "b"):
        names = [e.get("name") for e in c10d.events(node)]
        assert "membership_changed" not in names and "round_reopened" not in names, names
    assert {r.restart for r in c10d.steps()} == {0} and {r.world for r in c10d.steps()} == {4}
    assert "not needed" in c10d.output("c"), c10d.output("c")


def _three_training(c10d: Cluster, go: Path, conf: str = "") -> None:
    """Start a (the store's host), b and c (``--nnodes 2:3``, no restart) until all
    three train; they train on until ``go`` exists."""
    for node, host in (("a", 1), ("b", 0), ("c", 0)):
        c10d.start(node, f"go={go}", "steps=3", nnodes="2:3", nproc=1,
                   conf=f"is_host={host},{conf}{HEARTBEAT}")  # fmt: skip
    c10d.wait_for("three nodes training", lambda: any(r.world == 3 for r in c10d.steps("c")))


def test_a_node_silent_past_the_dead_node_delay_rejoins_without_spending_a_restart(
    c10d: Cluster, tmp_path: Path
) -> None:
    # c stalls (SIGSTOP: a machine that stops answering, its connections left open)
    # longer than the dead-node delay: a and b go on without it. Once it runs again,
    # its workers' failure (their peers gone) is not the job's: with --max-restarts 0
    # the job must not end for it, and c trains with the others again.
    go = tmp_path / "go"
    _three_training(c10d, go)
    os.killpg(c10d.procs["c"].pid, signal.SIGSTOP)
    try:
        stopped_at = len(c10d.steps())
        c10d.wait_for(
            "a and b training without c",
            lambda: any(r.world == 2 for r in c10d.steps()[stopped_at:]),
        )
    finally:
        os.killpg(c10d.procs["c"].pid, signal.SIGCONT)
    back_at = len(c10d.steps("c"))
    c10d.wait_for(
        "c training with the others again",
        lambda: any(r.world == 3 for r in c10d.steps("c")[back_at:]),
    )
    go.touch()
    assert [c10d.wait_exit(n) for n in ("a", "b", "c")] == [0, 0, 0], c10d.outputs()
    for node in ("a", "b", "c"):
        names = [e.get("name") for e in c10d.events(node)]
        assert "run_failed" not in names and "restart" not in names, (node, names)


def test_with_no_restarts_a_node_that_joins_finds_the_others_workers_forked(
    c10d: Cluster, tmp_path: Path
) -> None:
    # torchrun's default --max-restarts 0: the membership restart that admits b spends
    # no restart, and a's workers come from its fork server, not fresh interpreters
    go = tmp_path / "go"
    c10d.start("a", f"go={go}", "steps=3", nnodes="1:2", nproc=1, warm=True,
               conf=f"is_host=1,{HEARTBEAT}")  # fmt: skip
    c10d.wait_for("a training alone", lambda: any(r.world == 1 for r in c10d.steps("a")))
    c10d.wait_for(
        "a's fork server",
        lambda: any(e.get("name") == "fork_server_started" for e in c10d.events("a")),
        timeout=90,
    )
    c10d.start("b", f"go={go}", "steps=3", nnodes="1:2", nproc=1, warm=True,
               conf=f"is_host=0,{HEARTBEAT}")  # fmt: skip
    c10d.wait_for(
        "a and b training together",
        lambda: {r.node for r in c10d.steps() if r.world == 2} == {"a", "b"},
    )
    go.touch()
    assert [c10d.wait_exit(n) for n in ("a", "b")] == [0, 0], c10d.outputs()
    started = [e for e in c10d.events("a") if e.get("name") == "workers_started"]
    assert [e["metadata"]["forked"] for e in started] == [[], [0]], started  # type: ignore[index]


def test_a_node_told_to_stop_leaves_and_the_others_go_on_without_spending_a_restart(
    c10d: Cluster, tmp_path: Path
) -> None:
    # a scale-down: c's agent alone gets SIGTERM (a drained machine, a pod scaled
    # away). It leaves its round before its workers stop, so the others' workers'
    # failure on its closed connections is not the job's: with --max-restarts 0 the
    # job goes on at two nodes (it used to fail: "no restarts left"). The store is a's
    # TCP store (an etcd member that leaves within 7 s of the cluster's start stays
    # until the others leave: README, "A limit of this rule")
    go = tmp_path / "go"
    _three_training(c10d, go, "store_members=0,")
    stopped_at = len(c10d.steps())
    os.kill(c10d.procs["c"].pid, signal.SIGTERM)  # the agent, not its workers
    assert c10d.wait_exit("c") != 0, c10d.outputs()
    c10d.wait_for(
        "a and b training without c",
        lambda: {r.node for r in c10d.steps()[stopped_at:] if r.world == 2} == {"a", "b"},
    )
    go.touch()
    assert [c10d.wait_exit(n) for n in ("a", "b")] == [0, 0], c10d.outputs()
    for node in ("a", "b"):
        names = [e.get("name") for e in c10d.events(node)]
        assert "run_failed" not in names and "restart" not in names, (node, names)


def test_a_node_told_to_stop_once_its_workers_are_done_leaves_the_round_to_the_others(
    c10d: Cluster, tmp_path: Path
) -> None:
    # a's workers finished; a waits at the exit barrier while b's still run. A SIGTERM
    # to a must not reopen the round: b's workers end in it, not run again
    go, linger = tmp_path / "go", tmp_path / "linger"
    for node, host in (("a", 0), ("b", 1)):
        c10d.start(node, f"go={go}", "steps=3", f"linger=b:{linger}", nnodes="1:2", nproc=1,
                   conf=f"is_host={host},store_members=0,{HEARTBEAT}")  # fmt: skip
    c10d.wait_for("both nodes training", lambda: any(r.world == 2 for r in c10d.steps("a")))
    go.touch()
    c10d.wait_for(
        "a at its exit barrier",
        lambda: any(e.get("name") == "workers_succeeded" for e in c10d.events("a")),
    )
    os.kill(c10d.procs["a"].pid, signal.SIGTERM)
    c10d.wait_exit("a")
    linger.touch()
    assert c10d.wait_exit("b") == 0, c10d.outputs()
    started = [e for e in c10d.events("b") if e.get("name") == "workers_started"]
    assert len(started) == 1, c10d.outputs()
