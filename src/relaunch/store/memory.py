"""An in-process :class:`~relaunch.store.Store`: a dict behind a condition variable.

For unit tests and for single-process use (several handlers in threads). Every
method is thread-safe; :meth:`MemoryStore.wait` blocks on the condition, so a
waiter is woken by the write it waits for, not by polling.
"""

from __future__ import annotations

import threading
import time

from relaunch.errors import ConfigError, StoreClosedError, StoreTimeoutError

__all__ = ["MemoryStore"]


class MemoryStore:
    """A thread-safe, in-memory key-value store implementing the Store protocol.

    ``ops`` counts the calls made (for benchmarks). After :meth:`close`, every
    method raises :class:`~relaunch.errors.StoreClosedError` and waiters are woken.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.ops = 0

    def _check(self) -> None:
        self.ops += 1
        if self._closed:
            raise StoreClosedError("the memory store is closed")

    def get(self, key: str) -> bytes | None:
        with self._cond:
            self._check()
            return self._data.get(key)

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._check()
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bytes, bool]:
        with self._cond:
            self._check()
            current = self._data.get(key)
            if current != expected:
                return (current if current is not None else b"", False)
            self._data[key] = bytes(desired)
            self._cond.notify_all()
            return (self._data[key], True)

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            self._check()
            raw = self._data.get(key)
            try:
                value = int(raw) if raw is not None else 0
            except ValueError as exc:
                raise ConfigError(f"key {key!r} does not hold an integer: {raw!r}") from exc
            value += amount
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def delete(self, key: str) -> bool:
        with self._cond:
            self._check()
            return self._data.pop(key, None) is not None

    def wait(self, keys: list[str], timeout: float) -> None:
        end = time.monotonic() + timeout
        with self._cond:
            self._check()
            while not all(key in self._data for key in keys):
                left = end - time.monotonic()
                if left <= 0:
                    missing = [key for key in keys if key not in self._data]
                    raise StoreTimeoutError(f"keys {missing} not set within {timeout} s")
                self._cond.wait(left)
                if self._closed:
                    raise StoreClosedError("the memory store was closed while waiting")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
