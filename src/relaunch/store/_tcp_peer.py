"""One client connection of the TCP store server: its socket and its buffers."""

from __future__ import annotations

import selectors
import socket

__all__ = ["COMPACT_AT", "Peer"]

COMPACT_AT = 4 * 1024 * 1024
"""Sent bytes kept at the head of the reply buffer before it is compacted."""


class Peer:
    """A client of the server: requests read so far, replies not sent yet."""

    __slots__ = ("addr", "closed", "events", "rbuf", "sock", "validated", "wbuf", "wpos")

    def __init__(self, sock: socket.socket, addr: str) -> None:
        self.sock = sock
        self.addr = addr
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.wpos = 0  # bytes of wbuf already sent (compacted now and then, not per send)
        self.validated = False
        self.closed = False
        self.events = selectors.EVENT_READ

    @property
    def pending(self) -> int:
        """Reply bytes not sent yet."""
        return len(self.wbuf) - self.wpos

    def send_some(self) -> tuple[bool, str | None]:
        """Send what the socket takes now. Returns ``(True, None)``, or ``(False, why)``
        when the connection is broken (``why`` None: the peer closed it)."""
        if not self.pending:
            return True, None
        try:
            with memoryview(self.wbuf) as view:
                sent = self.sock.send(view[self.wpos :])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except (ConnectionResetError, BrokenPipeError):
            return False, None
        except OSError as exc:
            return False, f"send failed: {exc}"
        self.wpos += sent
        if self.wpos == len(self.wbuf):
            self.wbuf.clear()
            self.wpos = 0
        elif self.wpos > COMPACT_AT:  # large replies: memmove rarely, not per send
            del self.wbuf[: self.wpos]
            self.wpos = 0
        return True, None
