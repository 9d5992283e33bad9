"""How the TCP store server takes new connections: which addresses it admits, and what it
does when the process has no file descriptor left for one more.

A listening socket stays readable while connections wait in its backlog, and the
server's selector reports it at every turn: an ``accept`` that fails for want of a file
descriptor (``EMFILE``: the process is at its limit on open files, ``ENFILE``: the
system is) would fail again at once, and the loop would spin, logging a line each turn,
while every waiting client hung. The acceptor stops watching the socket instead, says
so once, and watches it again as soon as a connection of the server closes, or after
:data:`PAUSE` seconds (the descriptor may be another part's of the process).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import resource
import selectors
import socket
import time

from relaunch.store._tcp_conn import bound_silence

__all__ = ["CLIENT_SILENT_AFTER", "PAUSE", "Acceptor"]

log = logging.getLogger(__name__)

PAUSE = 0.25
"""Seconds the acceptor waits, short of descriptors, before it tries again."""

CLIENT_SILENT_AFTER = 30.0
"""Seconds a client's machine may stay silent before its connection is dropped (its
link down: no close ever arrives), its waits cancelled and its descriptor freed."""

_PER_TURN = 512  # connections taken per turn at most: the others' requests go on too
_SHORT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_SAY_EVERY = 60.0


class Acceptor:
    """The server's listening socket in its selector (the data ``"listen"``)."""

    def __init__(
        self,
        listen: socket.socket,
        selector: selectors.BaseSelector,
        allowed: frozenset[str] | None,
    ) -> None:
        self._listen = listen
        self._selector = selector
        self._allowed = allowed
        """Client IP addresses admitted (loopback always); None: every address."""
        self._refused: set[str] = set()
        self._paused_until: float | None = None
        self._said_at = -_SAY_EVERY
        """When the shortage was last logged (once a minute at most)."""
        selector.register(listen, selectors.EVENT_READ, "listen")

    def accept(self, open_connections: int) -> list[tuple[socket.socket, str]]:
        """The connections waiting now that are admitted: non-blocking, without delay,
        with their ``host:port``."""
        taken: list[tuple[socket.socket, str]] = []
        for _ in range(_PER_TURN):
            try:
                sock, peer = self._listen.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in _SHORT_OF_FILES:
                    self._pause(exc, open_connections + len(taken))
                else:
                    log.warning("TCP store server cannot accept a connection: %s", exc)
                break
            if not self._admits(str(peer[0])):
                sock.close()
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                bound_silence(sock, CLIENT_SILENT_AFTER)
            taken.append((sock, f"{peer[0]}:{peer[1]}"))
        return taken

    def timeout(self) -> float | None:
        """How long the selector may wait: until the pause ends, if paused."""
        if self._paused_until is None:
            return None
        return max(0.0, self._paused_until - time.monotonic())

    def tick(self) -> None:
        """Watch the socket again once the pause is over (each turn of the loop)."""
        if self._paused_until is not None and time.monotonic() >= self._paused_until:
            self._resume()

    def freed(self) -> None:
        """A connection of the server closed: a descriptor is free, accept again."""
        if self._paused_until is not None:
            self._resume()

    def _pause(self, exc: OSError, open_connections: int) -> None:
        now = time.monotonic()
        self._paused_until = now + PAUSE
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listen)
        if now - self._said_at < _SAY_EVERY:
            return
        self._said_at = now
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.warning(
            "TCP store server on port %s: no file descriptor left for a new connection "
            "(%s; %d connections open, this process may open %d files): the clients wait "
            "until one closes. Raise the limit on open files (ulimit -n) for a job this "
            "size",
            self._listen.getsockname()[1], exc.strerror or exc, open_connections, soft,
        )  # fmt: skip

    def _resume(self) -> None:
        self._paused_until = None
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.register(self._listen, selectors.EVENT_READ, "listen")

    def _admits(self, ip: str) -> bool:
        if self._allowed is None:
            return True
        address = ip.removeprefix("::ffff:")
        if address in self._allowed or address.startswith("127.") or address == "::1":
            return True
        if address not in self._refused:
            self._refused.add(address)
            log.warning("TCP store server refuses %s: not a node of this round", address)
        return False
