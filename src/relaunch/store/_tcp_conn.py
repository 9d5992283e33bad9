"""Reaching a TCPStore server: address resolution (shared with the server, which binds
what it resolves) and the client side of one connection (blocking socket + buffer)."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import itertools
import logging
import os
import socket
import time

from relaunch.errors import StoreConnectionError
from relaunch.store import _tcp_wire as wire

__all__ = [
    "AFTER_LOSS",
    "Connection",
    "Dialer",
    "ProtocolError",
    "bound_silence",
    "keys_request",
    "next_nonce",
    "one_key",
    "open_connection",
    "resolve_host",
]

log = logging.getLogger(__name__)

AFTER_LOSS = 1.0
"""Seconds a connection is tried once the server was taken for lost."""

_SILENT = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH})
"""How a connection breaks once its peer stayed silent for the bound: the kernel reports
the last soft error it saw (no route, once the peer's address stopped resolving on the
link) in place of ETIMEDOUT."""

_SILENCE_FLOOR = 1.0
_SILENCE_CEILING = 32767.0  # (TCP_KEEPIDLE's largest)
_BACKOFF_START = 0.01
_BACKOFF_MAX = 0.5

_nonces = itertools.count(os.getpid() & 0xFFFF)


def next_nonce() -> int:
    """A fresh 32-bit number for a PING."""
    return next(_nonces) & 0xFFFFFFFF


class ProtocolError(ConnectionError):
    """The server replied something this protocol does not allow."""


class Connection:
    """One blocking socket with a receive buffer."""

    __slots__ = ("_timeout", "buf", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self._timeout: float | None = sock.gettimeout()

    def send(self, data: bytes, timeout: float | None = None) -> None:
        """Send ``data``; with ``timeout``, the socket's timeout is set to it first (a
        shared connection's last read may have left a short one)."""
        if timeout is not None and timeout != self._timeout:
            self.sock.settimeout(timeout)
            self._timeout = timeout
        self.sock.sendall(data)

    def read(self, size: int, timeout: float | None) -> bytes:
        """Read exactly ``size`` bytes; ``TimeoutError`` when none come in ``timeout``."""
        if len(self.buf) < size and timeout != self._timeout:  # (a syscall: only when new)
            self.sock.settimeout(timeout)
            self._timeout = timeout
        while len(self.buf) < size:
            chunk = self.sock.recv(max(65536, size - len(self.buf)))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buf += chunk
        data = bytes(self.buf[:size])
        del self.buf[:size]
        return data

    def u8(self, timeout: float | None) -> int:
        return self.read(1, timeout)[0]

    def u32(self, timeout: float | None) -> int:
        return int.from_bytes(self.read(4, timeout), "little")

    def i64(self, timeout: float | None) -> int:
        return int.from_bytes(self.read(8, timeout), "little", signed=True)

    def blob(self, timeout: float | None) -> bytes:
        size = int.from_bytes(self.read(8, timeout), "little")
        if size > wire.MAX_VALUE_LEN:
            raise ProtocolError(f"reply of {size} bytes exceeds {wire.MAX_VALUE_LEN}")
        return self.read(size, timeout)

    def shutdown(self) -> None:
        """Shut the socket down (any thread; a blocked ``recv`` returns)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        self.sock.close()


class Dialer:
    """Opens a client's connections to its server, each tried for ``patience`` seconds.

    The server is taken for lost once a connection failed for that long, or once a
    connection's peer stayed silent for ``silent_after`` seconds (:func:`bound_silence`),
    until a connection succeeds: each connection meanwhile is tried for
    :data:`AFTER_LOSS` only (an agent saying why it stops, and leaving, waits a moment
    per call, not the whole timeout again)."""

    def __init__(self, host: str, port: int, *, patience: float, silent_after: float) -> None:
        self.host, self.port = host, port
        self._family, self._addr = resolve_host(host, port)
        self.patience = patience
        self.silent_after = silent_after
        self.lost = False
        self.stopped = False
        """The client closed: a connection failing now is not tried again."""

    def connect(self) -> Connection:
        """Connect and validate, retrying; StoreConnectionError once the patience ran out."""
        patience = min(self.patience, AFTER_LOSS) if self.lost else self.patience
        deadline = time.monotonic() + patience
        delay = _BACKOFF_START
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            try:
                conn = open_connection(
                    self._family, self._addr, self.port, max(remaining, 0.05), self.silent_after
                )
            except OSError as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.stopped:
                    self.lost = True
                    raise StoreConnectionError(
                        f"cannot connect to the TCP store at {self.host}:{self.port} "
                        f"after {attempt} attempts in {patience:g}s: {exc}"
                    ) from exc
                log.debug("TCP store %s:%s not reachable yet: %s", self.host, self.port, exc)
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, _BACKOFF_MAX)
            else:
                self.lost = False
                return conn

    def broke(self, exc: BaseException) -> str:
        """Why a connection broke, in words. A peer silent for ``silent_after`` is as good
        as a connection that failed for the whole patience: the server is taken for lost."""
        if isinstance(exc, OSError) and exc.errno in _SILENT:
            self.lost = True
            silent = min(max(self.silent_after, _SILENCE_FLOOR), _SILENCE_CEILING)
            return f"its machine answered nothing for {silent:g}s ({exc})"
        return str(exc)


def keys_request(query: wire.Query, keys: list[bytes]) -> bytes:
    return b"".join([bytes([query]), wire.pack_u64(len(keys)), *(wire.pack_bytes(k) for k in keys)])


def one_key(query: wire.Query, key: bytes) -> bytes:
    return bytes([query]) + wire.pack_bytes(key)


def open_connection(
    family: socket.AddressFamily, addr: str, port: int, timeout: float, silent_after: float
) -> Connection:
    """Connect, validate and ping once; raise ``OSError`` on any failure. The
    connection breaks once the server's machine stays silent for ``silent_after``
    seconds (:func:`bound_silence`)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        bound_silence(sock, silent_after)
        sock.connect((addr, port))
        conn = Connection(sock)
        nonce = next_nonce()
        conn.send(
            bytes([wire.Query.VALIDATE])
            + wire.pack_u32(wire.VALIDATION_MAGIC)
            + bytes([wire.Query.PING])
            + wire.pack_u32(nonce)
        )
        if conn.u32(timeout) != nonce:
            raise ProtocolError("the server answered the validation ping wrongly")
    except BaseException:
        sock.close()
        raise
    return conn


