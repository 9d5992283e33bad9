"""Lines of JSON onto a stream socket with a deadline, never a torn line read as whole.

A send to a peer that reads nothing (the fork server in a slow import) stops at the
deadline, perhaps inside a line, or just before its newline. Such a line must never
reach the peer as a request: the next send starts with ``!`` and a newline, which end
it as a line that is not JSON (the peer drops it; a prefix of a JSON object followed by
``!`` is never JSON). A line counts as sent once its newline is: :meth:`LineSender.send`
says which lines the peer will read whole, also when it is interrupted (``last_whole``).
"""

from __future__ import annotations

import math
import select
import socket
import time

__all__ = ["LineSender", "account", "ready"]

_END_TORN = b"!\n"


class LineSender:
    """Sends lines on ``sock``, never waiting past a deadline (each ``send`` takes what
    there is room for, after a poll that says there is some)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._torn = False
        """The last send stopped inside a line: the next one first ends it."""
        self.last_whole: list[bool] = []
        """For each line of the last send, whether the peer reads it whole (kept when
        the send was interrupted)."""

    def send(self, lines: list[bytes], deadline: float) -> list[bool]:
        """Send ``lines`` (each ending in a newline) until ``deadline``; for each, whether
        the peer reads it whole. OSError when the peer is gone."""
        prefix = _END_TORN if self._torn else b""
        payload = memoryview(prefix + b"".join(lines))
        self.last_whole = [False] * len(lines)
        sent = 0
        try:
            while sent < len(payload):
                left = deadline - time.monotonic()
                if left <= 0 or not ready(self._sock, select.POLLOUT, left):
                    break
                try:  # (a blocking send of more than there is room for waits for it all)
                    sent += self._sock.send(payload[sent:], socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    continue
        finally:
            self.last_whole, torn = account(lines, len(prefix), sent)
            self._torn = self._torn if sent < len(prefix) else torn
        return self.last_whole


def account(lines: list[bytes], prefix: int, sent: int) -> tuple[list[bool], bool]:
    """Of ``lines`` sent after ``prefix`` bytes, ``sent`` bytes in all: whether each is
    whole (its newline sent), and whether the send stopped inside one (torn)."""
    body = max(sent - prefix, 0)
    whole, ends, end = [], {0}, 0
    for line in lines:
        end += len(line)
        whole.append(body >= end)
        ends.add(end)
    return whole, sent > prefix and body not in ends


def ready(sock: socket.socket, event: int, timeout: float) -> bool:
    """Whether ``sock`` is ready for ``event`` (``select.POLLIN`` or ``POLLOUT``), or
    hung up, within ``timeout`` seconds. ``poll``, not ``select``: an agent that hosts a
    big job's store holds thousands of descriptors, and ``select`` refuses one past
    1,023 (the fork server's socket is made late in a run)."""
    poller = select.poll()
    poller.register(sock, event)
    return bool(poller.poll(math.ceil(max(timeout, 0.0) * 1000)))
