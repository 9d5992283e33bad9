"""With a job secret, a node's snapshot server admits no other host before its first
round, then the round's nodes, and a node of the job that joined after the round
(asked of the rendezvous, ``late``): hosts on
addresses of their own, each in a network namespace (veth to a bridge). The case: a
node whose workers finished serves the only copies of the newest steps, and the
spares that took the lost nodes' places ask it for them; before, it refused them.
Needs root (or CAP_NET_ADMIN); skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from multinode_support.netns import Net, network
from multinode_support.snapshot_files import write_snapshot

pytestmark = [pytest.mark.netns, pytest.mark.timeout(90)]

JOB = "admission"

SERVER = r"""
import json, sys
from relaunch.checkpoint._peer_server import SnapshotServer

root, job, addr, round_node, late_file = sys.argv[1:]
server = SnapshotServer(root, job, addr, guarded=True)  # a job secret

def admits(host):  # the rendezvous' answer: the round's node, the nodes the state names now
    with open(late_file) as f:
        return host == round_node or host in f.read().split()

print(json.dumps({"port": server.port}), flush=True)
sys.stdin.readline()  # the first round starts
server.set_admits(admits)
print("round", flush=True)
sys.stdin.readline()
server.close()
"""

CLIENT = r"""
import sys
from relaunch.checkpoint._channel import Channel
from relaunch.checkpoint._peer_client import list_steps

addr, port, job = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    with Channel(addr, port) as channel:
        print(sorted(list_steps(channel, job, timeout=10).steps))
except Exception as exc:
    print("refused:", type(exc).__name__)
"""


@pytest.fixture
def net() -> Iterator[Net]:
    with network(3, tag="sa", octet=217) as created:
        yield created


def ask(net: Net, i: int, port: int) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", net.spaces[i], sys.executable, "-c", CLIENT, net.addr(0),
         str(port), JOB],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_node_that_joined_after_the_round_is_served_and_a_stranger_is_not(
    net: Net, tmp_path: Path
) -> None:
    write_snapshot(tmp_path / "root", 3, 7, b"rank 3 at 7", job=JOB)
    late = tmp_path / "late"
    late.write_text("")
    server = subprocess.Popen(
        ["ip", "netns", "exec", net.spaces[0], sys.executable, "-c", SERVER,
         str(tmp_path / "root"), JOB, net.addr(0), net.addr(1), str(late)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        assert select.select([server.stdout], [], [], 60)[0], "the server said nothing"
        port = json.loads(server.stdout.readline())["port"]
        # before its first round, a guarded server knows of no host of the job
        assert ask(net, 1, port).startswith("refused")
        assert server.stdin is not None
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.stdout.readline() == "round\n"
        assert ask(net, 1, port) == "[3]"  # a node of the round
        assert ask(net, 2, port).startswith("refused")  # not in the job (yet)
        late.write_text(net.addr(2))  # it joined: the state names it now
        assert ask(net, 2, port) == "[3]"
        _, err = server.communicate("\n", timeout=30)
        assert server.returncode == 0, err
        assert err.count(f"refused a connection from {net.addr(2)}") == 1, err
        assert err.count(f"refused a connection from {net.addr(1)}") == 1, err
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)
