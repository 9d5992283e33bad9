"""The pass-through under the store views (:class:`~relaunch.store.PrefixStore`,
:class:`~relaunch.store.signed.SignedStore`): each names how a key and a value change
on the way to the underlying store and back; every call goes through those three."""

from __future__ import annotations

from contextlib import AbstractContextManager

from relaunch.store._protocol import (
    LeaseStore,
    Store,
    get_many,
    peek,
    set_many,
    take_ticket,
    tickets_taken,
    together,
)

__all__ = ["LeaseView", "StoreView"]


class StoreView:
    """``store`` seen through :meth:`_key` (a key on its way down), :meth:`_seal` (a
    value on its way down) and :meth:`_open` (a value on its way up); each the identity
    here. A view is a :class:`~relaunch.store.BatchStore` (one round trip when the
    underlying store batches, one per key otherwise) and a
    :class:`~relaunch.store.TicketStore` (the underlying store's tickets, else its
    ``add``). Counters (``add``) pass through as they are."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def _key(self, key: str) -> str:
        return key

    def _seal(self, key: str, value: bytes) -> bytes:
        return value

    def _open(self, key: str, raw: bytes | None) -> bytes | None:
        return raw

    def get(self, key: str) -> bytes | None:
        return self._open(key, self.store.get(self._key(key)))

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self._key(key), self._seal(key, value))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bytes, bool]:
        sealed = None if expected is None else self._seal(key, expected)
        current, written = self.store.compare_set(self._key(key), sealed, self._seal(key, desired))
        return self._open(key, current) or b"", written

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
        raws = get_many(self.store, [self._key(key) for key in keys])
        return [self._open(key, raw) for key, raw in zip(keys, raws, strict=True)]

    def multi_set(self, items: dict[str, bytes]) -> None:
        set_many(self.store, {self._key(k): self._seal(k, v) for k, v in items.items()})

    def close(self) -> None:
        self.store.close()


class LeaseView(StoreView):
    """A :class:`StoreView` over a :class:`~relaunch.store.LeaseStore`: leases, peeks
    and listing go through too (a listed key comes back through :meth:`_unkey`)."""

    store: LeaseStore

    def _unkey(self, key: str) -> str:
        return key

    def set_ephemeral(self, key: str, value: bytes, ttl: float) -> None:
        self.store.set_ephemeral(self._key(key), self._seal(key, value), ttl)

    def peek(self, key: str) -> bytes | None:
        return self._open(key, peek(self.store, self._key(key)))

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return [self._unkey(key) for key in self.store.keys_with_prefix(self._key(prefix))]
