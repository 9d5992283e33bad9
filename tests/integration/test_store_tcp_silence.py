"""A TCP store client's silence bound breaks a connection to a machine gone silent only.

A client's connection breaks once the server's machine acknowledges nothing for
``silent_timeout`` (its link down: no close ever arrives); a server that is only slow
to answer (here: its process stopped, its kernel still acknowledging) keeps the
connection, and the call gets its reply, however long past that bound. The link-down
side is tested end to end, in network namespaces, by
``tests/faults/test_multinode_netns.py`` (the node cut off ends on its own).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from relaunch.errors import ConfigError
from relaunch.store.tcp import TCPStoreClient

pytestmark = pytest.mark.timeout(60)

_SERVER = textwrap.dedent(
    """
    import sys, time
    from relaunch.store.tcp import TCPStoreServer
    server = TCPStoreServer().start()
    print(server.port, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    server.close()
    """
)


def test_a_server_slow_to_answer_keeps_its_connection_past_the_silence_bound() -> None:
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with TCPStoreClient(
            "127.0.0.1", port, timeout=30, reconnect_timeout=1, silent_timeout=1
        ) as client:
            client.set("k", b"v")
            os.kill(server.pid, signal.SIGSTOP)  # its kernel still acknowledges
            got: list[object] = []

            def call() -> None:
                try:
                    got.append(client.get("k"))
                except BaseException as exc:
                    got.append(exc)

            caller = threading.Thread(target=call, name="test-slow-server-call")
            caller.start()
            time.sleep(3)  # three times the bound, the request sent and not answered
            assert got == []
            os.kill(server.pid, signal.SIGCONT)
            caller.join(30)
            assert got == [b"v"]
            client.set("k", b"w")  # the same connection serves on
            assert client.get("k") == b"w"
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.communicate(timeout=30)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "5"])
def test_a_bad_silence_bound_is_refused_with_its_name(bad: object) -> None:
    with pytest.raises(ConfigError, match="silent_timeout: expected a positive number"):
        TCPStoreClient("127.0.0.1", 1, silent_timeout=bad)  # type: ignore[arg-type]
