"""A view of a :class:`~relaunch.store.Store` with every key under a prefix."""

from __future__ import annotations

from contextlib import AbstractContextManager

from relaunch.store._protocol import (
    LeaseStore,
    Store,
    get_many,
    has_leases,
    peek,
    set_many,
    take_ticket,
    tickets_taken,
    together,
)

__all__ = ["LeasePrefixStore", "PrefixStore"]


class PrefixStore:
    """Prefix every key with ``prefix`` before it reaches ``store``.

    :meth:`close` does not close the underlying store (its owner does). A PrefixStore
    is a :class:`~relaunch.store.BatchStore` (one round trip when the underlying store
    batches, one per key otherwise) and a :class:`~relaunch.store.TicketStore` (the
    underlying store's tickets, else its ``add``); :meth:`over` keeps leases when the store has them.
    """

    @staticmethod
    def over(store: Store, prefix: str) -> PrefixStore:
        """The prefixed view with every capability ``store`` has."""
        if has_leases(store):
            return LeasePrefixStore(store, prefix)
        return PrefixStore(store, prefix)

    def __init__(self, store: Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def _key(self, key: str) -> str:
        return self.prefix + key

    def get(self, key: str) -> bytes | None:
        return self.store.get(self._key(key))

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self._key(key), value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bytes, bool]:
        return self.store.compare_set(self._key(key), expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._key(key), amount)

    def take_ticket(self, key: str) -> int:
        return take_ticket(self.store, self._key(key))

    def tickets(self, key: str) -> int:
        return tickets_taken(self.store, self._key(key))

    def delete(self, key: str) -> bool:
        return self.store.delete(self._key(key))

    def wait(self, keys: list[str], timeout: float) -> None:
        self.store.wait([self._key(key) for key in keys], timeout)

    def together(self) -> AbstractContextManager[None]:
        return together(self.store)

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        return get_many(self.store, [self._key(key) for key in keys])

    def multi_set(self, items: dict[str, bytes]) -> None:
        set_many(self.store, {self._key(key): value for key, value in items.items()})

    def close(self) -> None:
        """Do nothing: the underlying store belongs to someone else."""


class LeasePrefixStore(PrefixStore):
    """A :class:`PrefixStore` over a :class:`~relaunch.store.LeaseStore`: leases and
    listing go through, with the prefix added (and removed from listed keys)."""

    def __init__(self, store: LeaseStore, prefix: str) -> None:
        super().__init__(store, prefix)
        self._leases = store

    def set_ephemeral(self, key: str, value: bytes, ttl: float) -> None:
        self._leases.set_ephemeral(self._key(key), value, ttl)

    def peek(self, key: str) -> bytes | None:
        return peek(self.store, self._key(key))

    def keys_with_prefix(self, prefix: str) -> list[str]:
        cut = len(self.prefix)
        return [key[cut:] for key in self._leases.keys_with_prefix(self._key(prefix))]
