"""The watch streams of one etcd store: each an HTTP stream of its own to the JSON
gateway's ``/watch``, read until the first event, a bound, a failure, or an end
asked for by another thread (a stopping node's threads must not wait out the bound).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from typing import Any

from relaunch.errors import StoreClosedError, StoreConnectionError
from relaunch.store._etcd_http import EtcdEndpoints

__all__ = ["WatchStreams"]

logger = logging.getLogger("relaunch.store.etcd")

_CONNECT = 3.0
"""Seconds a watch may take to connect (a member on a lost host never answers; the
caller's next read fails over)."""


class WatchStreams:
    """The streams in flight of one store's watches (``http``: its endpoints)."""

    def __init__(self, http: EtcdEndpoints) -> None:
        self._http = http
        self._requests = http.requests
        self._lock = threading.Lock()
        self._open: set[Any] = set()
        self._closing = False

    def follow(
        self,
        key: str,
        range_end: str | None,
        start_revision: int,
        timeout: float,
        cancel: threading.Event | None = None,
    ) -> bool:
        """Return at the first event on ``key`` (etcd's base64; every key up to
        ``range_end`` with one) from ``start_revision`` (True), or at ``timeout``, on a
        failure, or once ``cancel`` is set and :meth:`end` called (False)."""
        client, name, skip = self._http.current()
        create = {"key": key, "start_revision": str(start_revision)}
        if range_end is not None:
            create["range_end"] = range_end
        try:
            resp = client.session.post(
                client.get_url("/watch"),
                json={"create_request": create},
                stream=True,
                timeout=(min(self._http.timeout, _CONNECT), max(timeout, 0.01)),
                verify=self._http.verify,
            )
        except self._requests.RequestException as exc:
            # Move on to the next endpoint; the caller's next read fails over or fails.
            logger.info("etcd watch on %s failed: %s", name, exc)
            skip()
            return False
        with self._lock:
            if self._closing:
                resp.close()
                raise StoreClosedError("the etcd store was closed during a wait")
            if cancel is not None and cancel.is_set():
                resp.close()
                return False
            self._open.add(resp)
        try:
            return self._read(resp, name, time.monotonic() + timeout)
        except self._requests.exceptions.ConnectionError as exc:
            if "timed out" in str(exc).lower() or "timeout" in type(exc.__context__).__name__:
                return False  # the caller re-reads and decides whether time is up
            raise StoreConnectionError(f"etcd watch on {name} broke: {exc}") from exc
        except self._requests.RequestException:
            return False
        finally:
            with self._lock:
                self._open.discard(resp)
            resp.close()

    def _read(self, resp: Any, name: str, deadline: float) -> bool:
        """Whether an event comes on ``resp`` before ``deadline``."""
        # each read waits at most the timeout; a stream that keeps sending lines
        # without our event (a member without a leader) ends at the deadline too
        for line in resp.iter_lines():
            if time.monotonic() >= deadline:
                return False
            if not line:
                continue
            try:
                result = json.loads(line)["result"]
                if result.get("events"):
                    return True
                if result.get("canceled"):
                    return False  # no event comes on this stream (the caller re-reads)
            except (ValueError, KeyError, TypeError, AttributeError):
                logger.info("etcd watch on %s: a line that is not a watch reply: %.200r",
                            name, line)  # fmt: skip
                return False  # the caller re-reads the key
        return False

    def end(self) -> None:
        """Wake every thread in :meth:`follow` now (its wait raises
        StoreConnectionError): a socket shut down wakes a blocked read, where closing
        it would not."""
        with self._lock:
            streams = list(self._open)
        for resp in streams:
            sock = getattr(getattr(resp.raw, "connection", None), "sock", None)
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """End every stream in flight; no watch starts from now on."""
        with self._lock:
            self._closing = True
        self.end()
