"""Reaching a TCPStore server: address resolution (shared with the server, which binds
what it resolves) and the client side of one connection (blocking socket + buffer)."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import socket

from relaunch.errors import StoreConnectionError
from relaunch.store import _tcp_wire as wire

__all__ = [
    "Connection",
    "ProtocolError",
    "keys_request",
    "next_nonce",
    "one_key",
    "open_connection",
    "resolve_host",
]

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


def keys_request(query: wire.Query, keys: list[bytes]) -> bytes:
    return b"".join([bytes([query]), wire.pack_u64(len(keys)), *(wire.pack_bytes(k) for k in keys)])


def one_key(query: wire.Query, key: bytes) -> bytes:
    return bytes([query]) + wire.pack_bytes(key)


def open_connection(
    family: socket.AddressFamily, addr: str, port: int, timeout: float
) -> Connection:
    """Connect, validate and ping once; raise ``OSError`` on any failure."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
