"""The TCP store server is bounded: a value over its limit is refused (the client that
sent it is dropped, no byte of it buffered), appends cannot grow past it, a 10,000-node
rendezvous state fits, and one hostile client stalls neither the others nor shutdown.
Real server, real torch clients."""

from __future__ import annotations

import datetime
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
