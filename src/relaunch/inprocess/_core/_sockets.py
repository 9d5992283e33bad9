"""Find and shut down the TCP connections a process opened since a baseline.

Gloo offers no way to unblock a collective pending in another thread
(``abort()``/``shutdown()``/``destroy_process_group()`` leave it waiting on its peer).
Shutting down the connected TCP sockets of the process group (``shutdown(2)``, not
``close``: the descriptors stay valid for gloo's loop thread) makes the pending
operation fail at once with "Connection closed by peer", and tells the peers the
same. Listening sockets are left alone (gloo's listener aborts the process when its
socket is shut down under it).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

from relaunch.inprocess._core._logs import get_logger

__all__ = ["clear_baseline", "mark_baseline", "shutdown_new_connections", "socket_inodes"]

log = get_logger(__name__)

_FD_DIR = "/proc/self/fd"
_lock = threading.Lock()
_baseline: frozenset[str] | None = None


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
    """Forget the baseline: :func:`shutdown_new_connections` does nothing until the next mark."""
    global _baseline
    with _lock:
        _baseline = None


def mark_baseline() -> None:
    """Remember the sockets open now; :func:`shutdown_new_connections` spares them."""
    global _baseline
    with _lock:
        _baseline = socket_inodes()


def shutdown_new_connections() -> int:
    """Shut down every connected TCP socket opened since :func:`mark_baseline`.

    Returns how many were shut down; none when no baseline was marked.
    """
    with _lock:
        baseline = _baseline
    if baseline is None:
        return 0
    count = 0
    for fd, target in _socket_fds().items():
        if target in baseline:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:
            try:
                if (
                    sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.type == socket.SOCK_STREAM
                    and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                ):
                    with contextlib.suppress(OSError):
                        sock.getpeername()  # raises when not connected
                        sock.shutdown(socket.SHUT_RDWR)
                        count += 1
            except OSError as exc:
                log.debug("cannot shut down socket fd %s: %s", fd, exc)
    return count
