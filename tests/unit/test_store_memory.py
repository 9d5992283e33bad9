"""MemoryStore and PrefixStore: the Store protocol in-process."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from relaunch.errors import StoreClosedError, StoreTimeoutError
from relaunch.store import MemoryStore, PrefixStore, has_batches, has_leases, has_tickets


def test_operations() -> None:
    store = MemoryStore()
    assert store.get("k") is None
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert store.compare_set("k", b"x", b"y") == (b"v", False)
    assert store.compare_set("k", b"v", b"y") == (b"y", True)
    assert store.compare_set("n", None, b"1") == (b"1", True)
    assert store.compare_set("n", None, b"2") == (b"1", False)
    assert store.compare_set("none", b"x", b"2") == (b"", False)
    assert store.add("c", 2) == 2 and store.add("c", -1) == 1
    assert store.delete("k") and not store.delete("k")
    with pytest.raises(StoreTimeoutError, match="never"):
        store.wait(["n", "never"], 0.01)
    store.close()
    store.close()
    with pytest.raises(StoreClosedError):
        store.get("n")


def test_wait_is_woken_by_the_write_and_by_close() -> None:
    store = MemoryStore()
    started = threading.Event()

    def waiter(key: str) -> None:
        started.set()
        store.wait([key], 60)

    with ThreadPoolExecutor(1, thread_name_prefix="test-mem") as pool:
        done = pool.submit(waiter, "a")
        started.wait(10)
        store.set("a", b"1")
        done.result(timeout=30)
        started.clear()
        closed = pool.submit(waiter, "b")
        started.wait(10)
        store.close()
        with pytest.raises(StoreClosedError):
            closed.result(timeout=30)


def test_prefix_store() -> None:
    store = MemoryStore()
    view = PrefixStore(store, "round/1/")
    view.set("x", b"1")
    assert store.get("round/1/x") == b"1"
    assert view.add("n", 1) == 1
    assert view.compare_set("x", b"1", b"2") == (b"2", True)
    view.wait(["x"], 1)
    assert view.delete("x")
    view.close()  # does not close the underlying store
    assert store.get("round/1/n") == b"1"
    store.close()


def test_a_prefix_store_batches_and_keeps_leases_only_where_the_store_has_them() -> None:
    from relaunch.store import BatchStore, LeasePrefixStore, LeaseStore

    store = MemoryStore()
    view = PrefixStore.over(store, "round/1/")
    assert isinstance(view, BatchStore) and not isinstance(view, LeaseStore)
    view.multi_set({"a": b"1", "b": b"2"})
    assert store.get("round/1/a") == b"1"
    assert view.multi_get(["a", "b", "c"]) == [b"1", b"2", None]

    class Leases(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.ttls: dict[str, float] = {}

        def set_ephemeral(self, key: str, value: bytes, ttl: float) -> None:
            self.set(key, value)
            self.ttls[key] = ttl

        def keys_with_prefix(self, prefix: str) -> list[str]:
            return [k for k in ("round/1/alive/n1", "other") if k.startswith(prefix)]

    leases = Leases()
    lview = PrefixStore.over(leases, "round/1/")
    assert isinstance(lview, LeasePrefixStore) and isinstance(lview, LeaseStore)
    lview.set_ephemeral("alive/n1", b"1", 5.0)
    assert leases.ttls == {"round/1/alive/n1": 5.0}
    assert lview.keys_with_prefix("alive/") == ["alive/n1"]


class _Batched(MemoryStore):
    """The in-memory store with the batch calls of a :class:`BatchStore`."""

    def multi_get(self, keys: list[str]) -> list[bytes | None]:
        return [self.get(key) for key in keys]

    def multi_set(self, items: dict[str, bytes]) -> None:
        for key, value in items.items():
            self.set(key, value)


class _Proxy:
    """A store proxy answering through ``__getattr__`` (what it has is its target's)."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_capabilities_are_asked_of_each_proxy_not_remembered_for_its_class() -> None:
    # a store's capabilities are remembered per class (a runtime protocol check walks
    # every member); a proxy's class says nothing of what its target has
    plain, batched = MemoryStore(), _Batched()
    try:
        assert not has_batches(plain) and has_batches(batched)
        assert not has_batches(plain)  # (remembered: the same answer)
        assert has_batches(_Proxy(batched))
        assert not has_batches(_Proxy(plain))
        assert has_batches(_Proxy(batched))
        assert not has_leases(batched) and not has_tickets(batched)
    finally:
        plain.close()
        batched.close()
