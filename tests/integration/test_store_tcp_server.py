"""Our TCP store server and client together: real sockets on 127.0.0.1, real threads."""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from multinode_support.waiting import wait_for
from relaunch.errors import (
    ConfigError,
    StoreClosedError,
    StoreConnectionError,
    StoreTimeoutError,
)
from relaunch.store import MemoryStore, PrefixStore, Store, has_turns, together
from relaunch.store import _tcp_wire as wire
from relaunch.store._etcd_member import is_etcd
from relaunch.store.signed import SignedStore
from relaunch.store.tcp import TCPStoreClient, TCPStoreServer


def _socket_fds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            pass
    return count


def _store_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("relaunch-tcpstore")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server() -> Iterator[TCPStoreServer]:
    sockets_before = _socket_fds()
    srv = TCPStoreServer().start()
    try:
        yield srv
    finally:
        srv.close()
    assert not _store_threads()
    assert _socket_fds() <= sockets_before


def _raw(port: int, validate: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if validate:
        sock.sendall(bytes([wire.Query.VALIDATE]) + wire.pack_u32(wire.VALIDATION_MAGIC))
    return sock


def _wait_request(*keys: str) -> bytes:
    encoded = [("/" + k).encode() for k in keys]
    return (
        bytes([wire.Query.WAIT])
        + wire.pack_u64(len(encoded))
        + b"".join(wire.pack_bytes(k) for k in encoded)
    )


def test_store_operations(server: TCPStoreServer) -> None:
    with TCPStoreClient("127.0.0.1", server.port, timeout=10) as store:
        assert isinstance(store, Store)
        assert store.get("k") is None
        store.set("k", b"v")
        assert store.get("k") == b"v"
        store.set("empty", b"")
        assert store.get("empty") == b""
        assert store.compare_set("c", None, b"1") == (b"1", True)
        assert store.compare_set("c", None, b"2") == (b"1", False)
        assert store.compare_set("c", b"1", b"2") == (b"2", True)
        assert store.compare_set("c", b"1", b"3") == (b"2", False)
        assert store.compare_set("missing", b"x", b"y") == (b"", False)
        assert store.get("missing") is None
        assert store.add("n", 3) == 3
        assert store.add("n", -5) == -2
        assert store.delete("n") is True
        assert store.delete("n") is False
        assert store.check(["k", "c"]) is True
        assert store.check(["k", "nope"]) is False
        store.multi_set({"m1": b"1", "m2": b"2"})
        assert store.multi_get(["m1", "nope", "m2"]) == [b"1", None, b"2"]
        store.append("ap", b"x")
        store.append("ap", b"y")
        assert store.get("ap") == b"xy"
        assert sorted(store.list_keys()) == ["ap", "c", "empty", "k", "m1", "m2"]
        assert store.num_keys() == 6
        big = os.urandom(3 * 1024 * 1024)
        store.set("big", big)
        assert store.get("big") == big


def test_prefix_isolates_keys(server: TCPStoreServer) -> None:
    with (
        TCPStoreClient("127.0.0.1", server.port, prefix="a") as a,
        TCPStoreClient("127.0.0.1", server.port, prefix="b") as b,
        TCPStoreClient("127.0.0.1", server.port) as root,
    ):
        a.set("k", b"from a")
        b.set("k", b"from b")
        assert a.get("k") == b"from a"
        assert root.get("a/k") == b"from a"
        assert b.list_keys() == ["k"]
        assert a.prefix == "a"


def test_wait_timeout_keeps_the_client_usable(server: TCPStoreServer) -> None:
    with TCPStoreClient("127.0.0.1", server.port, timeout=10) as store:
        with pytest.raises(StoreTimeoutError, match="timed out"):
            store.wait(["never"], timeout=0.1)
        with pytest.raises(StoreTimeoutError):
            store.wait(["never"], timeout=0)
        store.set("now", b"1")
        store.wait(["now"], timeout=5)
        store.wait([], timeout=5)
        assert store.get("now") == b"1"


def test_wait_is_released_by_another_client(server: TCPStoreServer) -> None:
    with (
        TCPStoreClient("127.0.0.1", server.port, timeout=10) as waiter,
        TCPStoreClient("127.0.0.1", server.port, timeout=10) as writer,
    ):
        done = threading.Event()
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                waiter.wait(["x", "y"], timeout=30)
                done.set()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=wait, name="test-waiter")
        thread.start()
        writer.set("x", b"1")
        # the same client stays usable for other calls while its wait blocks
        assert waiter.get("x") == b"1"
        assert not done.is_set()
        writer.add("y", 1)
        thread.join(30)
        assert not thread.is_alive() and done.is_set() and not errors


