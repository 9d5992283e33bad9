"""Pure logic of the TCP store server: data, waiters, queues, barriers, wire parsing."""

from __future__ import annotations

import pytest

from relaunch.store import _tcp_wire as wire
from relaunch.store._tcp_state import StoreState


def test_set_get_delete_count() -> None:
    state: StoreState[str] = StoreState()
    assert state.get(b"k") == b""
    assert state.set(b"k", b"v") == []
    assert state.get(b"k") == b"v"
    assert state.num_keys() == 1
    assert state.list_keys() == [b"k"]
    assert state.delete(b"k") == 1
    assert state.delete(b"k") == 0
    assert state.num_keys() == 0


def test_compare_set_follows_torch() -> None:
    state: StoreState[str] = StoreState()
    assert state.compare_set(b"k", b"x", b"y") == (b"x", [])  # missing, expected given: no write
    assert not state.contains(b"k")
    assert state.compare_set(b"k", b"", b"a") == (b"a", [])
    assert state.compare_set(b"k", b"zz", b"b") == (b"a", [])
    assert state.compare_set(b"k", b"a", b"b") == (b"b", [])
    assert state.get(b"k") == b"b"


def test_add_and_append() -> None:
    state: StoreState[str] = StoreState()
    assert state.add(b"n", 5)[0] == 5
    assert state.add(b"n", -7)[0] == -2
    assert state.get(b"n") == b"-2"
    state.set(b"s", b"abc")
    with pytest.raises(ValueError, match="not an integer"):
        state.add(b"s", 1)
    with pytest.raises(ValueError, match="overflows"):
        state.add(b"n", -(2**63))
    state.append(b"a", b"x")
    state.append(b"a", b"y")
    assert state.get(b"a") == b"xy"


def test_wait_releases_only_when_every_key_is_set() -> None:
    state: StoreState[str] = StoreState()
    state.set(b"a", b"1")
    assert state.wait([b"a"], "w0") is True
    assert state.wait([b"a", b"b", b"c"], "w1") is False
    assert state.wait([b"b"], "w2") is False
    assert state.waiter_count() == 2
    assert state.set(b"b", b"") == ["w2"]
    assert state.set(b"b", b"again") == []
    assert state.add(b"c", 1)[1] == ["w1"]
    assert state.waiter_count() == 0


def test_cancel_forgets_the_waiter() -> None:
    state: StoreState[str] = StoreState()
    assert state.wait([b"a", b"b"], "w") is False
    state.cancel("w")
    assert state.waiter_count() == 0
    assert state.set(b"a", b"") == []
    assert state.set(b"b", b"") == []
    state.cancel("unknown")


def test_many_waiters_on_one_key() -> None:
    state: StoreState[int] = StoreState()
    for waiter in range(1000):
        assert state.wait([b"k"], waiter) is False
    assert sorted(state.append(b"k", b"x")) == list(range(1000))


def test_queue_push_pop_and_waiters() -> None:
    state: StoreState[str] = StoreState()
    assert state.queue_pop(b"q") == (0, None)
    assert state.wait([b"q"], "w1") is False
    assert state.wait([b"q"], "w2") is False
    assert state.queue_push(b"q", b"1") == ["w1"]
    assert state.check([b"q"])
    assert state.queue_len(b"q") == 1
    assert state.queue_push(b"q", b"2") == ["w2"]
    assert state.queue_pop(b"q") == (2, b"1")
    assert state.queue_pop(b"q") == (1, b"2")
    assert state.queue_len(b"q") == 0
    assert not state.check([b"q"])
    assert state.queue_push(b"q", b"3") == []


def test_barrier() -> None:
    state: StoreState[str] = StoreState()
    assert state.barrier(b"b", 3, "w1") == (False, [])
    assert state.barrier(b"b", 3, "w2") == (False, [])
    ready, woken = state.barrier(b"b", 3, "w3")
    assert ready and sorted(woken) == ["w1", "w2"]
    assert state.waiter_count() == 0
    assert state.barrier(b"c", 2, "w1") == (False, [])
    state.cancel("w1")
    assert state.waiter_count() == 0


def test_reader_incomplete_and_limits() -> None:
    data = bytes([wire.Query.SET]) + wire.pack_bytes(b"key") + wire.pack_bytes(b"value")
    for cut in range(len(data)):
        reader = wire.Reader(data[:cut])
        with pytest.raises(wire.Incomplete):
            reader.u8()
            reader.key()
            reader.value()
    reader = wire.Reader(data)
    assert (reader.u8(), reader.key(), reader.value()) == (wire.Query.SET, b"key", b"value")
    assert reader.pos == len(data)
    with pytest.raises(wire.MalformedRequest, match="key length"):
        wire.Reader(wire.pack_u64(wire.MAX_KEY_LEN + 1)).key()
    with pytest.raises(wire.MalformedRequest, match="value length"):
        wire.Reader(wire.pack_u64(2**63)).value()
    with pytest.raises(wire.MalformedRequest, match="key count"):
        wire.Reader(wire.pack_u64(wire.MAX_KEY_COUNT + 1)).count()
