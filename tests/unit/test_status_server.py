"""The agent's status page server: a client that never ends its request does not hold
the agent's exit (it held a request thread, joined at close with no bound: a client
that sent a byte every few seconds kept the agent running after its job ended); an
IPv6 host is served."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from relaunch.status import StatusServer

pytestmark = pytest.mark.timeout(90)


def test_a_client_that_never_ends_its_request_does_not_hold_close() -> None:
    server = StatusServer("127.0.0.1", 0, lambda: {})
    assert server.start()
    assert server.port is not None
    slow = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    stop, cut = threading.Event(), threading.Event()

    def drip() -> None:  # a byte a second, for 40 s at most: never a whole request line
        for _ in range(40):
            try:
                slow.sendall(b"G")
            except OSError:
                cut.set()
                return
            if stop.wait(1.0):
                return

    dripper = threading.Thread(target=drip, name="test-drip")
    dripper.start()
    try:
        time.sleep(1.0)  # (its request thread reads by now)
        server.close()  # returns with the slow client's connection ended
        slow.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            assert slow.recv(1) == b""  # the server ended it
        assert dripper.is_alive() or cut.is_set()  # (not 40 s of bytes later)
    finally:
        stop.set()
        dripper.join(10)
        slow.close()


def test_an_ipv6_host_is_served() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    server = StatusServer("::1", 0, lambda: {})
    try:
        if not server.start():
            pytest.skip("cannot listen on ::1 here")
        with pytest.raises(urllib.error.HTTPError) as answer:  # (served: an answer)
            urllib.request.urlopen(f"http://[::1]:{server.port}/nothing-here", timeout=30)
        assert answer.value.code == 404
        answer.value.close()
    finally:
        server.close()
