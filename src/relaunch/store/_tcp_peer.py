"""One client connection of the TCP store server: its socket and its buffers.

Replies wait in a queue of chunks. Small replies are copied into a growing tail
chunk; a large part (a stored value) is queued as the very bytes object the store
holds. When thousands of clients read the same large value at once (every node
reading a rendezvous state of half a megabyte while the clients are slow to read),
the server holds that value once, not once per client: copies into per-client
buffers took 12,288 simulated nodes' server past 5.9 GB.
"""

from __future__ import annotations

import selectors
import socket
from collections import deque
from itertools import islice

__all__ = ["SHARE_AT", "Peer"]

SHARE_AT = 16 * 1024
"""Reply parts this large are queued by reference, not copied."""

_TAIL_MAX = 256 * 1024  # a tail chunk grows to this much, then a new one starts
_IOV_MAX = 64  # chunks handed to one sendmsg


class Peer:
    """A client of the server: requests read so far, replies not sent yet."""

    __slots__ = (
        "_chunks",
        "_head",
        "_pending",
        "addr",
        "closed",
        "events",
        "rbuf",
        "sock",
        "validated",
    )

    def __init__(self, sock: socket.socket, addr: str) -> None:
        self.sock = sock
        self.addr = addr
        self.rbuf = bytearray()
        self._chunks: deque[bytes | bytearray] = deque()
        self._head = 0  # bytes of the first chunk already sent
        self._pending = 0
        self.validated = False
        self.closed = False
        self.events = selectors.EVENT_READ

    @property
    def pending(self) -> int:
        """Reply bytes not sent yet."""
        return self._pending

    def reply(self, *parts: bytes) -> None:
        """Queue ``parts`` to be sent in order (large ones by reference)."""
        chunks = self._chunks
        for part in parts:
            size = len(part)
            if not size:
                continue
            self._pending += size
            if size >= SHARE_AT:
                chunks.append(part)  # immutable: the store's own value, held once
                continue
            tail = chunks[-1] if chunks else None
            if isinstance(tail, bytearray) and len(tail) < _TAIL_MAX:
                tail += part
            else:
                chunks.append(bytearray(part))

    def send_some(self) -> tuple[bool, str | None]:
        """Send what the socket takes now. Returns ``(True, None)``, or ``(False, why)``
        when the connection is broken (``why`` None: the peer closed it)."""
        if not self._pending:
            return True, None
        chunks = self._chunks
        try:
            if len(chunks) == 1 and not self._head:  # the usual case: one reply or a few
                sent = self.sock.send(chunks[0])
            else:
                sent = self._send_views()
        except (BlockingIOError, InterruptedError):
            sent = 0
        except (ConnectionResetError, BrokenPipeError):
            return False, None
        except OSError as exc:
            return False, f"send failed: {exc}"
        self._advance(sent)
        return True, None

    def _send_views(self) -> int:
        """Send the first chunks in one call (from where the first one was left)."""
        views = [memoryview(chunk) for chunk in islice(self._chunks, _IOV_MAX)]
        first = views[0]
        views[0] = first[self._head :]
        try:
            return self.sock.sendmsg(views)
        finally:  # a bytearray with a view exported cannot grow: release them all
            for view in views:
                view.release()
            first.release()

    def _advance(self, sent: int) -> None:
        self._pending -= sent
        chunks = self._chunks
        if not self._pending:
            chunks.clear()
            self._head = 0
            return
        while sent:
            left = len(chunks[0]) - self._head
            if sent < left:
                self._head += sent
                return
            sent -= left
            chunks.popleft()
            self._head = 0
