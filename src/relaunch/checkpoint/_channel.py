"""A connection to one snapshot server, kept from request to request.

Every save of a rank asks its agent twice (``saved``, ``wait_ack``) and makes its ring
successor list, fetch and acknowledge: five questions a step per rank. Asked on a
connection each, every one paid a connect, the server's accept and a thread of its own
there; with a snapshot a step, two nodes of two ranks on two cores spent more CPU in
their agents than in their workers (README, "One connection each way"). A
:class:`Channel` asks them all on one connection, which the server serves until the
client closes it or stays quiet for :data:`IDLE_TIMEOUT` seconds. Standard library
only.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Protocol, TypeVar

from relaunch.checkpoint import _wire as wire

__all__ = ["IDLE_TIMEOUT", "Channel", "Channels", "Server", "no_delay"]

IDLE_TIMEOUT = 30.0
"""Seconds a server keeps a connection on which no request comes."""
_REUSE_WITHIN = IDLE_TIMEOUT / 2
"""A connection idle for longer is opened again rather than reused: the server may be
closing it at that very moment."""


_C = TypeVar("_C", bound="_Closing")


class _Closing:
    """``with``: :meth:`close` at the end."""

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class Channel(_Closing):
    """Requests to the snapshot server at ``addr:port``, one at a time (one thread),
    on one connection while it serves. A failure inside :meth:`exchange` (the server
    gone, a ``get`` refused or cut short) closes the connection, and the next request
    opens a new one; one that the server closed while idle is never used again. (A
    refusal read by :meth:`ask` leaves it open: the server reads on after a request
    it refused, whose line it read whole.)
    """

    def __init__(self, addr: str, port: int) -> None:
        self.addr = addr
        self.port = port
        self._sock: socket.socket | None = None
        self._used = 0.0
        self.connections = 0
        """Connections opened so far."""

    def ask(self, doc: dict[str, Any], timeout: float) -> bytes:
        """Send one request, return the answer's line. OSError when the server cannot be
        reached or does not answer within ``timeout``; WireError for a line too long."""
        with self.exchange(doc, timeout) as sock:
            return wire.read_line(sock, wire.MAX_ANSWER)

    @contextlib.contextmanager
    def exchange(self, doc: dict[str, Any], timeout: float) -> Iterator[socket.socket]:
        """Send one request and hand over the connection to read its whole answer from
        (a ``get``'s line and bytes); an exception inside closes the connection, whose
        answer may be half read."""
        sock = self._connection(timeout)
        try:
            sock.settimeout(timeout)
            sock.sendall(wire.encode(doc))
            yield sock
        except BaseException:
            self.close()
            raise
        self._used = time.monotonic()

    def interrupt(self) -> None:
        """End the request in flight, if any (from another thread: its read returns at
        once and it raises OSError or WireError)."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection (the next request opens another)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _connection(self, timeout: float) -> socket.socket:
        sock = self._sock
        if sock is not None and (time.monotonic() - self._used > _REUSE_WITHIN or _ended(sock)):
            self.close()
            sock = None
        if sock is None:
            sock = socket.create_connection((self.addr, self.port), timeout=timeout)
            no_delay(sock)
            with contextlib.suppress(OSError):  # fewer, larger reads of a snapshot's bytes
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            self._sock = sock
            self.connections += 1
        return sock


class Server(Protocol):
    """Where a snapshot server listens (a peer record)."""

    @property
    def addr(self) -> str: ...
    @property
    def port(self) -> int: ...


class Channels(_Closing):
    """A channel per server asked, closed together (a round's fetch asks each node to
    list, then fetches from some of them)."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], Channel] = {}

    def close(self) -> None:
        """Close every channel opened."""
        for channel in self._open.values():
            channel.close()

    def to(self, server: Server) -> Channel:
        """The channel to ``server``, opened at its first request."""
        key = (server.addr, server.port)
        channel = self._open.get(key)
        if channel is None:
            channel = self._open[key] = Channel(*key)
        return channel


def no_delay(sock: socket.socket) -> None:
    """Send each write at once. A connection kept from request to request leaves TCP's
    quick acknowledgements of its first segments behind: a request or an answer written
    in two parts (a ``get``'s line, then its bytes) then waited for the peer's delayed
    acknowledgement, 40 ms, at every save (Nagle's algorithm)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _ended(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (readable between requests: only its end, or
    a byte no request asked for, which makes it as useless)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    try:
        return bool(poller.poll(0))
    except OSError:
        return True