def test_client_threads_share_one_client(server: TCPStoreServer) -> None:
    with TCPStoreClient("127.0.0.1", server.port, timeout=30) as store:

        def work() -> None:
            for _ in range(200):
                store.add("sum", 1)
                store.set("last", b"x")

        threads = [threading.Thread(target=work, name=f"test-adder-{i}") for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert store.add("sum", 0) == 1600


def test_client_waits_for_a_late_server(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="relaunch.store")
    port = _free_port()
    result: list[object] = []

    def connect() -> None:
        try:
            client = TCPStoreClient("127.0.0.1", port, timeout=30)
            result.append(client.get("late"))
            client.close()
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=connect, name="test-late-client")
    thread.start()
    # the client tried while no server listened (and goes on trying)
    wait_for(lambda: "not reachable yet" in caplog.text, 30, what="a failed connect attempt")
    assert result == []
    with TCPStoreServer(port=port) as srv:
        with TCPStoreClient("127.0.0.1", srv.port) as store:
            store.set("late", b"ok")
        thread.join(30)
    assert result == [b"ok"]


def test_connect_timeout_names_the_address() -> None:
    port = _free_port()
    with pytest.raises(StoreConnectionError, match=f"127.0.0.1:{port}"):
        TCPStoreClient("127.0.0.1", port, timeout=0.3)


def test_bind_failure_names_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = TCPStoreServer(port=port)
        with pytest.raises(StoreConnectionError, match=f"127.0.0.1:{port}"):
            server.start()
        server.close()


@pytest.mark.parametrize("fails", ["socketpair", "thread"])
def test_a_start_that_fails_after_listening_leaves_no_socket_open(
    fails: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # out of file descriptors for the wake pair, or out of threads ("can't start new
    # thread", as at thousands of simulated nodes): one clear error and nothing left
    # open; before, the listen socket stayed open until close() and the error was a
    # bare OSError or RuntimeError
    def refuse(*args: object, **kwargs: object) -> None:
        raise (OSError(24, "Too many open files") if fails == "socketpair"
               else RuntimeError("can't start new thread"))  # fmt: skip

    before = _socket_fds()
    server = TCPStoreServer(host="127.0.0.1", port=0)
    with monkeypatch.context() as patch:
        if fails == "socketpair":
            patch.setattr(socket, "socketpair", refuse)
        else:
            patch.setattr(threading.Thread, "start", refuse)
        with pytest.raises(StoreConnectionError, match="cannot start the TCP store server"):
            server.start()
    assert _socket_fds() == before
    server.close()


def test_given_listen_socket_is_used_and_closed() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    with TCPStoreServer(listen_socket=sock) as srv:
        assert srv.port == port
        with TCPStoreClient("127.0.0.1", port) as store:
            store.set("k", b"v")
    assert sock.fileno() == -1


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [({"port": -1}, "port"), ({"port": 70000}, "port"), ({"host": ""}, "host")],
)
def test_server_config_errors(kwargs: dict[str, object], bad: str) -> None:
    with pytest.raises(ConfigError, match=bad):
        TCPStoreServer(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"prefix": 3}, "prefix"),
    ],
)
def test_client_config_errors(kwargs: dict[str, object], bad: str) -> None:
    with pytest.raises(ConfigError, match=bad):
        TCPStoreClient("127.0.0.1", 1, **kwargs)  # type: ignore[arg-type]


def _assert_dropped(sock: socket.socket) -> None:
    sock.settimeout(10)
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(100) == b""
    sock.close()


