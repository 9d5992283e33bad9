"""The c10d rendezvous with real processes and a real TCP store on 127.0.0.1.

Each node is a separate Python process running the handler in a loop: it prints
every round it joins as a JSON line, re-rendezvouses when ``num_nodes_waiting()``
says so, and shuts down when it reads ``exit`` on stdin.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from multinode_support.etcd import voting_names
from multinode_support.ports import free_port
from multinode_support.waiting import wait_for
from relaunch.errors import RendezvousError, StoreConnectionError
from relaunch.procs._sys import descendants
from relaunch.rendezvous.api import RendezvousParameters
from relaunch.rendezvous.registry import create_handler

NODE = r"""
import json, os, select, sys, time
skew = float(os.environ.get("CLOCK_SKEW", "0"))  # this host's clock is off by that much
if skew:
    real_time = time.time
    time.time = lambda: real_time() + skew
from relaunch.rendezvous.api import RendezvousParameters
from relaunch.rendezvous.registry import create_handler
from relaunch.errors import RelaunchError

endpoint, lo, hi = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conf = dict(kv.split("=") for kv in sys.argv[4].split(",")) if len(sys.argv) > 4 else {}
params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id="job",
                              min_nodes=lo, max_nodes=hi, conf=conf)
handler = create_handler(params)
def say(**doc):
    print(json.dumps(doc), flush=True)
say(event="ready")
try:
    while True:
        info = handler.next_rendezvous()
        say(event="round", round=info.round, rank=info.rank, world=info.world_size)
        while handler.num_nodes_waiting() == 0:
            if select.select([sys.stdin], [], [], 0.05)[0]:
                sys.stdin.readline()
                say(event="bye", ok=handler.shutdown())
                sys.exit(0)
        time.sleep(float(os.environ.get("RETURN_DELAY", "0")))  # (a node slow to come back)
except RelaunchError as exc:
    say(event="error", kind=type(exc).__name__, message=str(exc))
    handler.shutdown()
    sys.exit(3)
