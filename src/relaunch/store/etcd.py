"""A :class:`~relaunch.store.Store` over etcd v3 (its JSON gateway, through ``etcd3gw``).

Compare-and-set is an etcd transaction; :meth:`EtcdStore.wait` is a watch
(woken by the write, no polling); several endpoints are failed over in order
(:mod:`relaunch.store._etcd_http`: the endpoints, TLS with ``ca_cert``, ``cert``,
``key``, and user/password authentication). ``etcd3gw`` is imported when a store
is created. Errors of ``requests``/``etcd3gw`` are translated at this boundary.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from relaunch.errors import (
    StoreError,
    StoreTimeoutError,
)
from relaunch.store import _etcd_tickets as tickets
from relaunch.store._etcd_history import applied_earlier
from relaunch.store._etcd_http import EtcdEndpoints, first_kv, kv_value
from relaunch.store._etcd_lease import OwnLease
from relaunch.store._etcd_watch import WatchStreams

__all__ = ["EtcdStore"]

logger = logging.getLogger(__name__)

_TXN_OPS = 64
"""Operations in one transaction of :meth:`EtcdStore.multi_get` and ``multi_set``
(etcd's ``--max-txn-ops`` is 128 unless a cluster lowers it)."""


def _chunks(keys: list[str]) -> list[list[str]]:
    return [keys[i : i + _TXN_OPS] for i in range(0, len(keys), _TXN_OPS)]


def _b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class EtcdStore:
    """Keys under ``prefix`` in an etcd v3 cluster reached at ``endpoints`` ((host, port) pairs).

    Every method raises StoreConnectionError when no endpoint answers (after trying
    each once), StoreError on an error reply, StoreClosedError after :meth:`close`.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        protocol: str = "http",
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = 10.0,
        prefix: str = "",
    ) -> None:
        self._http = EtcdEndpoints(
            endpoints,
            protocol=protocol,
            ca_cert=ca_cert,
            cert=cert,
            key=key,
            user=user,
            password=password,
            timeout=timeout,
        )
        self._requests = self._http.requests
        self._timeout = self._http.timeout
        self._prefix = prefix
        self._lock = threading.Lock()
        self._lease = OwnLease(self._http.post, self._timeout, self._http.post_sent)
        self._watches = WatchStreams(self._http)
        self._closed = False
        self._absent: tuple[str, int, float] | None = None
        """The key a wait found absent as it timed out, at which revision, and when."""

    def use_endpoints(self, endpoints: Sequence[tuple[str, int]], *, move: bool = False) -> None:
        """Try these endpoints from now on (a cluster whose members changed); the one
        in use stays first when it is still among them, unless ``move``: then the first
        one given is."""
        self._http.use(endpoints, move=move)

    def hurry(self) -> None:
        """From now on each call waits a moment (2 s), not the whole timeout, for an
        endpoint: this node is leaving, and a store that stopped answering (its
        members' nodes gone first) must not hold it up call after call."""
        self._http.hurry()

    def give_up(self, reason: str) -> None:
        """The store is gone for good (the embedded store's quorum is lost): every call
        from now on raises StoreLostError with ``reason`` at once, and the watches in
        flight end now."""
        self._http.give_up(reason)
        self.end_watches()

    @property
    def lost(self) -> str | None:
        """Why the store was given up (:meth:`give_up`); None while it may answer."""
        return self._http.lost

    def on_trouble(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (at once, in the calling thread: it must not block) each
        time a call's sweep of the endpoints first finds none that can serve it."""
        self._http.on_trouble = callback

    def troubled_for(self) -> float:
        """Seconds since the sweeps of the endpoints (of any call) found none that could
        serve a call, with no call served through the leader since (a write, a read that
        is not serializable: proof of a quorum); 0.0 while they are."""
        since = self._http.troubled_since
        return 0.0 if since is None else time.monotonic() - since

    def request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call of etcd's JSON API (``/cluster/member/list``...), failed over as every
        other call; StoreConnectionError when no endpoint answers."""
        return self._http.post(path, body)

    def _key(self, key: str) -> str:
        return _b64(self._prefix + key)

    # -- the Store protocol -------------------------------------------------------------

    def _range(self, key: str, *, serializable: bool = False) -> tuple[dict[str, Any] | None, int]:
        body: dict[str, Any] = {"key": self._key(key)}
        if serializable:
            body["serializable"] = True
        reply = self._http.post("/kv/range", body)
        return first_kv(reply), int(reply.get("header", {}).get("revision", 0))

    def _value(self, key: str, *, serializable: bool = False) -> bytes | None:
        kv, _ = self._range(key, serializable=serializable)
        if kv is None:
            return None
        return kv_value(kv)

    def get(self, key: str) -> bytes | None:
        return self._value(key)

    def peek(self, key: str) -> bytes | None:
        """``get`` answered by the member asked, with no consensus round (a serializable
        range: :class:`~relaunch.store.PeekStore`)."""
        return self._value(key, serializable=True)

    def set(self, key: str, value: bytes) -> None:
        self._http.post("/kv/put", {"key": self._key(key), "value": _b64(value)})

    def _txn(
        self, key: str, compare: dict[str, Any], value: bytes
    ) -> tuple[bool, dict[str, Any] | None, bool]:
        """Put ``value`` if ``compare`` holds: whether it did, the key when it did not
        (as etcd's JSON has it), and whether the call was sent more than once."""
        reply, resent = self._http.post_sent(
            "/kv/txn",
            {
                "compare": [{"key": self._key(key), "result": "EQUAL", **compare}],
                "success": [{"request_put": {"key": self._key(key), "value": _b64(value)}}],
                "failure": [{"request_range": {"key": self._key(key)}}],
            },
        )
        if reply.get("succeeded", False):
            return True, None, resent
        answer = (reply.get("responses") or [{}])[0]
        return False, first_kv(answer.get("response_range", {})), resent

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bytes, bool]:
        if expected is None:
            compare: dict[str, Any] = {"target": "CREATE", "create_revision": "0"}
        else:
            compare = {"target": "VALUE", "value": _b64(expected)}
        written, kv, resent = self._txn(key, compare, desired)
        if written:
            return desired, True
        current = b"" if kv is None else kv_value(kv)
        # sent again after a member did not answer: its first send may have been
        # applied, and another write may have landed since (_etcd_history)
        if (
            resent
            and kv is not None
            and current != desired
            and applied_earlier(self._http.post, self._key(key), expected, desired, kv)
        ):
            return desired, True
        return current, False

    def add(self, key: str, amount: int) -> int:
        while True:
            kv, _ = self._range(key)
            raw = None if kv is None else kv_value(kv)
            if raw is None:
                current = 0
                compare: dict[str, Any] = {"target": "CREATE", "create_revision": "0"}
            else:
                try:
                    current = int(raw) if raw else 0
                except ValueError as exc:
                    raise StoreError(f"key {key!r} does not hold an integer: {raw!r}") from exc
                assert kv is not None
                compare = {"target": "MOD", "mod_revision": kv["mod_revision"]}
            desired = str(current + amount).encode()
            written, now, resent = self._txn(key, compare, desired)
            # a send that got no answer may have added already: adding again would count twice
            if written or (
                resent
                and now is not None
                and applied_earlier(self._http.post, self._key(key), raw, desired, now)
            ):
                return current + amount

    def take_ticket(self, key: str) -> int:
        """The next ticket of the counter at ``key``, in one call
        (:class:`~relaunch.store.TicketStore`; :mod:`relaunch.store._etcd_tickets`)."""
        return tickets.take(self._http.post, key, self._key(key))

    def tickets(self, key: str) -> int:
        """How many tickets of the counter at ``key`` were taken."""
        kv, _ = self._range(key)
        return tickets.count(key, kv)

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        """The value of each key now, in order: one read-only transaction per
        :data:`_TXN_OPS` keys (:class:`~relaunch.store.BatchStore`)."""
        found: list[bytes | None] = []
        for chunk in _chunks(keys):
            ops = [{"request_range": {"key": self._key(key)}} for key in chunk]
            reply = self._http.post("/kv/txn", {"success": ops})
            for answer in reply.get("responses") or []:
                kv = first_kv(answer.get("response_range", {}))
                found.append(None if kv is None else kv_value(kv))
        if len(found) != len(keys):
            raise StoreError(f"etcd answered {len(found)} reads for {len(keys)} keys")
        return found

    def multi_set(self, items: dict[str, bytes]) -> None:
        """Set every key: one transaction (one raft round) per :data:`_TXN_OPS` keys."""
        for chunk in _chunks(list(items)):
            ops = [{"request_put": {"key": self._key(k), "value": _b64(items[k])}} for k in chunk]
            self._http.post("/kv/txn", {"success": ops})

    def delete(self, key: str) -> bool:
        self._lease.forget(self._key(key))
        reply = self._http.post("/kv/deleterange", {"key": self._key(key)})
        return int(reply.get("deleted", 0)) > 0

    def wait(self, keys: list[str], timeout: float) -> None:
        # A wait that timed out read its key last (absent, at revision R); a wait on the
        # same key begun within a second (a watcher's loop) watches from R + 1 instead of
        # reading it again: the same certainty (every change after R is delivered), one
        # consensus read less per loop (at idle, 4% of the embedded store's calls)
        start = time.monotonic()
        end = start + timeout
        for key in keys:
            last, known = self._absent, None
            if last is not None and last[0] == key and start - last[2] < 1.0:
                known, self._absent = last[1], None
            read = False  # (a wait that times out has read the key itself, last)
            while True:
                if known is not None:
                    kv, revision, known = None, known, None
                else:
                    (kv, revision), read = self._range(key), True
                if kv is not None:
                    break
                left = end - time.monotonic()
                if left <= 0 and read:
                    self._absent = (key, revision, time.monotonic())
                    raise StoreTimeoutError(f"key {key!r} not set within {timeout} s")
                if left > 0:
                    self._watch(key, revision + 1, left)

    def watch(self, key: str, timeout: float, cancel: threading.Event | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the next change of ``key`` (a put or a
        delete); whether one came. False early when the member asked fails (the caller
        looks again), and once ``cancel`` is set and :meth:`end_watches` called."""
        _, revision = self._range(key, serializable=True)
        return self._watch(key, revision + 1, timeout, cancel)

    def _watch(
        self, key: str, start_revision: int, timeout: float, cancel: threading.Event | None = None
    ) -> bool:
        """Return at the first event on ``key`` from ``start_revision`` (True), or at
        ``timeout``, on a failure, or once ``cancel`` is set (False)."""
        return self._watches.follow(key, self._key(key), start_revision, timeout, cancel)

    # -- liveness: one lease per store (per node) -------------------------------------

    def set_ephemeral(self, key: str, value: bytes, ttl: float) -> None:
        """Set ``key`` under this store's lease (granted at first use with ``ttl`` seconds).

        A named thread refreshes the lease every ``ttl / 3`` s until :meth:`close`,
        which revokes it: the key vanishes at once on a clean exit and ``ttl``
        seconds after a crash, as judged by etcd (no clock of ours involved). After a
        stall past ``ttl`` (etcd dropped the lease), it is written again under a new
        lease (:mod:`relaunch.store._etcd_lease`).
        """
        self._lease.put(self._key(key), _b64(value), ttl)

    def claim_ephemeral(self, key: str, value: bytes, ttl: float) -> bool:
        """Create ``key`` under this store's lease unless it exists (as
        :meth:`set_ephemeral`, but not written again after a stall: another node may
        hold it by then); whether this call created it. A call sent again after a
        member applied it and did not answer finds the key there: it is this call's
        when it holds ``value`` under this store's lease (a lock its node would
        otherwise hold, unknowing, for as long as it lives)."""
        return self._lease.claim(self._key(key), _b64(value), ttl)

    def keys_with_prefix(self, prefix: str) -> list[str]:
        """The keys that start with ``prefix`` (one range request)."""
        return list(self._scan(prefix, keys_only=True))

    def items_with_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with ``prefix``, with its value (one range request)."""
        return self._scan(prefix, keys_only=False)

    def _scan(self, prefix: str, *, keys_only: bool) -> dict[str, bytes]:
        start = (self._prefix + prefix).encode()
        end = start[:-1] + bytes([start[-1] + 1]) if start and start[-1] < 0xFF else b"\0"
        body: dict[str, Any] = {"key": _b64(start), "range_end": _b64(end)}
        if keys_only:
            body["keys_only"] = True
        reply = self._http.post("/kv/range", body)
        cut = len(self._prefix.encode())
        return {_unb64(kv["key"])[cut:].decode(): kv_value(kv) for kv in reply.get("kvs") or []}

    def close(self) -> None:
        """Stop refreshing and revoke the lease (its keys vanish), then close. Idempotent."""
        with self._lock:
            if self._http.closed or self._closed:
                return
            self._closed = True
        self._watches.stop()  # no watch starts from now on
        self._lease.close(self._timeout + 1)
        self._http.close()

    def end_watches(self) -> None:
        """Wake every thread in a watch now (its wait raises StoreConnectionError): a
        socket shut down wakes a blocked read, where closing it would not."""
        self._watches.end()