def test_garbage_drops_only_that_connection(
    server: TCPStoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="relaunch.store._tcp_server")
    with TCPStoreClient("127.0.0.1", server.port, timeout=10) as good:
        good.set("k", b"v")
        no_validate = _raw(server.port, validate=False)
        no_validate.sendall(b"\x63 / HTTP/1.1\r\n\r\n")
        _assert_dropped(no_validate)
        unknown = _raw(server.port)
        unknown.sendall(bytes([200, 1, 2, 3]))
        _assert_dropped(unknown)
        absurd = _raw(server.port)
        absurd.sendall(bytes([wire.Query.SET]) + wire.pack_u64(2**62))
        _assert_dropped(absurd)
        not_int = _raw(server.port)
        not_int.sendall(bytes([wire.Query.ADD]) + wire.pack_bytes(b"/k") + wire.pack_i64(1))
        _assert_dropped(not_int)
        noise = _raw(server.port)
        noise.sendall(os.urandom(4096))
        _assert_dropped(noise)
        assert good.get("k") == b"v"
        good.set("k2", b"v2")
        assert good.get("k2") == b"v2"
    assert "drops client" in caplog.text


def test_an_http_request_is_answered_400_and_dropped_without_a_warning(
    server: TCPStoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    """``relaunch status`` asks a c10d endpoint for etcd's ``/version`` (is it an
    embedded store's member?): a TCP store's host logged a warning for each, and one
    per redraw of ``relaunch status --watch``. A browser or curl pointed at the port
    learns what listens there."""
    caplog.set_level(logging.DEBUG, logger="relaunch.store")
    url = f"http://127.0.0.1:{server.port}/version"
    assert not is_etcd(f"http://127.0.0.1:{server.port}", timeout=10)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(url, timeout=10)
    assert caught.value.code == 400
    assert b"TCP store" in caught.value.read()
    for first, rest in (
        (b"G", b"ET /x HTTP/1.0\r\n\r\n"),
        (b"PO", b"ST /v3/kv/range HTTP/1.1\r\n"),
    ):
        sock = _raw(server.port, validate=False)
        sock.sendall(first)  # too short to tell: the server waits for more
        sock.settimeout(0.2)
        with pytest.raises(TimeoutError):
            sock.recv(100)
        sock.settimeout(10)
        sock.sendall(rest)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
        sock.close()
        assert reply.startswith(b"HTTP/1.1 400 Bad Request\r\n"), reply
    with TCPStoreClient("127.0.0.1", server.port, timeout=10) as store:
        store.set("k", b"v")
        assert store.get("k") == b"v"
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warned, [r.getMessage() for r in warned]
    assert "sent an HTTP request" in caplog.text


def test_a_thousand_clients_wait_on_one_key(server: TCPStoreServer) -> None:
    clients = [_raw(server.port) for _ in range(1000)]
    try:
        for sock in clients:
            sock.sendall(_wait_request("go", "also"))
        with TCPStoreClient("127.0.0.1", server.port, timeout=30) as store:
            store.set("also", b"")
            assert store.num_keys() == 1
            store.set("go", b"1")
            released = 0
            with selectors.DefaultSelector() as sel:
                for sock in clients:
                    sel.register(sock, selectors.EVENT_READ)
                while released < len(clients):
                    events = sel.select(timeout=30)
                    assert events, f"only {released} of {len(clients)} waiters released"
                    for key, _ in events:
                        assert key.fileobj.recv(1) == bytes([wire.WaitResponse.STOP_WAITING])  # type: ignore[union-attr]
                        sel.unregister(key.fileobj)
                        released += 1
            assert server.connection_count == len(clients) + 1
    finally:
        for sock in clients:
            sock.close()


def test_close_with_connected_clients_leaves_nothing() -> None:
    sockets_before = _socket_fds()
    server = TCPStoreServer().start()
    client = TCPStoreClient("127.0.0.1", server.port, timeout=5)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.wait(["never"], timeout=60)
        except BaseException as exc:
            errors.append(exc)

    client.set("k", b"v")
    client.wait(["k"], timeout=10)  # (a wait goes on the client's one connection)
    thread = threading.Thread(target=wait, name="test-blocked-waiter")
    thread.start()
    raw = [_raw(server.port) for _ in range(20)]
    server.close()
    server.close()
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], StoreConnectionError)
    assert not _store_threads()
    with pytest.raises(StoreConnectionError):
        client.get("k")
    client.close()
    client.close()
    with pytest.raises(StoreClosedError):
        client.get("k")
    for sock in raw:
        _assert_dropped(sock)
    assert _socket_fds() <= sockets_before
    with pytest.raises(StoreClosedError):
        server.start()


