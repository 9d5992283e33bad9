"""A pure-Python server of torch's TCPStore protocol: one thread, one selector.

The relaunch agent hosts the store its workers connect to with
``torch.distributed.TCPStore(MASTER_ADDR, MASTER_PORT, is_master=False)``
without importing torch. The same server is the store of the ``c10d``
rendezvous backend.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading

from relaunch.errors import ConfigError, StoreClosedError, StoreConnectionError
from relaunch.store import _tcp_handlers as handlers
from relaunch.store import _tcp_wire as wire
from relaunch.store._tcp_accept import Acceptor
from relaunch.store._tcp_conn import resolve_host
from relaunch.store._tcp_handlers import Client
from relaunch.store._tcp_peer import Peer
from relaunch.store._tcp_state import StoreState

__all__ = ["TCPStoreServer"]

log = logging.getLogger(__name__)

_RECV_SIZE = 256 * 1024
_DRAIN = 4 * 1024 * 1024  # read from one client at most per turn (see _on_readable)
_HIGH_WATER = 16 * 1024 * 1024  # stop reading a client whose replies pile up past this
_BACKLOG = 4096
_JOIN_TIMEOUT = 10.0


class TCPStoreServer:
    """Serves torch's TCPStore protocol (torch 2.13 clients) from one daemon thread.

    ``listen_socket``, when given, is a bound (possibly listening) socket the
    server takes over (``host`` and ``port`` then come from it); it is closed by
    :meth:`close`. Otherwise :meth:`start` binds ``host:port`` (port 0 picks a
    free port; read it from :attr:`port`). ``host`` is a numeric address; a name
    is resolved once, here.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        listen_socket: socket.socket | None = None,
        max_value_bytes: int = wire.MAX_VALUE_LEN,
        allowed: frozenset[str] | None = None,
    ) -> None:
        if not isinstance(host, str) or not host:
            raise ConfigError(f"host: expected a non-empty address string, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"port: expected an integer in [0, 65535], got {port!r}")
        if (
            isinstance(max_value_bytes, bool)
            or not isinstance(max_value_bytes, int)
            or not (1024 <= max_value_bytes <= 2**40)
        ):
            raise ConfigError(
                f"max_value_bytes: expected an integer from 1024 to 2**40, got {max_value_bytes!r}"
            )
        self._max_value = max_value_bytes
        self._allowed = allowed
        """Client IP addresses admitted (loopback always); None: every address."""
        self._acceptor: Acceptor | None = None
        if listen_socket is not None and listen_socket.type != socket.SOCK_STREAM:
            raise ConfigError("listen_socket: expected a bound SOCK_STREAM socket")
        self._host = host
        self._port = port
        self._listen = listen_socket
        self._family, self._addr = (
            (socket.AddressFamily(listen_socket.family), host)
            if listen_socket is not None
            else resolve_host(host, port)
        )
        if listen_socket is not None:
            bound = listen_socket.getsockname()
            self._host, self._port = str(bound[0]), int(bound[1])
        self._state: StoreState[Client] = StoreState(max_value=max_value_bytes)
        self._conns: set[Peer] = set()
        self._dirty: set[Peer] = set()
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ public

    @property
    def host(self) -> str:
        """The address the server listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The port the server listens on (the chosen one after :meth:`start` with port 0)."""
        return self._port

    @property
    def connection_count(self) -> int:
        """Number of client connections open now (approximate: read without a lock)."""
        return len(self._conns)

    @property
    def waiter_count(self) -> int:
        """Number of clients blocked in a wait or barrier now (approximate, as above)."""
        return self._state.waiter_count()

    def start(self) -> TCPStoreServer:
        """Bind (unless given a socket), listen and start serving. Idempotent.

        Raises :class:`relaunch.errors.StoreConnectionError` when the address cannot
        be bound, :class:`relaunch.errors.StoreClosedError` after :meth:`close`.
        """
        with self._lock:
            if self._closed:
                raise StoreClosedError("the TCP store server was closed")
            if self._thread is not None:
                return self
            listen = self._listen if self._listen is not None else self._bind()
            try:
                listen.listen(_BACKLOG)
                listen.setblocking(False)
            except OSError as exc:
                listen.close()
                raise StoreConnectionError(
                    f"cannot listen on {self._host}:{self._port}: {exc}"
                ) from exc
            self._listen = listen
            self._port = int(listen.getsockname()[1])
            try:
                self._start_loop(listen)
            except (OSError, RuntimeError) as exc:  # no file descriptor, no thread left
                self._unwind()
                raise StoreConnectionError(
                    f"cannot start the TCP store server on {self._host}:{self._port}: {exc}"
                ) from exc
            log.debug("TCP store server listening on %s:%s", self._host, self._port)
        return self

    def _start_loop(self, listen: socket.socket) -> None:
        """The wake pair, the selector and the thread (the lock held)."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._acceptor = Acceptor(listen, self._selector, self._allowed)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        thread = threading.Thread(
            target=self._run, name=f"relaunch-tcpstore-{self._port}", daemon=True
        )
        thread.start()
        self._thread = thread

    def _unwind(self) -> None:
        """Close what a start that failed had made: no socket is left open."""
        for closeable in (self._selector, self._wake_r, self._wake_w, self._listen):
            if closeable is not None:
                closeable.close()
        self._selector = self._wake_r = self._wake_w = self._listen = None

    def close(self) -> None:
        """Stop serving, close every socket and join the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            if self._listen is not None:
                self._listen.close()
            return
        assert self._wake_w is not None
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        thread.join(_JOIN_TIMEOUT)
        if thread.is_alive():
            log.error("TCP store server thread did not stop within %ss", _JOIN_TIMEOUT)
            return
        self._wake_w.close()

    def __enter__(self) -> TCPStoreServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TCPStoreServer(host={self._host!r}, port={self._port})"

    # ------------------------------------------------------------- event loop

    def _bind(self) -> socket.socket:
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._family == socket.AF_INET6:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((self._addr, self._port))
        except OSError as exc:
            sock.close()
            raise StoreConnectionError(
                f"cannot bind the TCP store server to {self._host}:{self._port}: {exc}"
            ) from exc
        return sock

    def _run(self) -> None:
        selector, acceptor = self._selector, self._acceptor
        assert selector is not None and acceptor is not None
        try:
            while True:
                for key, mask in selector.select(acceptor.timeout()):
                    data = key.data
                    if isinstance(data, Peer):
                        self._serve(data, mask)
                    elif data == "listen":
                        self._accept(acceptor)
                    else:
                        return
                acceptor.tick()
                while self._dirty:
                    conn = self._dirty.pop()
                    self._serve(conn, selectors.EVENT_WRITE)
        except Exception:
            log.exception("TCP store server loop failed; closing it")
        finally:
            self._shutdown()

    def _serve(self, conn: Peer, mask: int) -> None:
        if conn.closed:
            return
        try:
            if mask & selectors.EVENT_READ:
                self._on_readable(conn)
            if mask & selectors.EVENT_WRITE and not conn.closed:
                self._flush(conn)
        except Exception as exc:  # a bug must cost one connection, never the server
            log.exception("TCP store server failed serving client %s", conn.addr)
            self._drop(conn, f"internal error: {exc!r}")

    def _shutdown(self) -> None:
        assert self._selector is not None
        for conn in list(self._conns):
            self._drop(conn, None)
        self._selector.close()
        for sock in (self._listen, self._wake_r):
            if sock is not None:
                sock.close()

    def _accept(self, acceptor: Acceptor) -> None:
        assert self._selector is not None
        for sock, addr in acceptor.accept(len(self._conns)):
            conn = Peer(sock, addr)
            self._conns.add(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: Peer, reason: str | None) -> None:
        if conn.closed:
            return
        if reason is not None:
            log.warning("TCP store server drops client %s: %s", conn.addr, reason)
        else:
            log.debug("TCP store client %s disconnected", conn.addr)
        conn.closed = True
        self._state.cancel(conn)
        self._conns.discard(conn)
        self._dirty.discard(conn)
        assert self._selector is not None and self._acceptor is not None
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
        self._acceptor.freed()

    def _on_readable(self, conn: Peer) -> None:
        try:
            data = conn.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except (ConnectionResetError, BrokenPipeError):  # a killed client: routine
            self._drop(conn, None)
            return
        except OSError as exc:
            self._drop(conn, f"receive failed: {exc}")
            return
        if not data:
            self._drop(conn, None)
            return
        conn.rbuf += data
        # A big request (16,384 nodes: the state's compare-and-set, 860 KB; a batch's
        # heartbeats, 1 MB) read a chunk per turn waited a turn over every ready client
        # per chunk (16,384 of them), and was parsed again from its start at each.
        while len(data) == _RECV_SIZE and len(conn.rbuf) < _DRAIN:  # more may be there
            try:
                data = conn.sock.recv(_RECV_SIZE)
            except OSError:  # (no more now, or an error the next turn meets again)
                break
            conn.rbuf += data
        self._process(conn)

    def _process(self, conn: Peer) -> None:
        consumed = 0
        reason: str | None = None
        http = False
        with memoryview(conn.rbuf) as view:
            reader = wire.Reader(view, max_value=self._max_value)
            while consumed < len(view) and conn.pending < _HIGH_WATER:
                reader.pos = consumed
                try:
                    self._handle_one(conn, reader)
                except wire.Incomplete:
                    break
                except wire.HttpRequest:
                    http = True
                    break
                except (wire.MalformedRequest, ValueError) as exc:
                    reason = str(exc)
                    break
                consumed = reader.pos
        if http:  # not this protocol at all: said so, and no warning
            with contextlib.suppress(OSError):
                conn.sock.send(wire.HTTP_REPLY)
            log.debug("TCP store server: client %s sent an HTTP request; answered 400", conn.addr)
            self._drop(conn, None)
            return
        if reason is not None:
            self._drop(conn, reason)
            return
        if consumed:
            del conn.rbuf[:consumed]
        if conn.pending:
            self._dirty.add(conn)
        else:
            self._update_interest(conn)

    def _handle_one(self, conn: Peer, reader: wire.Reader) -> None:
        start = reader.pos
        query = reader.u8()
        if not conn.validated:
            if query != wire.Query.VALIDATE:
                reader.pos = start
                if wire.is_http(reader.head(8)):
                    raise wire.HttpRequest("an HTTP request")
                raise wire.MalformedRequest(f"first request is {query}, expected VALIDATE")
            magic = reader.u32()
            if magic != wire.VALIDATION_MAGIC:
                raise wire.MalformedRequest(f"bad validation magic {magic:#x}")
            conn.validated = True
            return
        woken = handlers.handle(self._state, conn, query, reader)
        if woken:
            self._wake(woken)

    def _flush(self, conn: Peer) -> None:
        if conn.closed:
            return
        ok, why = conn.send_some()
        if not ok:
            self._drop(conn, why)
            return
        if conn.rbuf and conn.pending < _HIGH_WATER:
            self._process(conn)  # requests left unprocessed while replies piled up
            if conn.closed or conn.pending:
                self._update_interest(conn)
                return
        self._update_interest(conn)

    def _update_interest(self, conn: Peer) -> None:
        if conn.closed:
            return
        events = 0 if conn.pending >= _HIGH_WATER else selectors.EVENT_READ
        if conn.pending:
            events |= selectors.EVENT_WRITE
        if events != conn.events:
            conn.events = events
            assert self._selector is not None
            self._selector.modify(conn.sock, events, conn)

    def _wake(self, waiters: list[Client]) -> None:
        for waiter in waiters:
            assert isinstance(waiter, Peer)
            waiter.reply(handlers.STOP)
            self._dirty.add(waiter)
