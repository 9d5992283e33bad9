"""Compatibility with the real torch 2.13 TCPStore client and server.

Some torch client calls (list_keys, queue_*, barrier) keep the GIL while they
block, so they cannot talk to a Python server in the same process: they run in
a subprocess here, as workers do.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

from relaunch.store import _tcp_wire as wire
from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

dist = pytest.importorskip("torch.distributed")

_SUBPROCESS_TIMEOUT = 90


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    with TCPStoreServer() as srv:
        yield srv
    assert not [t for t in threading.enumerate() if t.name.startswith("relaunch-tcpstore")]


def _torch_client(port: int, timeout: float = 30) -> object:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
    )


def _run_python(code: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=_SUBPROCESS_TIMEOUT,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_torch_client_in_process(server: TCPStoreServer) -> None:
    store = _torch_client(server.port, timeout=10)
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 5) == 5
    assert store.add("n", 2) == 7
    assert store.compare_set("a", b"1", b"2") == b"2"
    assert store.compare_set("a", b"x", b"3") == b"2"
    assert store.compare_set("fresh", b"", b"f") == b"f"
    assert store.check(["a", "fresh"]) is True
    assert store.check(["a", "nope"]) is False
    store.wait(["a"])
    store.wait(["a", "n"], datetime.timedelta(seconds=5))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.wait(["never"], datetime.timedelta(milliseconds=100))
    assert store.get("a") == b"2"  # still usable after a timed-out wait
    assert store.num_keys() == 3
    assert store.delete_key("fresh") is True
    assert store.delete_key("fresh") is False
    store.multi_set(["m1", "m2"], [b"x", b"y"])
    assert store.multi_get(["m1", "m2"]) == [b"x", b"y"]
    store.append("ap", b"x")
    store.append("ap", b"y")
    assert store.get("ap") == b"xy"
    # a blocking get is released by a later set from another torch client
    timer = threading.Timer(0.2, lambda: _torch_client(server.port).set("late", b"L"))
    timer.start()
    assert store.get("late") == b"L"
    timer.join(30)
    # garbage on another connection does not disturb this client
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as garbage:
        garbage.sendall(bytes([wire.Query.VALIDATE]) + wire.pack_u32(wire.VALIDATION_MAGIC))
        garbage.sendall(os.urandom(2048))
        garbage.recv(1 << 16)
    assert store.get("a") == b"2"
    del store


def test_our_client_and_torch_client_share_keys(server: TCPStoreServer) -> None:
    torch_store = _torch_client(server.port)
    torch_prefixed = dist.PrefixStore("job", torch_store)
    with (
        TCPStoreClient("127.0.0.1", server.port) as ours,
        TCPStoreClient("127.0.0.1", server.port, prefix="job") as ours_prefixed,
    ):
        torch_store.set("t", b"from torch")
        assert ours.get("t") == b"from torch"
        ours.set("o", b"from us")
        assert torch_store.get("o") == b"from us"
        torch_prefixed.set("k", b"pk")
        assert ours_prefixed.get("k") == b"pk"
        assert ours.get("job/k") == b"pk"
        ours_prefixed.add("count", 2)
        assert torch_prefixed.add("count", 3) == 5
        assert ours_prefixed.compare_set("count", b"5", b"ten") == (b"ten", True)
        assert torch_prefixed.get("count") == b"ten"
        assert torch_store.check(["o", "job/count"]) is True

        # our wait is released by a torch write, and a torch wait by ours
        thread = threading.Thread(
            target=lambda: ours.wait(["from_torch"], timeout=30), name="test-ours-wait"
        )
        thread.start()
        torch_store.set("from_torch", b"")
        thread.join(30)
        assert not thread.is_alive()
        thread = threading.Thread(
            target=lambda: torch_store.wait(["from_us"], datetime.timedelta(seconds=30)),
            name="test-torch-wait",
        )
        thread.start()
        ours.set("from_us", b"")
        thread.join(30)
        assert not thread.is_alive()


def test_torch_client_in_subprocess(server: TCPStoreServer) -> None:
    out = _run_python(
        f"""
        import datetime, json, threading
        import torch.distributed as dist
        t = datetime.timedelta(seconds=30)
        s = dist.TCPStore("127.0.0.1", {server.port}, is_master=False, timeout=t)
        s2 = dist.TCPStore("127.0.0.1", {server.port}, is_master=False, timeout=t)
        r = {{}}
        s.set("k1", b"v"); s.set("k2", b"v")
        r["keys"] = sorted(s.list_keys())
        s.queue_push("q", b"one"); s.queue_push("q", b"two")
        r["qlen"] = s.queue_len("q")
        r["pop"] = [s.queue_pop("q").decode(), s.queue_pop("q").decode()]
        try:
            s.queue_pop("q", block=False)
        except dist.QueueEmptyError:
            r["empty"] = True
        th = threading.Thread(target=lambda: r.setdefault("blocking", s2.queue_pop("q2").decode()))
        th.start(); s.queue_push("q2", b"late"); th.join(30)
        th = threading.Thread(target=lambda: s2.barrier("b", 2, t))
        th.start(); s.barrier("b", 2, t); th.join(30)
        r["barrier"] = not th.is_alive()
        try:
            s.barrier("lonely", 2, datetime.timedelta(milliseconds=100))
        except dist.DistStoreError:
            r["barrier_timeout"] = True
        r["after"] = s.get("k1").decode()
        print(json.dumps(r))
        """
    )
    assert json.loads(out.strip().splitlines()[-1]) == {
        "keys": ["k1", "k2"],
        "qlen": 2,
        "pop": ["one", "two"],
        "empty": True,
        "blocking": "late",
        "barrier": True,
        "barrier_timeout": True,
        "after": "v",
    }


_WORKER = """
import datetime, os
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item()}")
dist.destroy_process_group()
"""


def test_init_process_group_on_the_agent_store(server: TCPStoreServer) -> None:
    world = 4
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(server.port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RESTART_COUNT="0",
                GLOO_SOCKET_IFNAME="lo",
                OMP_NUM_THREADS="1",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _WORKER],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outputs = [proc.communicate(timeout=_SUBPROCESS_TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
        assert "sum=10.0" in out and f"world={world}" in out
    with TCPStoreClient("127.0.0.1", server.port) as ours:
        assert ours.list_keys(), "the workers wrote their keys into our store"


def test_our_client_against_torch_server() -> None:
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(30)
    )
    with TCPStoreClient("127.0.0.1", master.port, timeout=10) as store:
        assert store.get("k") is None
        store.set("k", b"v")
        assert master.get("k") == b"v"
        assert store.compare_set("c", None, b"1") == (b"1", True)
        assert store.compare_set("c", None, b"2") == (b"1", False)
        assert store.compare_set("c", b"1", b"2") == (b"2", True)
        assert store.compare_set("missing", b"x", b"y") == (b"", False)
        assert store.add("n", 4) == 4
        assert master.add("n", 1) == 5
        assert store.delete("n") is True
        store.multi_set({"a": b"1", "b": b"2"})
        assert store.multi_get(["a", "zz", "b"]) == [b"1", None, b"2"]
        store.append("a", b"+")
        assert store.check(["a", "b"]) is True
        assert sorted(store.list_keys()) == ["a", "b", "c", "k"]
        with pytest.raises(TimeoutError):
            store.wait(["never"], timeout=0.1)
        thread = threading.Thread(
            target=lambda: store.wait(["later"], timeout=30), name="test-wait-torch-server"
        )
        thread.start()
        for i in range(20):  # calls cut into the parked wait: cancelled and sent again
            store.set("beat", str(i).encode())
            assert store.get("beat") == str(i).encode()
        assert thread.is_alive()
        master.set("later", b"")
        thread.join(30)
        assert not thread.is_alive()
        assert store.get("a") == b"1+"
    del master
