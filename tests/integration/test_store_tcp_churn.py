"""TCP store under churn: a client process SIGKILLed mid-wait, many waits at once.

Regression tests of two reports: (1) with our server, a surviving client's main
connection got "Connection reset by peer" ~2 s after a peer process was
SIGKILLed with waits pending (it was the bench's teardown killing the store
host; this test pins that the server itself never hurts a survivor); (2) our
client against torch's libuv server lost wake-ups when 32 threads each set a
key and waited on a neighbour's: closing and reopening wait connections while
other requests are in flight stalls torch's server, so the client keeps its
wait connections (see ``_MAX_IDLE_WAIT_CONNECTIONS``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

_SURVIVOR = textwrap.dedent(
    """
    import sys, threading, time
    from relaunch.store.tcp import TCPStoreClient
    port, me, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    store = TCPStoreClient("127.0.0.1", port, timeout=30)
    store.set(f"up/{me}", b"")
    store.wait(["go"], timeout=60)
    errors = []
    def waiter(n):
        try:
            for i in range(1000):
                if time.monotonic() > end:
                    return
                store.set(f"w/{me}/{n}/{i}", b"x")
                store.wait([f"w/{me}/{n}/{i}"], timeout=30)
                try:
                    store.wait([f"never/{me}/{n}/{i}"], timeout=0.02)
                except TimeoutError:
                    pass
        except Exception as exc:
            errors.append(repr(exc))
    end = time.monotonic() + seconds
    threads = [threading.Thread(target=waiter, args=(n,), name=f"w{n}") for n in range(6)]
    for t in threads:
        t.start()
    i = 0
    try:
        while time.monotonic() < end:
            store.set(f"k/{me}", str(i).encode())
            assert store.get(f"k/{me}") == str(i).encode()
            assert store.add(f"n/{me}", 1) == i + 1
            store.wait([f"k/{me}"], timeout=30)
            i += 1
    except Exception as exc:
        errors.append(repr(exc))
    for t in threads:
        t.join(60)
    print("ERRORS" if errors else "OK", errors[:3], i, flush=True)
    """
)

_VICTIM = textwrap.dedent(
    """
    import sys, threading
    from relaunch.store.tcp import TCPStoreClient
    port = int(sys.argv[1])
    store = TCPStoreClient("127.0.0.1", port, timeout=30)
    def wait(n):
        store.wait([f"victim/never/{n}"], timeout=120)
    threads = [threading.Thread(target=wait, args=(n,), name=f"v{n}") for n in range(8)]
    for t in threads:
        t.start()
    store.set("up/victim", b"")
    threading.Event().wait(120)
    """
)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def test_sigkilled_peer_with_pending_waits_never_hurts_survivors() -> None:
    with TCPStoreServer() as server:
        survivors = [
            subprocess.Popen(
                [sys.executable, "-c", _SURVIVOR, str(server.port), str(i), "3"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(3)
        ]
        victim = subprocess.Popen(
            [sys.executable, "-c", _VICTIM, str(server.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs = [*survivors, victim]
        try:
            with TCPStoreClient("127.0.0.1", server.port, timeout=30) as store:
                store.wait(["up/0", "up/1", "up/2", "up/victim"], timeout=60)
                # the victim's 8 waits are registered (one on its connection, 7 on others)
                while server.connection_count < 1 + 3 + 8 and victim.poll() is None:
                    threading.Event().wait(0.01)
                store.set("go", b"")
                threading.Event().wait(0.3)  # survivors are busy, with waits pending
                victim.send_signal(signal.SIGKILL)
                assert victim.wait(30) == -signal.SIGKILL
                outputs = [p.communicate(timeout=90) for p in survivors]
                store.set("after", b"1")
                assert store.get("after") == b"1"
        finally:
            for proc in procs:
                _stop(proc)
    for proc, (out, err) in zip(survivors, outputs, strict=True):
        assert proc.returncode == 0, err[-2000:]
        assert out.startswith("OK"), out + err[-2000:]


_TORCH_SERVER = textwrap.dedent(
    """
    import datetime, sys
    import torch.distributed as dist
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=120))
    print(master.port, flush=True)
    sys.stdin.read()
    """
)


def test_many_waits_against_torch_server() -> None:
    pytest.importorskip("torch")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [sys.executable, "-c", _TORCH_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        n, rounds = 32, 10
        errors: list[str] = []
        go = threading.Barrier(n)
        with TCPStoreClient("127.0.0.1", port, timeout=60) as store:

            def body(i: int) -> None:
                go.wait(60)
                try:
                    for r in range(rounds):
                        store.set(f"k{r}/{i}", b"x")
                        store.wait([f"k{r}/{(i + 1) % n}"], timeout=20)
                except Exception as exc:
                    errors.append(f"thread {i}: {exc!r}")

            threads = [
                threading.Thread(target=body, args=(i,), name=f"test-torch-wait-{i}")
                for i in range(n)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads)
        assert not errors, errors[:3]
    finally:
        assert server.stdin is not None
        server.stdin.close()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        assert server.stdout is not None
        server.stdout.close()
