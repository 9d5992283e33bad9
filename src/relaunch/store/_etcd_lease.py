"""One etcd store's lease: granted at first use, refreshed by a named thread, revoked
at close; the keys written under it are written again when etcd dropped it.

A lease ends on its own ``ttl`` seconds after its last refresh: a node that crashed
leaves its keys for that long, no clock of ours involved. A node that was only silent
past ``ttl`` (a stalled machine) finds its lease gone when it comes back: its keys
vanished meanwhile (the others saw it dead), and they are put again under a new lease
(its liveness key: it is seen alive again, and its rendezvous, which may have dropped
it, takes it back in the next round).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from relaunch.errors import StoreClosedError, StoreError, StoreLostError
from relaunch.store._etcd_http import first_kv

__all__ = ["OwnLease"]

logger = logging.getLogger("relaunch.store.etcd")

_LEASE_NOT_FOUND = "requested lease not found"
"""etcd's error for a write under a lease it no longer knows (gRPC NOT_FOUND)."""

Post = Callable[[str, dict[str, Any]], dict[str, Any]]
PostSent = Callable[[str, dict[str, Any]], tuple[dict[str, Any], bool]]
"""A call, and whether it was sent more than once (a member may have applied it)."""


class OwnLease:
    """The lease of one store (``post``: its JSON calls). Thread-safe."""

    def __init__(self, post: Post, patience: float, post_sent: PostSent) -> None:
        """``patience``: the seconds a write keeps taking new leases while each one
        expires before the write reaches etcd (the store's timeout)."""
        self._post = post
        self._post_sent = post_sent
        self._patience = patience
        self._lock = threading.Lock()
        self._id: int | None = None
        self._ttl = 0.0
        self._kept: dict[str, str] = {}
        """What :meth:`put` wrote (base64 key -> base64 value): written again under a
        new lease when etcd dropped the old one."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def put(self, key: str, value: str, ttl: float) -> None:
        """Set ``key`` (base64) to ``value`` (base64) under the lease, and keep it
        there: it is written again under a new lease if etcd drops this one."""
        self.under(ttl, functools.partial(self._write, key, value))
        with self._lock:
            self._kept[key] = value

    def _write(self, key: str, value: str, lease: int) -> dict[str, Any]:
        return self._post("/kv/put", {"key": key, "value": value, "lease": str(lease)})

    def claim(self, key: str, value: str, ttl: float) -> bool:
        """Create ``key`` (base64) holding ``value`` (base64) under the lease unless it
        exists; whether this call created it (not written again after etcd dropped
        the lease: another node may hold it by then). A call sent again after a member
        applied it and did not answer finds the key there: this call's when it holds
        ``value`` under this lease."""
        sent: list[tuple[int, bool]] = []  # (the lease, whether the call was sent again)

        def create(lease: int) -> dict[str, Any]:
            put = {"key": key, "value": value, "lease": str(lease)}
            absent = {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
            failure = [{"request_range": {"key": key}}]
            body = {"compare": [absent], "success": [{"request_put": put}], "failure": failure}
            reply, resent = self._post_sent("/kv/txn", body)
            sent.append((lease, resent))
            return reply

        reply = self.under(ttl, create)
        if reply.get("succeeded", False):
            return True
        lease, resent = sent[-1]
        kv = first_kv(((reply.get("responses") or [{}])[0]).get("response_range", {}))
        return (
            resent
            and kv is not None
            and kv.get("value") == value
            and (kv.get("lease") == str(lease))
        )

    def forget(self, key: str) -> None:
        """``key`` (base64) was deleted: it is not written again."""
        with self._lock:
            self._kept.pop(key, None)

    def under(self, ttl: float, call: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
        """``call(lease)`` with the lease (granted now with ``ttl`` seconds if there is
        none); again with a new lease when etcd no longer knows it: it expired before
        the refresh thread saw it. Raised to the caller instead, the writer of a node's
        liveness key would fail its rendezvous over a stall it has survived. On a
        machine so slow that a new lease too expires before the call reaches etcd (its
        grant answered, then the call sent, more than ``ttl`` later: seen with 1,024
        simulated nodes on two cores), new ones are taken for up to the store's
        timeout, then the error is raised."""
        deadline = time.monotonic() + self._patience
        while True:
            lease = self._own(ttl)
            try:
                return call(lease)
            except StoreError as exc:
                if _LEASE_NOT_FOUND not in str(exc) or time.monotonic() > deadline:
                    raise
                self._replace(lease)

    def _own(self, ttl: float) -> int:
        with self._lock:
            if self._stop.is_set():
                raise StoreClosedError("the etcd store is closed")
            if self._id is None:
                reply = self._post("/lease/grant", {"TTL": max(1, math.ceil(ttl)), "ID": 0})
                self._id, self._ttl = int(reply["ID"]), ttl
            lease = self._id
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._refresh,
                    args=(max(ttl / 3, 0.1),),
                    name=f"relaunch-etcd-lease-{lease:x}",
                    daemon=True,
                )
                self._thread.start()
        return lease

    def _replace(self, lease: int) -> None:
        """etcd dropped ``lease``: grant a new one and write what was kept under it
        again (once each; a key not written now is logged)."""
        with self._lock:
            if self._id != lease:
                return  # (another thread replaced it already)
            self._id = None
            kept = dict(self._kept)
        logger.warning("etcd lease %x expired; a new one is granted, %d key(s) written "
                       "again under it", lease, len(kept))  # fmt: skip
        for key, value in kept.items():
            if key not in self._kept:  # deleted meanwhile
                continue
            try:
                self._write(key, value, self._own(self._ttl))
            except StoreError as exc:  # (closed meanwhile, or the store is unreachable)
                logger.warning("etcd lease: a key not written again: %s", exc)
                return

    def _refresh(self, interval: float) -> None:
        while not self._stop.wait(interval):
            lease = self._id
            if lease is None:
                continue
            try:
                reply = self._post("/lease/keepalive", {"ID": str(lease)})
            except StoreLostError:
                return  # (said once, by whoever ends the job)
            except StoreError as exc:
                logger.warning("etcd lease %x not refreshed: %s", lease, exc)
                continue
            if int(reply.get("result", {}).get("TTL", 0)) <= 0:
                self._replace(lease)

    def close(self, timeout: float) -> None:
        """Stop refreshing (the thread joined within ``timeout``), then revoke the
        lease: its keys vanish at once. Idempotent."""
        with self._lock:
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=timeout)
        with self._lock:
            lease, self._id = self._id, None
        if lease is not None:
            try:
                self._post("/kv/lease/revoke", {"ID": str(lease)})
            except StoreLostError:
                pass  # (no member can revoke it, nor keep it: it ends with the store)
            except StoreError as exc:
                logger.warning("etcd lease %x not revoked (it expires on its own): %s", lease, exc)