def bound_silence(sock: socket.socket, seconds: float) -> None:
    """Break ``sock`` (its calls raise ``OSError``) once the peer's machine has
    acknowledged nothing for about ``seconds``: data sent and not acknowledged
    (TCP_USER_TIMEOUT), or, while nothing is in flight, keep-alive probes unanswered.

    This tells a machine gone silent (its link down, a cable pulled: no close ever
    arrives) from a server slow to answer, whose kernel still acknowledges: only the
    first breaks the connection, so a reply timeout can stay long. One exception: from
    Linux 5.11, data held back that long by a peer that reads nothing (a zero window)
    breaks it too, so the bound must be longer than the peer's loop may stall. Where
    the options do not exist (not Linux), a silent machine is noticed at the reply
    timeout. The bound is kept within :data:`_SILENCE_FLOOR` (a lost packet's first
    retransmissions, 200 ms apart and more, must fit in it) and what the options take."""
    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        return
    seconds = min(max(seconds, _SILENCE_FLOOR), _SILENCE_CEILING)
    idle = max(1, int(seconds / 2))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, idle // 2))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(seconds * 1000)))


def resolve_host(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """Return (family, numeric address) of ``host``; a name is resolved here, once."""
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        family = socket.AF_INET6 if literal.version == 6 else socket.AF_INET
        return family, host
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise StoreConnectionError(f"cannot resolve store host {host!r}: {exc}") from exc
    family, _, _, _, sockaddr = infos[0]
    return socket.AddressFamily(family), str(sockaddr[0])
