"""A pure-Python client of torch's TCPStore protocol implementing the relaunch Store.

Keys go on the wire as torch's own client writes them (``"/" + key``, or
``"/" + prefix + "/" + key`` with a prefix, as ``PrefixStore``), so this client
and ``torch.distributed.TCPStore`` clients see each other's keys. It works
against our :class:`~relaunch.store.tcp.TCPStoreServer` and torch's server.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from relaunch.errors import (
    ConfigError,
    StoreClosedError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
)
from relaunch.store import _tcp_wire as wire
from relaunch.store._tcp_conn import (
    Connection,
    Dialer,
    ProtocolError,
    keys_request,
    next_nonce,
    one_key,
)
from relaunch.store._tcp_shared import SharedConnection

__all__ = ["TCPStoreClient"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Idle wait connections kept for reuse. Generous on purpose: closing a wait
# connection and opening another while other requests are in flight stalls
# torch's libuv server (it then answers nothing for seconds, so concurrent
# waits time out with their keys set), and torch's own client never churns.
_MAX_IDLE_WAIT_CONNECTIONS = 64

# A longer wait (inf included) waits this long: a socket takes no infinite timeout here.
_LONGEST_WAIT = 1e7


class TCPStoreClient:
    """A :class:`relaunch.store.Store` speaking torch's TCPStore protocol. Thread-safe.

    Connects at construction, retrying until ``timeout`` seconds have passed (the
    server may start a moment later). ``timeout`` also bounds every reply. A later
    reconnection (after the server broke a connection) retries for
    ``reconnect_timeout`` seconds (default: ``timeout``): a client that must notice a
    lost server soon sets it short. A connection also breaks once the server's machine
    acknowledges nothing for ``silent_timeout`` seconds (default: the reconnections'
    patience; its link down: no close ever arrives), while a reply from a live server
    may take up to ``timeout``.
    One connection serves every call and one wait at a time: a call made while a wait
    is in flight cuts in (the wait is cancelled and sent again), so a long wait never
    blocks the other calls of other threads; a second wait made meanwhile takes a
    connection of its own, kept for the next such wait.

    Every method raises :class:`relaunch.errors.StoreConnectionError` when the
    server cannot be reached or breaks the connection (the next call reconnects),
    and :class:`relaunch.errors.StoreClosedError` after :meth:`close`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float = 30.0,
        prefix: str = "",
        reconnect_timeout: float | None = None,
        silent_timeout: float | None = None,
    ) -> None:
        if not isinstance(host, str) or not host:
            raise ConfigError(f"host: expected a non-empty address string, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
            raise ConfigError(f"port: expected an integer in [1, 65535], got {port!r}")
        if not isinstance(prefix, str):
            raise ConfigError(f"prefix: expected a string, got {prefix!r}")
        self._timeout = _seconds("timeout", timeout)
        later = self._timeout  # the reconnections' patience
        if reconnect_timeout is not None:
            later = _seconds("reconnect_timeout", reconnect_timeout)
        silent = later if silent_timeout is None else _seconds("silent_timeout", silent_timeout)
        self._prefix = "/" + prefix + "/" if prefix else "/"
        self._dialer = Dialer(host, port, patience=self._timeout, silent_after=silent)
        self._pool_lock = threading.Lock()
        self._idle_waits: list[SharedConnection] = []
        self._busy_waits: set[SharedConnection] = set()
        self._closed = False
        self._main = self._open_shared()
        self._dialer.patience = later

    # ------------------------------------------------------------------ public

    @property
    def host(self) -> str:
        """The server's host as given."""
        return self._dialer.host

    @property
    def port(self) -> int:
        """The server's port."""
        return self._dialer.port

    @property
    def prefix(self) -> str:
        """The key prefix given at construction ("" for none)."""
        return self._prefix[1:-1]

    def get(self, key: str) -> bytes | None:
        """Return the value of ``key``, or ``None`` when it is not set. Never waits."""
        k = self._key(key)

        def parse(conn: Connection) -> bytes | None:
            ready = conn.u8(self._timeout) == wire.CheckResponse.READY
            value = conn.blob(self._timeout)
            return value if ready else None

        return self._call(keys_request(wire.Query.CHECK, [k]) + one_key(wire.Query.GET, k), parse)

    def _value(self, key: str, value: bytes) -> bytes:
        """``value`` as bytes; StoreError when the server would refuse its size (it drops
        the connection of a client that sends one: better to say why, here)."""
        data = bytes(value)
        if len(data) > wire.MAX_VALUE_LEN:
            raise StoreError(
                f"value of {len(data)} bytes for key {key[:80]!r} exceeds the store's limit "
                f"of {wire.MAX_VALUE_LEN} bytes"
            )
        return data

    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value``; returns once the server has applied it."""
        request = one_key(wire.Query.SET, self._key(key)) + wire.pack_bytes(self._value(key, value))
        self._call_confirmed(request)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bytes, bool]:
        """Set ``key`` to ``desired`` only if it holds ``expected`` (``None``: is unset).

        Returns the value the key holds afterwards (``b""`` when it is unset) and
        whether this call wrote it. As torch's server, an unset key also matches
        ``expected=b""`` and a key holding ``b""`` also matches ``expected=None``.
        """
        k = self._key(key)
        want = b"" if expected is None else bytes(expected)
        data = self._value(key, desired)
        request = b"".join(
            [
                keys_request(wire.Query.CHECK, [k]),
                one_key(wire.Query.GET, k),
                one_key(wire.Query.COMPARE_SET, k),
                wire.pack_bytes(want),
                wire.pack_bytes(data),
            ]
        )

        def parse(conn: Connection) -> tuple[bytes, bool]:
            # the server runs each command once it has it whole: a request that comes in
            # more than one piece (a big state's) may have another client's write run
            # between its GET and its COMPARE_SET. Written: the key matched before, and
            # holds this call's value after
            existed = conn.u8(self._timeout) == wire.CheckResponse.READY
            before = conn.blob(self._timeout)
            after = conn.blob(self._timeout)
            if not existed and want:
                return b"", False
            return after, (before == want or not existed) and after == data

        return self._call(request, parse)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset); return the sum."""
        request = one_key(wire.Query.ADD, self._key(key)) + wire.pack_i64(int(amount))
        return self._call(request, lambda conn: conn.i64(self._timeout))

    def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        request = one_key(wire.Query.DELETE_KEY, self._key(key))
        return self._call(request, lambda conn: conn.i64(self._timeout) == 1)

    def append(self, key: str, value: bytes) -> None:
        """Append ``value`` to the value of ``key`` (set it when unset)."""
        request = one_key(wire.Query.APPEND, self._key(key)) + wire.pack_bytes(
            self._value(key, value)
        )
        self._call_confirmed(request)

    def check(self, keys: list[str]) -> bool:
        """Whether every key in ``keys`` is set now."""
        request = keys_request(wire.Query.CHECK, [self._key(k) for k in keys])
        return self._call(request, lambda c: c.u8(self._timeout) == wire.CheckResponse.READY)

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        """Values of ``keys`` (``None`` for each unset one), read atomically by our server."""
        ks = [self._key(k) for k in keys]
        checks = [keys_request(wire.Query.CHECK, [k]) for k in ks]
        request = b"".join([*checks, keys_request(wire.Query.MULTI_GET, ks)])

        def parse(conn: Connection) -> list[bytes | None]:
            ready = [conn.u8(self._timeout) == wire.CheckResponse.READY for _ in ks]
            values = [conn.blob(self._timeout) for _ in ks]
            return [v if r else None for r, v in zip(ready, values, strict=True)]

        return self._call(request, parse)

    def multi_set(self, items: dict[str, bytes]) -> None:
        """Set several keys in one request."""
        parts = [bytes([wire.Query.MULTI_SET]), wire.pack_i64(len(items))]
        for key, value in items.items():
            parts += [wire.pack_bytes(self._key(key)), wire.pack_bytes(self._value(key, value))]
        self._call_confirmed(b"".join(parts))

    def num_keys(self) -> int:
        """Number of keys on the server (all prefixes, as torch's ``num_keys``)."""
        return self._call(bytes([wire.Query.GETNUMKEYS]), lambda c: c.i64(self._timeout))

    def list_keys(self) -> list[str]:
        """Keys under this client's prefix, without the prefix."""

        def parse(conn: Connection) -> list[str]:
            count = conn.i64(self._timeout)
            if not 0 <= count <= 1 << 32:
                raise ProtocolError(f"list_keys reply announces {count} keys")
            raw = [conn.blob(self._timeout) for _ in range(count)]
            prefix = self._prefix.encode()
            return [k[len(prefix) :].decode() for k in raw if k.startswith(prefix)]

        return self._call(bytes([wire.Query.LIST_KEYS]), parse)

    def wait(self, keys: list[str], timeout: float) -> None:
        """Block until every key in ``keys`` is set.

        Raises :class:`relaunch.errors.StoreTimeoutError` after ``timeout`` seconds
        (the wait is then cancelled on the server; the client stays usable).
        """
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or math.isnan(timeout)
            or timeout < 0
        ):
            raise ConfigError(f"timeout: expected a non-negative number, got {timeout!r}")
        timeout = min(timeout, _LONGEST_WAIT)
        request = keys_request(wire.Query.WAIT, [self._key(k) for k in keys])
        outcome = self._main.wait(request, float(timeout))
        if outcome is None:  # the main connection carries another wait: one of the pool's
            pooled = self._take_wait_connection()
            try:
                outcome = pooled.wait(request, float(timeout))
            except BaseException:
                self._discard_wait_connection(pooled)
                raise
            self._return_wait_connection(pooled)
            if outcome is None:
                raise StoreClosedError("the TCP store client was closed")
        if not outcome:
            raise StoreTimeoutError(f"wait for keys {keys} timed out after {timeout}s")

    def together(self) -> AbstractContextManager[None]:
        """Make this thread's calls inside in one turn on the main connection: a wait
        parked there is cut into once for all of them, not once per call (a heartbeat's
        few calls). No wait inside on this thread takes the main connection."""
        return self._main.together()

    def close(self) -> None:
        """Close every connection (a blocked :meth:`wait` returns). Idempotent."""
        with self._pool_lock:
            if self._closed:
                return
            self._closed = self._dialer.stopped = True
            conns = [*self._idle_waits, *self._busy_waits]
            self._idle_waits.clear()
        for conn in conns:
            conn.close()
        self._main.close()

    def __enter__(self) -> TCPStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TCPStoreClient({self._dialer.host}:{self._dialer.port}, prefix={self.prefix!r})"

    # --------------------------------------------------------------- internals

    def _key(self, key: str) -> bytes:
        return (self._prefix + key).encode()

    def _broken(self, exc: BaseException) -> StoreError:
        if self._closed:
            return StoreClosedError("the TCP store client was closed")
        return StoreConnectionError(
            f"TCP store {self._dialer.host}:{self._dialer.port}: {self._dialer.broke(exc)}"
        )

    def _open_shared(self) -> SharedConnection:
        """A connection opened now, opened again by itself after a break."""
        connect = self._dialer.connect
        return SharedConnection(connect(), connect, self._broken, self._timeout)

    def _call(self, request: bytes, parse: Callable[[Connection], T]) -> T:
        return self._main.call(request, parse)

    def _call_confirmed(self, request: bytes) -> None:
        nonce = next_nonce()
        reply = self._call(
            request + bytes([wire.Query.PING]) + wire.pack_u32(nonce),
            lambda conn: conn.u32(self._timeout),
        )
        if reply != nonce:
            self._main.drop()
            raise StoreConnectionError(
                f"TCP store {self._dialer.host}:{self._dialer.port}: "
                f"ping returned {reply}, expected {nonce}"
            )

    def _take_wait_connection(self) -> SharedConnection:
        with self._pool_lock:
            if self._closed:
                raise StoreClosedError("the TCP store client was closed")
            pooled = self._idle_waits.pop() if self._idle_waits else None
        if pooled is None:
            pooled = self._open_shared()
        with self._pool_lock:
            if self._closed:
                pooled.close()
                raise StoreClosedError("the TCP store client was closed")
            self._busy_waits.add(pooled)
        return pooled

    def _return_wait_connection(self, pooled: SharedConnection) -> None:
        with self._pool_lock:
            self._busy_waits.discard(pooled)
            if (
                not self._closed
                and pooled.connected
                and len(self._idle_waits) < _MAX_IDLE_WAIT_CONNECTIONS
            ):
                self._idle_waits.append(pooled)
                return
        pooled.close()

    def _discard_wait_connection(self, pooled: SharedConnection) -> None:
        with self._pool_lock:
            self._busy_waits.discard(pooled)
        pooled.close()


def _seconds(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{name}: expected a positive number of seconds, got {value!r}")
    return float(value)
