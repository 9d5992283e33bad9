"""``--status-port``: the job's status over HTTP (page, ``/status.json``, ``/metrics``).

The server runs in threads of its own and reads the job through ``source`` (its own
store connection, made by the launcher), at most once per :data:`CACHE_SECONDS`
whatever the number of viewers: it adds nothing to the agent's monitor loop. A port
that is taken costs one warning, never the job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from relaunch.errors import RelaunchError
from relaunch.status._board import escape
from relaunch.status._document import as_document

__all__ = ["CACHE_SECONDS", "StatusServer"]

log = logging.getLogger(__name__)

CACHE_SECONDS = 1.0


Source = Callable[[], Mapping[str, object]]
"""What reads the job's status document (:func:`~relaunch.status.read_job`, say)."""


class _Cache:
    def __init__(self, source: Source) -> None:
        self._source = source
        self._lock = threading.Lock()
        self._at = -1e9
        self._value: Mapping[str, object] | str = "not read yet"
        self._bodies: dict[str, bytes] = {}

    def body(self, kind: str, render: Callable[[Mapping[str, object]], bytes]) -> bytes | str:
        """The document rendered by ``render`` (once per document read), or the error line."""
        doc = self.get()
        if isinstance(doc, str):
            return doc
        with self._lock:
            if kind not in self._bodies:
                self._bodies[kind] = render(doc)
            return self._bodies[kind]

    def get(self) -> Mapping[str, object] | str:
        """The document, or the one line that says why it cannot be read."""
        with self._lock:
            if time.monotonic() - self._at >= CACHE_SECONDS:
                self._bodies = {}
                try:
                    self._value = self._source()
                except RelaunchError as exc:
                    self._value = f"{type(exc).__name__}: {exc}"
                except Exception as exc:  # a bug must not take the server (or the job) down
                    log.exception("status source failed")
                    self._value = f"internal error: {exc!r}"
                self._at = time.monotonic()
            return self._value


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 10  # a client that stops sending cannot hold a thread for long

    def do_GET(self) -> None:
        from relaunch.status._metrics import render_metrics
        from relaunch.status._web import render_html

        path, _, query = self.path.partition("?")
        node = urllib.parse.parse_qs(query).get("node")
        if path == "/status.json" and node:
            self._node(node[0])
            return
        views = {
            "/status.json": ("application/json", _summary_json),
            "/metrics": ("text/plain; version=0.0.4; charset=utf-8", render_metrics),
            "/": ("text/html; charset=utf-8", lambda d: render_html(d).encode()),
        }
        kind, render = views.get("/" if path == "/index.html" else path, (None, None))
        if kind is None or render is None:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")
            return
        body = self.server.cache.body(path, render)
        if isinstance(body, str):
            self._send(503, "text/plain; charset=utf-8", (escape(body) + "\n").encode())
        else:
            self._send(200, kind, body)

    def _node(self, node: str) -> None:
        """One node's whole row (``/status.json?node=ID``: its id, or its host)."""
        from relaunch.status._summary import node_detail

        doc = self.server.cache.get()
        if isinstance(doc, str):
            self._send(503, "text/plain; charset=utf-8", (escape(doc) + "\n").encode())
            return
        row = node_detail(as_document(doc), node)
        if row is None:
            body = escape(f"no node {node!r} in this job (or more than one on that host)")
            self._send(404, "text/plain; charset=utf-8", (body + "\n").encode())
            return
        self._send(200, "application/json", json.dumps(row, indent=1).encode())

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("status page: " + format, *args)


def _summary_json(doc: Mapping[str, object]) -> bytes:
    """``/status.json``: the document, a big job's summarized (``_summary``)."""
    from relaunch.status._summary import summarize

    return json.dumps(summarize(as_document(doc)), indent=1).encode()


_Request = socket.socket | tuple[bytes, socket.socket]


class _Server(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True  # close() joins the request threads, once their connections end
    cache: _Cache

    def __init__(self, address: tuple[str, int], handler: type[_Handler]) -> None:
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: _Request, client_address: Any) -> None:
        if isinstance(request, socket.socket):
            with self._open_lock:
                self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: _Request) -> None:
        if isinstance(request, socket.socket):
            with self._open_lock:
                self._open.discard(request)
        super().shutdown_request(request)

    def end_connections(self) -> None:
        """End every connection still open: a client that sends a byte every few seconds
        and never ends its request held its thread, and so the agent's exit, for good."""
        with self._open_lock:
            open_now = list(self._open)
        for conn in open_now:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Server6(_Server):
    address_family = socket.AF_INET6


class StatusServer:
    """Serves the job's status on ``host:port`` until :meth:`close`."""

    def __init__(self, host: str, port: int, source: Source) -> None:
        self._address = (host, port)
        self._source = source
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_address[1])

    def start(self) -> bool:
        """Listen; False (and one warning) when the address cannot be bound."""
        try:
            v6 = ":" in self._address[0]  # (an IPv6 host: the page on IPv6)
            server = (_Server6 if v6 else _Server)(self._address, _Handler)
        except OSError as exc:
            host, port = self._address
            log.warning("status page not served: cannot listen on %s:%s (%s)", host, port, exc)
            return False
        server.cache = _Cache(self._source)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name=f"relaunch-status-http-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return True

    def close(self, timeout: float = 5.0) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.end_connections()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