def test_server_on_all_interfaces() -> None:
    with (
        TCPStoreServer(host="0.0.0.0") as srv,
        TCPStoreClient("127.0.0.1", srv.port, timeout=10) as store,
    ):
        assert srv.host == "0.0.0.0"
        store.set("k", b"v")
        assert store.get("k") == b"v"


def test_an_internal_error_costs_one_connection(
    server: TCPStoreServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from relaunch.store import _tcp_handlers

    real_handle = _tcp_handlers.handle

    def buggy(state: object, client: object, query: int, reader: wire.Reader) -> object:
        if query == wire.Query.DELETE_KEY:
            raise RuntimeError("injected bug")
        return real_handle(state, client, query, reader)  # type: ignore[arg-type]

    monkeypatch.setattr(_tcp_handlers, "handle", buggy)
    caplog.set_level(logging.ERROR, logger="relaunch.store._tcp_server")
    with (
        TCPStoreClient("127.0.0.1", server.port, timeout=10) as victim,
        TCPStoreClient("127.0.0.1", server.port, timeout=10) as bystander,
    ):
        bystander.set("k", b"v")
        with pytest.raises(StoreConnectionError):
            victim.delete("k")
        assert bystander.get("k") == b"v"
        assert victim.get("k") == b"v"  # reconnects
    assert "injected bug" in caplog.text


def test_killed_waiting_client_is_forgotten(server: TCPStoreServer) -> None:
    code = (
        "import sys\n"
        "from relaunch.store.tcp import TCPStoreClient\n"
        f"c = TCPStoreClient('127.0.0.1', {server.port}, timeout=30)\n"
        "c.set('ready', b'')\n"
        "import threading\n"
        "threading.Thread(target=c.wait, args=(['never'], 60), daemon=True).start()\n"
        "c.wait(['never'], timeout=60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        with TCPStoreClient("127.0.0.1", server.port, timeout=30) as store:
            store.wait(["ready"], timeout=60)
            # ours; the child's: one wait on its connection, the other on a second one
            while server.connection_count < 3 and proc.poll() is None:
                threading.Event().wait(0.01)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
            while server.connection_count > 1:
                threading.Event().wait(0.01)
            store.set("never", b"")  # releases nobody; the dead waiter is gone
            assert store.get("never") == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_public_names_and_no_torch_import() -> None:
    from relaunch.store import tcp

    assert sorted(tcp.__all__) == ["TCPStoreClient", "TCPStoreServer"]
    code = "import sys, relaunch.store.tcp; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


def test_concurrent_waits_of_one_client(server: TCPStoreServer) -> None:
    with TCPStoreClient("127.0.0.1", server.port, timeout=30) as store:
        errors: list[BaseException] = []

        def wait(i: int) -> None:
            try:
                store.wait([f"key{i}", "all"], timeout=60)
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=wait, args=(i,), name=f"test-wait-{i}") for i in range(16)
        ]
        for thread in threads:
            thread.start()
        store.multi_set({f"key{i}": b"" for i in range(16)})
        # one wait is in flight on the client's connection, every other one on its own
        while server.connection_count < 16:
            threading.Event().wait(0.01)
        store.set("all", b"")
        for thread in threads:
            thread.join(60)
        assert not errors and not any(t.is_alive() for t in threads)
        # idle wait connections are kept for reuse (closing them stalls torch's
        # server): with a wait parked on the client's connection, a second wait takes
        # an idle one and opens no new connection
        assert server.connection_count == 16
        parked = threading.Thread(target=store.wait, args=(["later"], 60), name="test-parked")
        parked.start()
        wait_for(lambda: server.waiter_count == 1, timeout=30, what="the parked wait")
        store.wait([f"key{i}" for i in range(16)], timeout=60)
        assert server.connection_count == 16
        store.set("later", b"")
        parked.join(60)
        assert not parked.is_alive()


def _parked_wait(
    server: TCPStoreServer, node: TCPStoreClient, key: str
) -> tuple[threading.Thread, list[object]]:
    """A thread waiting for ``key`` on ``node``'s one connection, parked at the server;
    its outcome ("set", or what it raised) lands in the list."""
    outcome: list[object] = []

    def wait() -> None:
        try:
            node.wait([key], timeout=60)
            outcome.append("set")
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait, name="test-parked-wait")
    thread.start()
    wait_for(lambda: server.waiter_count == 1, timeout=30, what="the parked wait")
    return thread, outcome


