"""Lines sent with a deadline to a peer that reads nothing: the lines said whole reach
it whole, and a line torn by the deadline never reaches it glued to the next send."""

from __future__ import annotations

import json
import socket
import time

from relaunch.procs._lines import LineSender, account


def _lines(first: int, count: int, size: int) -> list[bytes]:
    return [json.dumps({"id": first + i, "pad": "x" * size}).encode() + b"\n" for i in range(count)]


def _read_all(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


def _ids(stream: bytes) -> list[int]:
    """What the peer reads: the ids of the lines that are JSON (a torn one is not)."""
    out = []
    for line in stream.split(b"\n")[:-1]:
        try:
            out.append(json.loads(line)["id"])
        except ValueError:
            continue
    return out


def test_a_send_cut_by_its_deadline_tears_no_line_into_the_next() -> None:
    ours, theirs = socket.socketpair()
    try:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sender = LineSender(ours)
        first = _lines(0, 200, 1000)  # far more than the buffers hold: the peer reads nothing
        whole = sender.send(first, time.monotonic() + 0.3)
        assert any(whole) and not all(whole)
        assert whole == sorted(whole, reverse=True)  # a prefix of the lines, then none
        second = _lines(1000, 3, 10)
        got = _read_all(theirs)  # the peer reads now: there is room again
        assert sender.send(second, time.monotonic() + 5.0) == [True, True, True]
        got += _read_all(theirs)
        said_whole = [i for i, w in enumerate(whole) if w]
        assert _ids(got) == [*said_whole, 1000, 1001, 1002]
        assert sender.last_whole == [True, True, True]
    finally:
        ours.close()
        theirs.close()


def test_every_line_is_whole_when_the_peer_reads() -> None:
    ours, theirs = socket.socketpair()
    try:
        sender = LineSender(ours)
        assert sender.send(_lines(0, 3, 10), time.monotonic() + 5.0) == [True] * 3
        assert _ids(_read_all(theirs)) == [0, 1, 2]
    finally:
        ours.close()
        theirs.close()


def test_a_line_counts_as_sent_once_its_newline_is() -> None:
    lines = [b'{"a":1}\n', b'{"b":2}\n']  # 8 bytes each
    assert account(lines, 0, 16) == ([True, True], False)
    assert account(lines, 0, 8) == ([True, False], False)  # on a line's end
    assert account(lines, 0, 0) == ([False, False], False)
    assert account(lines, 0, 12) == ([True, False], True)  # inside the second
    # all of the second but its newline: not sent (the next send's "!" ends it, unread)
    assert account(lines, 0, 15) == ([True, False], True)
    # after the 2 bytes that end an earlier torn line
    assert account(lines, 2, 10) == ([True, False], False)
    assert account(lines, 2, 2) == ([False, False], False)
    assert account(lines, 2, 1) == ([False, False], False)  # (the caller keeps it torn)


def test_a_torn_line_or_one_short_of_its_newline_is_never_read_as_a_request() -> None:
    ours, theirs = socket.socketpair()
    try:
        sender = LineSender(ours)
        sender._torn = True  # as after a send cut inside, or just before the newline
        ours.sendall(b'{"id": 7}')  # what that cut send left: a whole object, no newline
        assert sender.send(_lines(8, 2, 10), time.monotonic() + 5.0) == [True, True]
        assert _ids(_read_all(theirs)) == [8, 9]  # 7 is not read: it ends in "!"
    finally:
        ours.close()
        theirs.close()
