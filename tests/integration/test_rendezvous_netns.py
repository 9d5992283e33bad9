"""Nodes in network namespaces of their own, on separate addresses; one is cut off.

Each node runs in its own ``ip netns`` with a veth pair into a bridge (addresses
10.213.X.1..3). After the first round, the third node's link is set down: the
others notice it by heartbeat and complete a round of two. Needs root (or
CAP_NET_ADMIN); skipped with the reason otherwise. Everything created is removed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from multinode_support.netns import Net, network

pytestmark = pytest.mark.netns

NODE = r"""
import json, select, sys
from relaunch.rendezvous.api import RendezvousParameters
from relaunch.rendezvous.registry import create_handler

endpoint, addr = sys.argv[1], sys.argv[2]
conf = {"last_call_timeout": "600", "keep_alive_interval": "0.2",
        "keep_alive_max_attempt": "5", "read_timeout": "30"}
params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id="job", min_nodes=2,
                              max_nodes=3, local_addr=addr, conf=conf)
handler = create_handler(params)
print(json.dumps({"event": "ready"}), flush=True)
while True:
    info = handler.next_rendezvous()
    print(json.dumps({"event": "round", "round": info.round, "rank": info.rank,
                      "world": info.world_size}), flush=True)
    while handler.num_nodes_waiting() == 0:
        if select.select([sys.stdin], [], [], 0.05)[0]:
            sys.stdin.readline()
            print(json.dumps({"event": "bye", "ok": handler.shutdown()}), flush=True)
            sys.exit(0)
"""


@pytest.fixture
def net() -> Iterator[Net]:
    with network(3, tag="rl", octet=213) as created:
        yield created


class Node:
    def __init__(self, ns: str, endpoint: str, addr: str) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", NODE, endpoint, addr],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )

    def next(self, timeout: float = 60) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, "node said nothing in time"
        line = self.proc.stdout.readline()
        assert line, f"node exited with {self.proc.wait(timeout=10)}"
        doc: dict[str, Any] = json.loads(line)
        return doc

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def test_cut_off_node_is_noticed_and_the_others_continue(net: Net) -> None:
    endpoint = f"{net.addr(0)}:29411"
    nodes = [Node(ns, endpoint, net.addr(i)) for i, ns in enumerate(net.spaces)]
    try:
        assert [n.next()["event"] for n in nodes] == ["ready"] * 3
        first = [n.next() for n in nodes]
        assert {r["world"] for r in first} == {3}
        assert sorted(r["rank"] for r in first) == [0, 1, 2]
        net.cut(2)
        again = [n.next() for n in nodes[:2]]
        assert {r["world"] for r in again} == {2}
        assert {r["round"] for r in again} == {1}
    finally:
        for node in nodes:
            node.stop()
