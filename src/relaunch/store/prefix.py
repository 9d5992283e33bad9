"""A view of a :class:`~relaunch.store.Store` with every key under a prefix."""

from __future__ import annotations

from relaunch.store._protocol import Store, has_leases
from relaunch.store._view import LeaseView, StoreView

__all__ = ["LeasePrefixStore", "PrefixStore"]


class PrefixStore(StoreView):
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
        super().__init__(store)
        self.prefix = prefix

    def _key(self, key: str) -> str:
        return self.prefix + key

    def close(self) -> None:
        """Do nothing: the underlying store belongs to someone else."""


class LeasePrefixStore(LeaseView, PrefixStore):
    """A :class:`PrefixStore` over a :class:`~relaunch.store.LeaseStore`: leases and
    listing go through, with the prefix added (and removed from listed keys)."""

    def _unkey(self, key: str) -> str:
        return key[len(self.prefix) :]
