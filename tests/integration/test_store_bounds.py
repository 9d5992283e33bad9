"""The TCP store server is bounded: a value over its limit is refused (the client that
sent it is dropped, no byte of it buffered), appends cannot grow past it, a 10,000-node
rendezvous state fits, and one hostile client stalls neither the others nor shutdown.
Real server, real torch clients."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from multinode_support.waiting import wait_for
from relaunch.errors import ConfigError, StoreError
from relaunch.rendezvous._state import RendezvousState, encode_state
from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

pytestmark = pytest.mark.timeout(120)


def torch_client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))


def test_a_44_mb_value_is_refused_and_the_others_go_on() -> None:
    # (the good client's latency meanwhile, and the server's close: bench/hostile_input.py)
    with TCPStoreServer(host="127.0.0.1", port=0) as server:
        good = TCPStoreClient("127.0.0.1", server.port, timeout=10)
        hostile = torch_client(server.port)
        try:
            stop = threading.Event()
            beats: list[int] = []

            def poll() -> None:
                while not stop.is_set():
                    beats.append(good.add("beats", 1))
                    time.sleep(0.01)

            poller = threading.Thread(target=poll, name="good-client")
            poller.start()
            wait_for(lambda: len(beats) >= 3, 30, what="the good client's first calls")
            with pytest.raises(Exception):  # noqa: B017 (torch's error type varies)
                hostile.set("relaunch/rdzv/job/state", b"x" * (44 * 1024 * 1024))
                hostile.get("relaunch/rdzv/job/state")  # the dropped connection shows here
            refused = len(beats)
            # the good client goes on after it, on its own connection
            wait_for(lambda: len(beats) >= refused + 3, 30, what="the good client's calls")
            stop.set()
            poller.join(30)
            assert not poller.is_alive()
            assert beats == list(range(1, len(beats) + 1))  # every call answered, in order
            assert good.get("relaunch/rdzv/job/state") is None  # nothing of it was stored
        finally:
            good.close()
            del hostile


def test_appends_cannot_grow_a_value_past_the_limit() -> None:
    with TCPStoreServer(host="127.0.0.1", port=0, max_value_bytes=64 * 1024) as server:
        client = torch_client(server.port)
        client.append("log", b"a" * 60_000)
        with pytest.raises(Exception):  # noqa: B017
            client.append("log", b"b" * 10_000)
            client.get("log")
        reader = TCPStoreClient("127.0.0.1", server.port, timeout=10)
        try:
            assert len(reader.get("log") or b"") == 60_000
        finally:
            reader.close()
        del client


def test_our_client_refuses_an_oversized_value_itself() -> None:
    with TCPStoreServer(host="127.0.0.1", port=0) as server:
        client = TCPStoreClient("127.0.0.1", server.port, timeout=10)
        try:
            with pytest.raises(StoreError, match="exceeds the store's limit"):
                client.set("big", b"x" * (40 * 1024 * 1024))
            client.set("small", b"ok")  # the connection is still fine
            assert client.get("small") == b"ok"
        finally:
            client.close()


def test_a_10000_node_state_fits() -> None:
    nodes = {f"10.0.{i // 250}.{i % 250}_{100000 + i}_0": i for i in range(10_000)}
    state = RendezvousState(
        run_id="job",
        round=3,
        complete=True,
        participants=nodes,
        last_heartbeats={n: 1.7e9 for n in nodes},
    )
    raw = encode_state(state)
    with TCPStoreServer(host="127.0.0.1", port=0) as server:
        client = TCPStoreClient("127.0.0.1", server.port, timeout=10)
        try:
            client.set("relaunch/rdzv/job/state", raw)
            assert client.get("relaunch/rdzv/job/state") == raw
        finally:
            client.close()


def test_the_limit_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_value_bytes"):
        TCPStoreServer(host="127.0.0.1", port=0, max_value_bytes=10)


_AT_ITS_LIMIT = """
import logging, os, resource, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
from relaunch.store.tcp import TCPStoreServer
server = TCPStoreServer(host="127.0.0.1", port=0).start()
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(server.port, flush=True)
sys.stdin.read()
server.close()
"""


def test_a_server_out_of_file_descriptors_says_so_once_and_serves_the_waiting_clients() -> None:
    # the server's process may open 20 files more: of 40 clients, about 20 wait in the
    # backlog until some close. It stops watching its socket and says so once; before,
    # the socket stayed ready, and the server spun on it (a core) with a line per turn
    with subprocess.Popen(
        [sys.executable, "-c", _AT_ITS_LIMIT, "20"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as proc:  # fmt: skip
        said = _served_at_the_limit(proc)
    lines = "".join(said)
    assert lines.count("no file descriptor left") == 1, lines
    assert "cannot accept" not in lines, lines


def _served_at_the_limit(proc: subprocess.Popen[str]) -> list[str]:
    """40 clients of the server in ``proc``: the first served close once it says it is
    out of file descriptors, and every other is served then. Its stderr's lines."""
    said: list[str] = []
    assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
    reader = threading.Thread(target=lambda: said.extend(proc.stderr), name="stderr")  # type: ignore[arg-type]
    reader.start()
    served: list[TCPStoreClient] = []
    lock = threading.Lock()
    port = int(proc.stdout.readline())

    def one() -> None:
        client = TCPStoreClient("127.0.0.1", port, timeout=60)
        client.add("n", 1)
        with lock:
            served.append(client)

    threads = [threading.Thread(target=one, name=f"client-{i}") for i in range(40)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: any("no file descriptor left" in line for line in said), timeout=30)
        # the clients it accepted are served in their turn (on a busy machine, some of
        # them only after it said so); the others wait until a served one closes
        wait_for(lambda: len(served) >= 10, timeout=30)
        with lock:
            first = list(served)
        assert len(first) < 40, len(first)
        for client in first:
            client.close()
        for t in threads:
            t.join(60)
        assert len(served) == 40
        assert served[-1].add("n", 0) == 40
    finally:
        for t in threads:
            if t.ident is not None:
                t.join(60)
        for client in served:
            client.close()  # (idempotent)
        proc.stdin.close()
        proc.wait(30)
        reader.join(10)
    return said