def test_calls_cut_into_a_wait_on_the_client_s_one_connection(server: TCPStoreServer) -> None:
    with (
        TCPStoreClient("127.0.0.1", server.port, timeout=10) as node,
        TCPStoreClient("127.0.0.1", server.port, timeout=10) as writer,
    ):
        thread, outcome = _parked_wait(server, node, "x")
        for i in range(100):  # a node's heartbeats and reads while its wait is parked
            node.set("beat", str(i).encode())
            assert node.add("beats", 1) == i + 1
            assert node.get("beat") == str(i).encode()
        assert server.connection_count == 2  # one connection per client, the wait's too
        assert thread.is_alive() and not outcome
        writer.set("x", b"")
        thread.join(30)
        assert not thread.is_alive() and outcome == ["set"]

        stop = threading.Event()
        failed: list[BaseException] = []

        def calls() -> None:
            try:
                while not stop.is_set():
                    node.add("busy", 1)
            except BaseException as exc:
                failed.append(exc)

        busy = threading.Thread(target=calls, name="test-busy-calls")
        busy.start()
        try:  # a wait cut into again and again still ends at its timeout, then is usable
            with pytest.raises(StoreTimeoutError):
                node.wait(["never"], timeout=0.3)
            writer.set("y", b"")
            node.wait(["y"], timeout=float("inf"))  # (no socket takes an infinite timeout)
            with pytest.raises(ConfigError, match="non-negative number"):
                node.wait(["y"], timeout=float("nan"))
        finally:
            stop.set()
            busy.join(30)
        assert not failed and server.connection_count == 2


def test_calls_made_together_cut_into_a_parked_wait_once(server: TCPStoreServer) -> None:
    with (
        TCPStoreClient("127.0.0.1", server.port, timeout=10) as node,
        TCPStoreClient("127.0.0.1", server.port, timeout=10) as writer,
    ):
        thread, outcome = _parked_wait(server, node, "x")
        with node.together():  # a heartbeat's calls: the wait is cancelled once
            node.set("beat", b"1")
            assert server.waiter_count == 0
            writer.set("x", b"")  # the wait, not parked again inside, cannot see it
            with node.together():  # (nested: the outer run holds the turn)
                assert node.add("beats", 1) == 1
            thread.join(0.5)
            assert thread.is_alive() and not outcome
            assert node.get("beat") == b"1"
            node.wait(["x"], timeout=10)  # a wait inside takes a connection of its own
        thread.join(30)  # parked again after the run: its key is set
        assert not thread.is_alive() and outcome == ["set"]
        with pytest.raises(StoreTimeoutError), node.together():
            node.wait(["never"], timeout=0.1)
        assert node.get("beat") == b"1"  # the turn was given back
        views = [PrefixStore(node, "p/"), SignedStore.over(node, b"s" * 32)]
        assert has_turns(node) and all(has_turns(view) for view in views)
        assert not has_turns(MemoryStore())
        for view in views:  # a view's run of calls is its store's
            with together(view):
                view.set("k", b"v")
                with node.together():
                    assert view.get("k") == b"v"


def test_close_ends_a_parked_wait(server: TCPStoreServer) -> None:
    node = TCPStoreClient("127.0.0.1", server.port, timeout=10)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            node.wait(["never"], timeout=60)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait, name="test-wait-closed")
    thread.start()
    wait_for(lambda: server.waiter_count == 1, timeout=30, what="the parked wait")
    node.set("k", b"v")  # (cuts in: the wait is parked again)
    wait_for(lambda: server.waiter_count == 1, timeout=30, what="the wait parked again")
    node.close()
    thread.join(30)
    assert not thread.is_alive() and len(errors) == 1
    assert isinstance(errors[0], StoreClosedError)
    with pytest.raises(StoreClosedError):
        node.get("k")


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        assert chunk, "the server closed the connection"
        data += chunk
    return bytes(data)


