"""Find and shut down the TCP connections a process opened since a baseline.

Gloo offers no way to unblock a collective pending in another thread
(``abort()``/``shutdown()``/``destroy_process_group()`` leave it waiting on its peer).
Shutting down the read side of the process group's connected TCP sockets
(``shutdown(2)``, not ``close``: the descriptors stay valid for gloo's loop thread)
makes gloo's loop thread read end-of-file: the pair fails every operation pending on
it ("Connection closed by peer") and closes its descriptor. Listening sockets are
left alone (gloo's listener aborts the process when its socket is shut down under it).

Gloo's flaw this works around: a send that fails with ``EPIPE`` or ``ECONNRESET`` is
queued for the loop thread, and when the pair then fails, ``tcp::Pair::signalException``
fails the queued sends of bound buffers only, not of an unbound one (what collectives
use): the collective waits for the group's timeout (30 minutes by default). So a
socket must never refuse a send that a gloo worker may post before its loop thread
has seen the pair fail:

- only the read side is shut down (with the write side too, every send posted between
  the shutdown and the loop thread's end-of-file fails so);
- a duplicate of each connection shut down is held open until :func:`release_held`,
  which the wrapper's restart calls once every member reached the termination barrier
  (each aborted its own connections by then) or after a hold (``_restart.HOLD``): gloo's
  close is not the last one, so a peer that has not aborted yet is not sent the close
  (a ``FIN`` or ``RST`` that its next send meets).

Two gloo ranks in an allreduce loop, each aborting itself at a random moment within
30 ms of the other, then releasing 50 ms later (``inprocess/NOTES.md``): 14 of 60
ranks hung with both sides shut down and closed at once, 4 of 60 with the read side
only, 0 of 60 (and 0 of 200 beside two busy loops) with the read side and the hold.

A connection still open at the next call (the monitor thread aborts again every
0.25 s while the main thread stays inside the function) is one nobody reads (a thread
blocked in ``send``): that call shuts down its write side too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

from relaunch.inprocess._core._logs import get_logger

__all__ = [
    "clear_baseline",
    "mark_baseline",
    "release_held",
    "shutdown_new_connections",
    "socket_inodes",
]

log = get_logger(__name__)

_FD_DIR = "/proc/self/fd"
_lock = threading.Lock()
_baseline: frozenset[str] | None = None
_held: dict[str, socket.socket] = {}
"""A duplicate of each connection shut down since the baseline (by ``socket:[inode]``),
open until :func:`release_held`: see the module docstring."""


def _socket_fds() -> dict[int, str]:
    out: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def socket_inodes() -> frozenset[str]:
    """The sockets (``socket:[inode]``) this process holds now."""
    return frozenset(_socket_fds().values())


def clear_baseline() -> None:
    """Forget the baseline (:func:`shutdown_new_connections` does nothing until the
    next mark) and release the connections held."""
    global _baseline
    with _lock:
        _baseline = None
        _release()


def mark_baseline() -> None:
    """Remember the sockets open now (:func:`shutdown_new_connections` spares them),
    having released the connections held."""
    global _baseline
    with _lock:
        _release()
        _baseline = socket_inodes()


def shutdown_new_connections() -> int:
    """Shut down the read side of every connected TCP socket opened since
    :func:`mark_baseline`, and hold it open until :func:`release_held`; both sides of
    one still open from a previous call (see the module docstring).

    Returns how many were shut down; none when no baseline was marked.
    """
    with _lock:
        if _baseline is None:
            return 0
        ours = {sock.fileno() for sock in _held.values()}
        before = set(_held)  # a socket with two descriptors is shut down once a call
        count = 0
        for fd, target in _socket_fds().items():
            if target in _baseline or fd in ours or (target in _held and target not in before):
                continue
            again = target in before
            sock = _shutdown(fd, socket.SHUT_RDWR if again else socket.SHUT_RD)
            if sock is None:
                continue
            count += 1
            if again:
                sock.close()
            else:
                _held[target] = sock
        return count


def release_held() -> None:
    """Close the connections :func:`shutdown_new_connections` held open: both sides
    are shut down first, so the peers see them close even where another descriptor
    still refers to one (a group still referenced, a child forked meanwhile)."""
    with _lock:
        _release()


def _release() -> None:
    for sock in _held.values():
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    _held.clear()


def _shutdown(fd: int, how: int) -> socket.socket | None:
    """Shut down ``fd`` (``how``) if it is a connected TCP socket; return a duplicate
    of it, open (None when it is not one)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    try:
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
        if not tcp or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise OSError("not a connection")
        sock.getpeername()  # raises when not connected
        sock.shutdown(how)
    except OSError as exc:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            log.debug("socket fd %s not shut down: %s", fd, exc)
        sock.close()
        return None
    return sock