"""

CONF = "last_call_timeout=0.5,keep_alive_interval=0.2,keep_alive_max_attempt=5,read_timeout=20"


class Node:
    def __init__(
        self,
        endpoint: str,
        lo: int,
        hi: int,
        conf: str = CONF,
        *,
        stderr: bool = False,
        return_delay: float = 0.0,
        clock_skew: float = 0.0,
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", NODE, endpoint, str(lo), str(hi), conf],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if stderr else None,
            start_new_session=True,
            env={**os.environ, "RETURN_DELAY": str(return_delay), "CLOCK_SKEW": str(clock_skew)},
        )
        assert self.next(timeout=60)["event"] == "ready"

    def next(self, timeout: float = 60) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "node said nothing in time"
        line = self.proc.stdout.readline()
        assert line, f"node exited with {self.proc.wait(timeout=10)}"
        doc: dict[str, Any] = json.loads(line)
        return doc

    def send_exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"exit\n")
        self.proc.stdin.flush()

    def exit(self, *, sent: bool = False) -> dict[str, Any]:
        if not sent:
            self.send_exit()
        doc = self.next()
        assert self.proc.wait(timeout=60) == 0
        return doc

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    started: list[Node] = []
    yield started
    for node in started:
        node.reap()


def test_two_nodes_on_the_tcp_store(nodes: list[Node]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    nodes += [Node(endpoint, 2, 2) for _ in range(2)]
    rounds = [n.next() for n in nodes]
    assert sorted(r["rank"] for r in rounds) == [0, 1]
    assert {(r["round"], r["world"]) for r in rounds} == {(0, 2)}
    # The host (the first node, it bound the port) leaves first: it waits for the other.
    nodes[0].send_exit()
    assert nodes[1].exit() == {"event": "bye", "ok": True}
    assert nodes[0].exit(sent=True) == {"event": "bye", "ok": True}


@pytest.mark.parametrize("host_told", ["first", "last"])
def test_a_job_s_nodes_leave_together_and_the_host_closes_after_their_last_call(
    nodes: list[Node], host_told: str
) -> None:
    # a job's end: every node leaves at once, the store's host among them (told first
    # or last: the others may be out of the state when it starts to leave); the leaves
    # are applied in batches, each node reads its ack and deletes its heartbeat, and
    # the host closes the server only after those last calls: every node says it left,
    # none warns (a call that met the closed server would retry, then warn). Dead after
    # 5 s: a node slow to make its last call on a loaded machine is not taken for dead
    endpoint = f"127.0.0.1:{free_port()}"
    conf = CONF + ",store_members=0,keep_alive_max_attempt=25"
    nodes += [Node(endpoint, 6, 6, conf, stderr=True) for _ in range(6)]
    assert {(r["round"], r["world"]) for r in (n.next() for n in nodes)} == {(0, 6)}
    for node in nodes if host_told == "first" else nodes[::-1]:  # (the first is the host)
        node.send_exit()
    assert [n.exit(sent=True) for n in nodes] == [{"event": "bye", "ok": True}] * 6
    for node in nodes:
        assert node.proc.stderr is not None
        said = node.proc.stderr.read().decode()
        assert not any(w in said for w in ("WARNING", "failed", "could not")), said


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


@pytest.mark.parametrize(("cpus", "expected"), [(None, "1"), ("3", "3"), ("all", "inherited")])
def test_the_members_run_on_the_scheduler_threads_asked(
    nodes: list[Node], cpus: str | None, expected: str
) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    conf = CONF + ",store_members=1" + ("" if cpus is None else f",store_cpus={cpus}")
    nodes.append(Node(endpoint, 1, 1, conf))
    assert nodes[0].next()["world"] == 1
    (etcd,) = [p for p in descendants(nodes[0].proc.pid) if _comm(p) == "etcd"]
    inherited = os.environ.get("GOMAXPROCS")
    assert _environ(etcd).get("GOMAXPROCS") == (inherited if expected == "inherited" else expected)
    nodes[0].exit()


def test_late_node_admitted_at_next_round(nodes: list[Node]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    nodes.append(Node(endpoint, 1, 2))
    assert nodes[0].next()["world"] == 1
    nodes.append(Node(endpoint, 1, 2))
    again, late = nodes[0].next(), nodes[1].next()
    assert again["round"] == late["round"] == 1
    assert again["world"] == late["world"] == 2
    for node in reversed(nodes):
        node.exit()


@pytest.mark.parametrize("store", ["0", "auto"])  # the TCP store; the embedded etcd
def test_killed_node_survivors_continue_smaller(nodes: list[Node], store: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    # A long last call: the first round completes at max_nodes, and the survivors'
    # round must complete as soon as both are back, not after the last call.
    conf = CONF.replace("last_call_timeout=0.5", "last_call_timeout=600")
    conf += f",store_members={store}"
    nodes += [Node(endpoint, 2, 3, conf) for _ in range(3)]
    assert {n.next()["world"] for n in nodes} == {3}
    if store == "auto":  # the store survives a loss once it has grown to three members
        wait_for(
            lambda: len(voting_names([f"http://{endpoint}"])) == 3, 60, what="3 voting members"
        )
    nodes[2].kill()  # not the endpoint's node (the TCP store's host)
    survivors = [n.next() for n in nodes[:2]]
    assert {r["world"] for r in survivors} == {2}
    assert sorted(r["rank"] for r in survivors) == [0, 1]
    for node in nodes[:2]:  # together, as a job's nodes leave (an embedded member that
        node.send_exit()  # leaves first waits for the others' last calls)
    for node in nodes[:2]:
        node.exit(sent=True)


@pytest.mark.parametrize("lost", [1, 2])  # the node whose clock is ahead; behind
def test_nodes_whose_clocks_differ_keep_their_round_and_a_silent_one_is_dropped(
    nodes: list[Node], lost: int
) -> None:
    # three hosts whose clocks are 5 s apart (one 5 s ahead, one 5 s behind: NTP not
    # running on them): no live node is taken for dead (a heartbeat was compared with
    # the reader's clock, and the one behind was dead at its every beat: its round
    # started again and again), and a node that goes silent (SIGSTOP: no beat, its
    # connections open, as a machine that hangs) is dropped after the dead-node delay
    # whatever its clock (the one ahead was alive 5 s longer)
    endpoint = f"127.0.0.1:{free_port()}"
    conf = CONF + ",store_members=0"  # (1 s dead-node delay)
    nodes += [Node(endpoint, 2, 3, conf, clock_skew=skew) for skew in (0.0, 5.0, -5.0)]
    assert {(r["round"], r["world"]) for r in (n.next() for n in nodes)} == {(0, 3)}
    # 3 s: three dead-node delays, fifteen looks of the steward, and no node says more
    assert select.select([n.proc.stdout for n in nodes], [], [], 3.0)[0] == []
    os.killpg(nodes[lost].proc.pid, signal.SIGSTOP)
    survivors = [n for i, n in enumerate(nodes) if i != lost]
    rounds = [n.next(timeout=30) for n in survivors]
    assert {(r["round"], r["world"]) for r in rounds} == {(1, 2)}
    nodes[lost].kill()
    for node in reversed(survivors):
        assert node.exit() == {"event": "bye", "ok": True}


def test_spare_takes_lost_nodes_place(nodes: list[Node]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    nodes += [Node(endpoint, 2, 2) for _ in range(2)]
    assert {n.next()["world"] for n in nodes} == {2}
    nodes.append(Node(endpoint, 2, 2))  # the spare: blocks in next_rendezvous
    nodes[1].kill()
    host, spare = nodes[0].next(), nodes[2].next()
    assert host["world"] == spare["world"] == 2
    assert host["round"] == spare["round"] == 1
    nodes[2].exit()
    nodes[0].exit()


def test_a_node_slow_to_come_back_keeps_its_place_from_the_spares(nodes: list[Node]) -> None:
    # a node lost: its spare takes its place, and the second spare waits, though a node
    # of the round takes 2 s to ask again (as one waiting at its exit barrier does, or
    # one stopping its workers): that node holds its ranks' snapshots
    endpoint = f"127.0.0.1:{free_port()}"
    conf = CONF.replace("last_call_timeout=0.5", "last_call_timeout=60") + ",store_members=0"
    nodes.append(Node(endpoint, 3, 3, conf))  # the store's host
    nodes.append(Node(endpoint, 3, 3, conf, return_delay=2.0))
    nodes.append(Node(endpoint, 3, 3, conf))
    assert {(r["round"], r["world"]) for r in (n.next() for n in nodes)} == {(0, 3)}
    nodes += [Node(endpoint, 3, 3, conf) for _ in range(2)]  # two spares
    nodes[2].kill()
    slow = nodes[1].next()
    assert (slow["round"], slow["world"]) == (1, 3)
    host = nodes[0].next()
    assert (host["round"], host["world"]) == (1, 3)
    # (the round has three places: two are the host's and the slow node's)
    said = select.select([n.proc.stdout for n in nodes[3:]], [], [], 60)[0]
    seated = next(n for n in nodes[3:] if n.proc.stdout in said)
    assert seated.next()["round"] == 1
    next(n for n in nodes[3:] if n is not seated).kill()  # (a spare reads no exit)
    for node in (seated, nodes[1], nodes[0]):
        assert node.exit() == {"event": "bye", "ok": True}


def test_corrupt_state_gives_clear_error(nodes: list[Node]) -> None:
    from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

    with TCPStoreServer(host="127.0.0.1", port=0) as server:
        with TCPStoreClient("127.0.0.1", server.port, timeout=10) as client:
            client.set("relaunch/rdzv/job/state", b"cos\nsystem\n(S'echo pwned'\ntR.")
        node = Node(f"127.0.0.1:{server.port}", 1, 1, CONF + ",is_host=0")
        nodes.append(node)
        doc = node.next()
        assert doc["event"] == "error" and doc["kind"] == "RendezvousStateError"
        assert "relaunch/rdzv/job/state" in doc["message"]
        assert node.proc.wait(timeout=30) == 3


def _one_node(endpoint: str, conf: dict[str, str]) -> RendezvousParameters:
    """The parameters of a one-node c10d rendezvous at ``endpoint``."""
    return RendezvousParameters(
        backend="c10d", endpoint=endpoint, run_id="job", min_nodes=1, max_nodes=1, conf=conf
    )


def test_cannot_bind_or_connect_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        params = _one_node(f"127.0.0.1:{port}", {"is_host": "1"})
        with pytest.raises(RendezvousError, match=f"cannot listen on port {port}"):
            create_handler(params)
    params = _one_node(f"127.0.0.1:{free_port()}", {"is_host": "0", "read_timeout": "0.3"})
    with pytest.raises(StoreConnectionError, match="cannot reach the c10d rendezvous store"):
        create_handler(params)
    assert not [t for t in threading.enumerate() if t.name.startswith("relaunch-")]
    time.sleep(0)


def test_port_held_by_a_connection_is_hosted_once_it_is_free() -> None:
    """The endpoint's port is some connection's source port (the kernel gives out the
    same range for both): the node finds no store there, waits, and hosts it once the
    connection is closed, instead of connecting to a port nobody will ever serve."""
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        holder = socket.socket()
        holder.bind(("127.0.0.1", port))  # the source port of an outgoing connection
        holder.connect(listener.getsockname())
        accepted, _ = listener.accept()
        with socket.socket() as probe, pytest.raises(OSError):
            probe.bind(("0.0.0.0", port))  # as the store server would

        def end_connection() -> None:  # the peer closes first: no TIME_WAIT on the port
            accepted.close()
            time.sleep(0.1)
            holder.close()

        releaser = threading.Timer(1.0, end_connection)
        releaser.start()
        params = _one_node(f"127.0.0.1:{port}", {"read_timeout": "30"})
        try:
            handler = create_handler(params)
            try:
                info = handler.next_rendezvous()
                assert info.world_size == 1
            finally:
                handler.shutdown()
        finally:
            releaser.join(timeout=5)
            accepted.close()
            holder.close()


def test_rounds_leave_no_request_or_place_keys_behind() -> None:
    """A node deletes its join request, its ack and its last round's place once it has
    its place in a later round (its keep-alive thread, after a beat): round after round
    the store keeps only the live round's keys, not three more per node each round."""
    from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

    prefix = "relaunch/rdzv/job/"
    conf = dict(kv.split("=") for kv in CONF.split(",")) | {"is_host": "0"}
    params = RendezvousParameters(
        backend="c10d", endpoint="", run_id="job", min_nodes=2, max_nodes=2, conf=conf
    )
    with TCPStoreServer(host="127.0.0.1", port=0) as server:
        params = dataclasses.replace(params, endpoint=f"127.0.0.1:{server.port}")
        handlers = [create_handler(params) for _ in range(2)]
        try:
            with TCPStoreClient("127.0.0.1", server.port, timeout=10) as client:
                with ThreadPoolExecutor(2, thread_name_prefix="test-rdzv") as pool:
                    for _ in range(5):  # a group restart each: every node joins again
                        rounds = [pool.submit(h.next_rendezvous) for h in handlers]
                        infos = [r.result(timeout=60) for r in rounds]
                last = infos[0].round
                assert {i.round for i in infos} == {last} and last >= 4
                tickets = int(client.get(prefix + "req") or b"0")
                assert tickets >= 10
                spent = [
                    f"{prefix}{kind}/{t}" for t in range(1, tickets + 1) for kind in ("req", "ack")
                ]
                spent += [f"{prefix}assign/{r}/{h.node_id}" for r in range(last) for h in handlers]
                wait_for(lambda: not [k for k in spent if client.get(k) is not None], 30)
                for h in handlers:  # the live round's places stay
                    assert client.get(f"{prefix}assign/{last}/{h.node_id}") is not None
        finally:
            for h in handlers:
                h.shutdown()
