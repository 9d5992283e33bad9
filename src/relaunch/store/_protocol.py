"""The narrow seam every key-value store of relaunch sits behind."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Protocol, TypeGuard, runtime_checkable


@runtime_checkable
class Store(Protocol):
    """A key-value store shared by the agents (and, for TCP, by the workers).

    Keys are ``str``; values are ``bytes``. Every method may raise
    :class:`relaunch.errors.StoreConnectionError` when the server cannot be
    reached, and :class:`relaunch.errors.StoreClosedError` after :meth:`close`.
    """

    def get(self, key: str) -> bytes | None:
        """Return the value of ``key`` now, or ``None`` when it is not set. Never waits."""
        ...

    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value``."""
        ...

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bytes, bool]:
        """Set ``key`` to ``desired`` only if it currently holds ``expected``.

        ``expected=None`` means "only if the key is not set". Returns the value the
        key holds afterwards and whether this call wrote it; except that a call found
        written by an earlier send of its own (etcd's, sent again after a member fell
        silent) returns ``(desired, True)`` although another write may have followed.
        """
        ...

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if unset); return the sum."""
        ...

    def delete(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        ...

    def wait(self, keys: list[str], timeout: float) -> None:
        """Block until every key in ``keys`` is set.

        Raises :class:`relaunch.errors.StoreTimeoutError` after ``timeout`` seconds.
        """
        ...

    def close(self) -> None:
        """Release the connection. Idempotent."""
        ...


@runtime_checkable
class BatchStore(Store, Protocol):
    """A store that reads and writes many keys in one round trip (the TCP store)."""

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        """The value of each key now (None where unset), in order. Never waits."""
        ...

    def multi_set(self, items: dict[str, bytes]) -> None:
        """Set every key to its value."""
        ...


@runtime_checkable
class LeaseStore(Store, Protocol):
    """A store with liveness of its own: keys that vanish when their writer stops
    renewing them (etcd leases), and listing by prefix."""

    def set_ephemeral(self, key: str, value: bytes, ttl: float) -> None:
        """Set ``key`` under a lease of ``ttl`` seconds, kept alive while this client lives."""
        ...

    def keys_with_prefix(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix``."""
        ...


@runtime_checkable
class ScanStore(Store, Protocol):
    """A store that reads every key under a prefix in one round trip (etcd's range)."""

    def items_with_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with ``prefix``, with its value."""
        ...


@runtime_checkable
class PeekStore(Store, Protocol):
    """A replicated store that can answer a read from the member it asks, with no
    consensus round (etcd's serializable range): a fraction of a linearizable read's
    cost to the cluster, and possibly a moment behind the newest write (never behind
    this client's own writes while it asks the same member)."""

    def peek(self, key: str) -> bytes | None:
        """The value of ``key`` as the member asked has it (None when unset)."""
        ...


@runtime_checkable
class TicketStore(Store, Protocol):
    """A store that hands out tickets 1, 2, 3... from a counter key in one round trip
    with no retries, where its ``add`` would compare-and-set (etcd: a put's new version
    of the key). Many nodes taking tickets at once then cost O(N) calls, not O(N^2)."""

    def take_ticket(self, key: str) -> int:
        """The next ticket of the counter at ``key`` (the first is 1); each once."""
        ...

    def tickets(self, key: str) -> int:
        """How many tickets of the counter at ``key`` were taken so far."""
        ...


@runtime_checkable
class TurnStore(Store, Protocol):
    """A store whose client shares one connection between its calls and a parked wait
    (:class:`~relaunch.store.TCPStoreClient`): a call made during the wait cuts into it
    (cancelled, then sent again), and a run of calls made :meth:`together` cuts in once."""

    def together(self) -> AbstractContextManager[None]:
        """Hold the connection for the calls this thread makes inside (no wait)."""
        ...


_CAPABLE: dict[tuple[type, type], bool] = {}


def _capable(store: object, capability: type) -> bool:
    """``isinstance(store, capability)`` for one of the protocols above, remembered per
    class. Python 3.11 checks a runtime protocol by looking up each of its members (a
    miss: 14 us; three per node per rendezvous round, one per heartbeat). Not
    remembered for a class with ``__getattr__`` (a proxy: what it has is its target's)."""
    cls = type(store)
    known = _CAPABLE.get((cls, capability))
    if known is None:
        known = isinstance(store, capability)
        if getattr(cls, "__getattr__", None) is None:
            _CAPABLE[(cls, capability)] = known
    return known


def has_batches(store: Store) -> TypeGuard[BatchStore]:
    """Whether ``store`` is a :class:`BatchStore` (remembered per class)."""
    return _capable(store, BatchStore)


def has_leases(store: Store) -> TypeGuard[LeaseStore]:
    """Whether ``store`` is a :class:`LeaseStore` (remembered per class)."""
    return _capable(store, LeaseStore)


def has_scan(store: Store) -> TypeGuard[ScanStore]:
    """Whether ``store`` is a :class:`ScanStore` (remembered per class)."""
    return _capable(store, ScanStore)


def has_peek(store: Store) -> TypeGuard[PeekStore]:
    """Whether ``store`` is a :class:`PeekStore` (remembered per class)."""
    return _capable(store, PeekStore)


def has_tickets(store: Store) -> TypeGuard[TicketStore]:
    """Whether ``store`` is a :class:`TicketStore` (remembered per class)."""
    return _capable(store, TicketStore)


def has_turns(store: Store) -> TypeGuard[TurnStore]:
    """Whether ``store`` is a :class:`TurnStore` (remembered per class)."""
    return _capable(store, TurnStore)


def together(store: Store) -> AbstractContextManager[None]:
    """A run of calls on ``store`` from this thread, made in one turn where its client
    has turns (:class:`TurnStore`: a heartbeat's few calls cut into a parked wait once,
    not once each); elsewhere nothing is held."""
    if has_turns(store):
        return store.together()
    return contextlib.nullcontext()


def take_ticket(store: Store, key: str) -> int:
    """The next ticket of the counter at ``key``: :class:`TicketStore`'s, else ``add``.
    A counter is taken with one of the two only (the keys differ in meaning)."""
    if has_tickets(store):
        return store.take_ticket(key)
    return store.add(key, 1)


def tickets_taken(store: Store, key: str) -> int:
    """How many tickets of the counter at ``key`` were taken (see :func:`take_ticket`)."""
    if has_tickets(store):
        return store.tickets(key)
    return store.add(key, 0)


def peek(store: Store, key: str) -> bytes | None:
    """``key``'s value, read as cheaply as ``store`` can (:class:`PeekStore`), else by
    ``get``: for polls whose answer is only reported, or is checked again by a
    compare-and-set before anything is decided on it."""
    if has_peek(store):
        return store.peek(key)
    return store.get(key)


def get_many(store: Store, keys: list[str]) -> list[bytes | None]:
    """The value of each of ``keys`` now (None where unset), in order: one round trip
    where the store reads many keys at once (:class:`BatchStore`), else one per key."""
    if not keys:
        return []
    if has_batches(store):
        return store.multi_get(keys)
    return [store.get(key) for key in keys]


def set_many(store: Store, items: dict[str, bytes]) -> None:
    """Set every key of ``items``: one round trip where the store can, else one per key."""
    if has_batches(store):
        store.multi_set(items)
        return
    for key, value in items.items():
        store.set(key, value)
