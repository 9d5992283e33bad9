"""The watch streams of one etcd store: a watch on a key from a revision, through its
JSON gateway's streaming ``/watch``, and the streams in flight, which the store's
owner ends at once (a socket shut down wakes a blocked read, where closing it would
not)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

from relaunch._json import loads as json_loads
from relaunch.errors import StoreClosedError, StoreConnectionError, StoreLostError
from relaunch.store._etcd_http import EtcdEndpoints

__all__ = ["WatchStreams"]

logger = logging.getLogger("relaunch.store.etcd")

_CONNECT = 3.0
"""Seconds a watch may take to connect (a member on a lost host never answers; the
caller's next read fails over)."""


class WatchStreams:
    """The watches of one store (``http``: its endpoints). Thread-safe."""

    def __init__(self, http: EtcdEndpoints) -> None:
        self._http = http
        self._requests = http.requests
        self._timeout = http.timeout
        self._lock = threading.Lock()
        self._streams: set[Any] = set()
        """The watch streams in flight: :meth:`end` ends them (their threads wake)."""
        self._closing = False

    def follow(
        self,
        key: str,
        raw_key: str,
        start_revision: int,
        timeout: float,
        cancel: threading.Event | None = None,
    ) -> bool:
        """Return at the first event on ``key`` from ``start_revision`` (True), or at
        ``timeout``, on a failure, or once ``cancel`` is set (False)."""
        client, name, skip = self._http.current()
        body = {"create_request": {"key": raw_key, "start_revision": str(start_revision)}}
        try:
            resp = client.session.post(
                client.get_url("/watch"),
                json=body,
                stream=True,
                timeout=(min(self._timeout, _CONNECT), max(timeout, 0.01)),
                verify=self._http.verify,
            )
        except self._requests.RequestException as exc:
            # Move on to the next endpoint; the caller's next read fails over or fails.
            logger.info("etcd watch on %s failed: %s", name, exc)
            skip()
            return False
        if not self._register(resp, cancel):
            return False
        try:
            return _first_event(resp, name, time.monotonic() + timeout)
        except self._requests.exceptions.ConnectionError as exc:
            if "timed out" in str(exc).lower() or "timeout" in type(exc.__context__).__name__:
                return False  # the caller re-reads and decides whether time is up
            raise StoreConnectionError(f"etcd watch on {key!r} broke: {exc}") from exc
        except self._requests.RequestException:
            return False
        finally:
            with self._lock:
                self._streams.discard(resp)
            resp.close()

    def _register(self, resp: Any, cancel: threading.Event | None) -> bool:
        """Keep ``resp`` among the streams that :meth:`stop` ends (True), or close it:
        False if ``cancel`` is set; raises once the store is closed or given up."""
        with self._lock:
            if self._closing:
                resp.close()
                raise StoreClosedError("the etcd store was closed during a wait")
            if self._http.lost is not None:  # (given up as this watch began)
                resp.close()
                raise StoreLostError(self._http.lost)
            if cancel is not None and cancel.is_set():
                resp.close()
                return False
            self._streams.add(resp)
            return True

    def stop(self) -> None:
        """No watch starts from now on (it raises StoreClosedError); those in flight end."""
        with self._lock:
            self._closing = True
        self.end()

    def end(self) -> None:
        """Wake every thread in a watch now (its wait raises StoreConnectionError or
        returns False)."""
        with self._lock:
            streams = list(self._streams)
        for resp in streams:
            sock = getattr(getattr(resp.raw, "connection", None), "sock", None)
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def _first_event(resp: Any, name: str, deadline: float) -> bool:
    """True at the first event on the watch stream ``resp``; False at ``deadline``, when
    the watch is canceled, or at a line that is not a watch reply (the caller re-reads).
    Each read waits at most the request's timeout; a stream that keeps sending lines
    without our event (a member without a leader) ends at the deadline too."""
    for line in resp.iter_lines():
        if time.monotonic() >= deadline:
            return False
        if not line:
            continue
        try:
            result = json_loads(line)["result"]
            if result.get("events"):
                return True
            if result.get("canceled"):
                return False  # no event comes on this stream
        except (ValueError, KeyError, TypeError, AttributeError):
            logger.info("etcd watch on %s: a line that is not a watch reply: %.200r", name, line)
            return False
    return False
