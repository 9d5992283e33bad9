"""Lines of JSON onto a stream socket with a deadline, never a torn line read as whole.

A send to a peer that reads nothing (the fork server in a slow import) stops at the
deadline, perhaps inside a line. That line must never reach the peer as another one
glued to the next send: the next send starts with a newline, which ends the torn line
(the peer drops it: not JSON) or, when only its newline was missing, completes it.
:meth:`LineSender.send` says which lines the peer has (or will have) whole.
"""

from __future__ import annotations

import select
import socket
import time

__all__ = ["LineSender"]


class LineSender:
    """Sends lines on ``sock``, never waiting past a deadline (each ``send`` takes what
    there is room for, after a ``select`` that says there is some)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._torn = False
        """The last send stopped inside a line: the next one starts with a newline."""

    def send(self, lines: list[bytes], deadline: float) -> list[bool]:
        """Send ``lines`` (each ending in a newline) until ``deadline``; for each, whether
        the peer reads it whole. OSError when the peer is gone."""
        prefix = b"\n" if self._torn else b""
        payload = memoryview(prefix + b"".join(lines))
        sent = 0
        while sent < len(payload):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self._sock], [], left)[1]:
                break
            try:  # (a blocking send of more than there is room for waits for it all)
                sent += self._sock.send(payload[sent:], socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
        if sent < len(prefix):
            return [False] * len(lines)  # (still torn: the newline goes first next time)
        sent -= len(prefix)
        whole, end = [], 0
        for line in lines:
            end += len(line)
            whole.append(sent >= end - 1)  # (its newline alone missing: the next send's)
        self._torn = sent not in _ends(lines)
        return whole


def _ends(lines: list[bytes]) -> list[int]:
    """Where each line ends in their concatenation (0 for the start)."""
    ends, end = [0], 0
    for line in lines:
        end += len(line)
        ends.append(end)
    return ends