def test_a_large_value_read_by_many_slow_clients_is_held_once(server: TCPStoreServer) -> None:
    """Twenty clients pipeline ten GETs of a 2 MB value each (with a PING between two
    GETs) and read nothing for a while: the replies wait in the server, which holds the
    value once (copied per reply, they would take 400 MB); then every byte arrives, in
    order."""
    import tracemalloc

    value = os.urandom(2 << 20)
    with TCPStoreClient("127.0.0.1", server.port, timeout=10) as store:
        store.set("big", value)
    get = bytes([wire.Query.GET]) + wire.pack_bytes(b"/big")
    ping = bytes([wire.Query.PING]) + wire.pack_u32(7)
    socks = [_raw(server.port) for _ in range(20)]
    tracemalloc.start()
    try:
        for sock in socks:
            sock.sendall((get + ping) * 10)
        threading.Event().wait(1.0)  # the server queues what the sockets do not take
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        assert peak < 64 << 20, f"the server copied the value per reply: peak {peak >> 20} MiB"
        for sock in socks:
            for _ in range(10):
                assert _read_exactly(sock, 8) == wire.pack_u64(len(value))
                assert _read_exactly(sock, len(value)) == value
                assert _read_exactly(sock, 4) == wire.pack_u32(7)
    finally:
        for sock in socks:
            sock.close()


class _SplittingProxy:
    """Between one client and the server: passes the bytes both ways, except that once
    armed (``head``, ``reply``) it passes the ``head`` bytes of the client's next request
    and holds the rest until :meth:`release` (a request that reaches the server in two
    pieces); ``answered`` is set once ``reply`` bytes came back for that head."""

    def __init__(self, server_port: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._server_port = server_port
        self._lock = threading.Lock()
        self._head: int | None = None
        self._held = bytearray()
        self._reply = 0
        self.answered = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, name="test-proxy")]
        self._threads[0].start()

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self._server_port), timeout=10)
        self._socks += [client, upstream]
        for name, target in (("up", self._up), ("down", self._down)):
            t = threading.Thread(target=target, args=(client, upstream), name=f"test-proxy-{name}")
            self._threads.append(t)
            t.start()

    def _up(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                with self._lock:
                    if self._head is not None:  # (the whole request comes in one piece here)
                        upstream.sendall(data[: self._head])
                        self._held += data[self._head :]
                        self._head = 0
                        continue
                    if self._held:  # (held: what follows waits behind it)
                        self._held += data
                        continue
                upstream.sendall(data)

    def _down(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                client.sendall(data)
                with self._lock:
                    self._reply -= len(data)
                    if self._reply <= 0 and self._head == 0:
                        self.answered.set()

    def arm(self, head: int, reply: int) -> None:
        with self._lock:
            self._head, self._reply = head, reply

    def release(self) -> None:
        with self._lock:
            self._head = None
            held, self._held = bytes(self._held), bytearray()
            self._socks[1].sendall(held)

    def close(self) -> None:
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for t in self._threads:
            t.join(10)


def test_a_compare_and_set_that_another_write_cut_into_is_not_written(
    server: TCPStoreServer,
) -> None:
    """The server runs each command once it has it whole: a compare-and-set that comes
    in two pieces (a big state's) can have another client's write run between its GET
    and its COMPARE_SET, which then fails. It says so (it said written: the rendezvous
    published a round, or acked joins, that the state never held)."""
    proxy = _SplittingProxy(server.port)
    mine = TCPStoreClient("127.0.0.1", proxy.port, timeout=10)
    other = TCPStoreClient("127.0.0.1", server.port, timeout=10)
    try:
        mine.set("state", b"old")
        key = b"/state"
        head = bytes([wire.Query.CHECK]) + wire.pack_u64(1) + wire.pack_bytes(key)
        head += bytes([wire.Query.GET]) + wire.pack_bytes(key)
        proxy.arm(len(head), reply=1 + 8 + len(b"old"))  # CHECK's answer, GET's
        with ThreadPoolExecutor(1, thread_name_prefix="test-cas") as pool:
            cas = pool.submit(mine.compare_set, "state", b"old", b"mine")
            assert proxy.answered.wait(10)  # its CHECK and GET ran
            assert other.compare_set("state", b"old", b"other") == (b"other", True)
            proxy.release()
            assert cas.result(timeout=10) == (b"other", False)
        assert other.get("state") == b"other"
    finally:
        mine.close()
        other.close()
        proxy.close()
