"""Lifelines: a node whose processes die is noticed within milliseconds, not after
the heartbeat timeout.

Each node listens on a port of its own (published in the store) and holds one
connection to the next node of the round (a ring over the participants, so each
node watches one and is watched by one: O(1) connections and store reads per node).
When the watched node's agent dies, its kernel closes the connection; the watcher
then tries the port once more: refused means the process is gone (the machine still
answers, nothing listens) and the node is reported lost. Anything else (a timeout:
the machine or its link is gone; a connection: it lives) is left to the heartbeats,
so a slow network never costs a live node its place; and only a connection that was
made and then closed counts (a first try refused may be a wrong address).

A node leaving on purpose writes its leave into the state before it closes its
port (:meth:`Lifeline.close` comes last), so its watcher finds nothing to report.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from relaunch._endpoint import family_of, is_ip
from relaunch._json import loads as json_loads

__all__ = ["Lifeline", "Target", "decode_address", "encode_address"]

log = logging.getLogger(__name__)

_VERSION = 1
_CHECK_TIMEOUT = 1.0
"""Seconds the second try of a closed lifeline may take; longer: left to heartbeats."""


@dataclass(frozen=True)
class Target:
    """The node watched, at the address it published."""

    node: str
    host: str
    port: int


def encode_address(host: str, port: int) -> bytes:
    return json.dumps({"v": _VERSION, "host": host, "port": port}).encode()


def decode_address(raw: bytes) -> tuple[str, int]:
    """``(host, port)`` of a published lifeline; ValueError naming what is wrong."""
    try:
        doc = json_loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("v") != _VERSION:
        raise ValueError(f"expected an object with v={_VERSION}, got {raw[:80]!r}")
    host, port = doc.get("host"), doc.get("port")
    if not isinstance(host, str) or not host or len(host) > 255:
        raise ValueError(f"host: expected an address, got {host!r}")
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"port: expected 1..65535, got {port!r}")
    return host, port


class Lifeline:
    """This node's listening port, and its watch over one other node.

    Owns one thread (``relaunch-lifeline-<node>``) from :meth:`start` to
    :meth:`close`: it accepts and holds the connections of the node's watcher and
    watches the target's. ``on_lost(node)`` runs in that thread: keep it short (it
    only hands the node over to the keep-alive thread)."""

    def __init__(self, node: str, host: str, on_lost: Callable[[str], None]) -> None:
        self._node = node
        self._host = host
        self._on_lost = on_lost
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._wanted: Target | None = None
        self._watching: Target | None = None
        self._watch: socket.socket | None = None
        self._given_up: Target | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where this node's lifeline listens (after :meth:`start`)."""
        assert self._listener is not None
        return self._host, int(self._listener.getsockname()[1])

    def start(self) -> None:
        """Listen (on ``host`` when it is an IP address, else on every address) and
        start the thread; OSError when it cannot listen."""
        family = family_of(self._host)
        bind = self._host if is_ip(self._host) else "::" if family == socket.AF_INET6 else ""
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((bind, 0))
            listener.listen(16)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(
            target=self._run, name=f"relaunch-lifeline-{self._node}", daemon=True
        )
        self._thread.start()

    def watch(self, target: Target | None) -> None:
        """Watch ``target`` from now on (None: no one); the same target again is a no-op."""
        with self._lock:
            if target == self._wanted:
                return
            self._wanted = target
        self._wake_w.send(b"w")

    def close(self) -> None:
        """Stop watching, close every connection and the port; join the thread. Idempotent."""
        with self._lock:
            self._stop = True
        thread, self._thread = self._thread, None
        if thread is not None:
            self._wake_w.send(b"s")
            thread.join(timeout=_CHECK_TIMEOUT + 5.0)
            if thread.is_alive():
                log.warning("lifeline thread %s did not stop", thread.name)
                return
        for key in list(self._selector.get_map().values()):
            if key.fileobj is not self._wake_r:
                key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
                wanted = self._wanted
            if wanted != self._watching:
                self._retarget(wanted)
            for key, _ in self._selector.select():
                try:
                    self._ready(key)
                except Exception:  # a lifeline never takes the agent down
                    log.exception("lifeline of %s", self._node)

    def _ready(self, key: selectors.SelectorKey) -> None:
        sock = key.fileobj
        assert isinstance(sock, socket.socket)
        if key.data == "wake":
            sock.recv(64)
        elif key.data == "accept":
            with_peer, _ = sock.accept()
            with_peer.setblocking(False)
            self._selector.register(with_peer, selectors.EVENT_READ, "held")
        elif key.data == "held":  # our watcher went (or a stray connection): let it go
            if not _alive(sock):
                self._selector.unregister(sock)
                sock.close()
        elif not _alive(sock):  # the target's lifeline closed
            self._drop_watch()
            target = self._watching
            assert target is not None
            self._watching = None
            self._check(target)

    def _retarget(self, target: Target | None) -> None:
        self._drop_watch()
        self._watching = target
        if target is None or target == self._given_up:
            return
        sock = _connect(target)
        if isinstance(sock, socket.socket):
            self._watch = sock
            self._selector.register(sock, selectors.EVENT_READ, "watch")
        else:  # not proof of a loss (a wrong address refuses too): the heartbeats decide
            self._given_up = target

    def _check(self, target: Target) -> None:
        """The target's lifeline closed: lost if its port now refuses us."""
        sock = _connect(target)
        if isinstance(sock, socket.socket):  # it lives (a connection broke): watch again
            self._watching = target
            self._watch = sock
            self._selector.register(sock, selectors.EVENT_READ, "watch")
        elif sock is ConnectionRefusedError:
            self._lost(target)
        else:
            self._given_up = self._watching = target

    def _lost(self, target: Target) -> None:
        log.info("node %s: the lifeline of node %s closed and its port refuses: lost",
                 self._node, target.node)  # fmt: skip
        self._given_up = self._watching = target
        self._on_lost(target.node)

    def _drop_watch(self) -> None:
        sock, self._watch = self._watch, None
        if sock is not None:
            self._selector.unregister(sock)
            sock.close()


def _alive(sock: socket.socket) -> bool:
    """Whether a readable lifeline connection is still open (nothing is ever sent)."""
    try:
        return bool(sock.recv(64))
    except BlockingIOError:
        return True
    except OSError:
        return False


def _connect(target: Target) -> socket.socket | type[OSError]:
    """A connection to ``target``'s lifeline, or the kind of failure."""
    try:
        sock = socket.create_connection((target.host, target.port), timeout=_CHECK_TIMEOUT)
    except ConnectionRefusedError:
        return ConnectionRefusedError
    except (OSError, UnicodeError):  # (a name idna refuses: a label over 63 characters)
        return OSError
    sock.setblocking(False)
    return sock
