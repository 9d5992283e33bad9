"""``--status-port``: the job's status over HTTP (page, ``/status.json``, ``/metrics``).

The server runs in threads of its own and reads the job through ``source`` (its own
store connection, made by the launcher), at most once per :data:`CACHE_SECONDS`
whatever the number of viewers: it adds nothing to the agent's monitor loop. A port
that is taken costs one warning, never the job.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from relaunch.errors import RelaunchError
from relaunch.status._board import escape

__all__ = ["CACHE_SECONDS", "StatusServer"]

log = logging.getLogger(__name__)

CACHE_SECONDS = 0.5


class _Cache:
    def __init__(self, source: Callable[[], dict[str, Any]]) -> None:
        self._source = source
        self._lock = threading.Lock()
        self._at = -1e9
        self._value: dict[str, Any] | str = "not read yet"

    def get(self) -> dict[str, Any] | str:
        """The document, or the one line that says why it cannot be read."""
        with self._lock:
            if time.monotonic() - self._at >= CACHE_SECONDS:
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
        from relaunch.status._web import render_html, render_metrics

        path = self.path.split("?", 1)[0]
        doc = self.server.cache.get()
        if path not in ("/", "/index.html", "/status.json", "/metrics"):
            self._send(404, "text/plain; charset=utf-8", b"not found\n")
        elif isinstance(doc, str):
            self._send(503, "text/plain; charset=utf-8", (escape(doc) + "\n").encode())
        elif path == "/status.json":
            self._send(200, "application/json", json.dumps(doc, indent=1).encode())
        elif path == "/metrics":
            self._send(200, "text/plain; version=0.0.4; charset=utf-8", render_metrics(doc))
        else:
            self._send(200, "text/html; charset=utf-8", render_html(doc).encode())

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("status page: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True  # close() joins the request threads
    cache: _Cache


class StatusServer:
    """Serves the job's status on ``host:port`` until :meth:`close`."""

    def __init__(self, host: str, port: int, source: Callable[[], dict[str, Any]]) -> None:
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
            server = _Server(self._address, _Handler)
        except OSError as exc:
            host, port = self._address
            log.warning("status page not served: cannot listen on %s:%s (%s)", host, port, exc)
            return False
        server.cache = _Cache(self._source)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.2},
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
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
