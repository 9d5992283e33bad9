"""The key-value data of the TCP store server and its waiters, free of any I/O.

The server's event loop owns one :class:`StoreState` and is its only user (no
lock). A *waiter* is any hashable object (the server uses its connection
objects). Operations that may release waiters return the list of waiters that
must now be sent ``STOP_WAITING``; the caller does the sending.

Waiting is event-driven: each missing key keeps the waiters that need it, each
waiter counts the keys it still needs, so a write touches only the waiters of
that key (no polling, no scan over every waiter).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["StoreState"]

W = TypeVar("W", bound=Hashable)

_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1


def _parse_counter(value: bytes, key: bytes) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"value of key {key!r} is not an integer: {value[:32]!r}") from None
    return number


class StoreState(Generic[W]):
    """Keys, values, queues and waiters of one store (torch TCPStore semantics)."""

    def __init__(self, max_value: int | None = None) -> None:
        self.max_value = max_value
        """Longest value a key may reach (appends included); None: no limit."""
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        # key -> waiters that need it (dict for ordered O(1) removal)
        self._waiters: dict[bytes, dict[W, None]] = {}
        # waiter -> (keys it is registered on, keys still missing)
        self._registered: dict[W, list[bytes]] = {}
        self._pending: dict[W, int] = {}
        # barrier key -> waiters; waiter -> its barrier key
        self._barrier_waiters: dict[bytes, dict[W, None]] = {}
        self._barrier_of: dict[W, bytes] = {}

    # ----------------------------------------------------------------- queries

    def get(self, key: bytes) -> bytes:
        """Return the value of ``key``, or ``b""`` when it is not set (as torch)."""
        return self._data.get(key, b"")

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is set."""
        return key in self._data

    def check(self, keys: Iterable[bytes]) -> bool:
        """Whether every key is set (or names a non-empty queue)."""
        return all(self._ready(key) for key in keys)

    def num_keys(self) -> int:
        """Number of keys set (queues not counted)."""
        return len(self._data)

    def list_keys(self) -> list[bytes]:
        """Every key set (queues not included)."""
        return list(self._data)

    def queue_len(self, key: bytes) -> int:
        """Length of the queue ``key`` (0 when it does not exist)."""
        queue = self._queues.get(key)
        return len(queue) if queue is not None else 0

    def waiter_count(self) -> int:
        """Number of waiters blocked in a wait or barrier."""
        return len(self._pending) + len(self._barrier_of)

    def _ready(self, key: bytes) -> bool:
        if key in self._data:
            return True
        queue = self._queues.get(key)
        return bool(queue)

    # ------------------------------------------------------------------ writes

    def set(self, key: bytes, value: bytes) -> list[W]:
        """Set ``key``; return the waiters released."""
        self._data[key] = value
        return self._key_ready(key)

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> tuple[bytes, list[W]]:
        """Torch's compare-and-set; return (the reply value, waiters released).

        A missing key is set when ``expected`` is empty; otherwise the reply is
        ``expected`` itself and nothing is written (torch's behaviour).
        """
        current = self._data.get(key)
        if current is None:
            if expected:
                return expected, []
            self._data[key] = desired
            return desired, self._key_ready(key)
        if current == expected:
            self._data[key] = desired
            return desired, []
        return current, []

    def add(self, key: bytes, delta: int) -> tuple[int, list[W]]:
        """Add ``delta`` to the integer at ``key`` (0 if unset).

        Raises ``ValueError`` when the value is not an integer or the sum leaves int64.
        """
        current = self._data.get(key)
        total = delta if current is None else _parse_counter(current, key) + delta
        if not _I64_MIN <= total <= _I64_MAX:
            raise ValueError(f"add on key {key!r} overflows int64")
        self._data[key] = str(total).encode()
        return total, self._key_ready(key) if current is None else []

    def append(self, key: bytes, value: bytes) -> list[W]:
        """Append ``value`` to the value of ``key`` (set it when unset)."""
        current = self._data.get(key)
        if current is None:
            self._data[key] = value
            return self._key_ready(key)
        if self.max_value is not None and len(current) + len(value) > self.max_value:
            raise ValueError(
                f"append to key {key[:80]!r} would make a value of "
                f"{len(current) + len(value)} bytes, over the store's limit of {self.max_value}"
            )
        self._data[key] = current + value
        return []

    def delete(self, key: bytes) -> int:
        """Delete ``key``; return how many keys were deleted (0 or 1)."""
        return 1 if self._data.pop(key, None) is not None else 0

    def queue_push(self, key: bytes, value: bytes) -> list[W]:
        """Push onto the queue ``key``; release at most one waiter."""
        self._queues.setdefault(key, deque()).append(value)
        waiters = self._waiters.get(key)
        while waiters:
            waiter = next(iter(waiters))
            del waiters[waiter]
            if self._decrement(waiter):
                break
        else:
            self._waiters.pop(key, None)
            return []
        if not waiters:
            self._waiters.pop(key, None)
        return [waiter]

    def queue_pop(self, key: bytes) -> tuple[int, bytes | None]:
        """Pop the head of the queue ``key``: (length before the pop, value or None)."""
        queue = self._queues.get(key)
        if not queue:
            return 0, None
        length = len(queue)
        value = queue.popleft()
        if not queue:
            del self._queues[key]
        return length, value

    # ----------------------------------------------------------------- waiting

    def wait(self, keys: list[bytes], waiter: W) -> bool:
        """Register ``waiter`` on the missing keys; return True when all are ready now."""
        self.cancel(waiter)
        missing = [key for key in dict.fromkeys(keys) if not self._ready(key)]
        if not missing:
            return True
        for key in missing:
            self._waiters.setdefault(key, {})[waiter] = None
        self._registered[waiter] = missing
        self._pending[waiter] = len(missing)
        return False

    def barrier(self, key: bytes, world_size: int, waiter: W) -> tuple[bool, list[W]]:
        """Count ``waiter`` in at the barrier ``key``.

        Returns (whether this waiter may go now, the earlier waiters released).
        """
        self.cancel(waiter)
        count, woken = self.add(key, 1)
        if count >= world_size:
            released = self._barrier_waiters.pop(key, {})
            for other in released:
                del self._barrier_of[other]
            return True, [*woken, *released]
        self._barrier_waiters.setdefault(key, {})[waiter] = None
        self._barrier_of[waiter] = key
        return False, woken

    def cancel(self, waiter: W) -> None:
        """Forget every wait and barrier of ``waiter`` (CANCEL_WAIT, disconnect)."""
        keys = self._registered.pop(waiter, None)
        if keys is not None:
            del self._pending[waiter]
            for key in keys:
                waiters = self._waiters.get(key)
                if waiters is not None:
                    waiters.pop(waiter, None)
                    if not waiters:
                        del self._waiters[key]
        barrier_key = self._barrier_of.pop(waiter, None)
        if barrier_key is not None:
            waiters = self._barrier_waiters.get(barrier_key)
            if waiters is not None:
                waiters.pop(waiter, None)
                if not waiters:
                    del self._barrier_waiters[barrier_key]

    def _key_ready(self, key: bytes) -> list[W]:
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return []
        return [waiter for waiter in waiters if self._decrement(waiter)]

    def _decrement(self, waiter: W) -> bool:
        left = self._pending[waiter] - 1
        if left:
            self._pending[waiter] = left
            return False
        del self._pending[waiter]
        del self._registered[waiter]
        return True
