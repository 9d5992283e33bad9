"""A view of a :class:`~relaunch.store.Store` with every key under a prefix."""

from __future__ import annotations

from relaunch.store._protocol import Store

__all__ = ["PrefixStore"]


class PrefixStore:
    """Prefix every key with ``prefix`` before it reaches ``store``.

    :meth:`close` does not close the underlying store (its owner does).
    """

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

    def delete(self, key: str) -> bool:
        return self.store.delete(self._key(key))

    def wait(self, keys: list[str], timeout: float) -> None:
        self.store.wait([self._key(key) for key in keys], timeout)

    def close(self) -> None:
        """Do nothing: the underlying store belongs to someone else."""
