"""One handler per query type of torch's TCPStore protocol (see :mod:`._tcp_wire`).

A handler reads the whole request first (raising :class:`wire.Incomplete` before
touching anything when bytes are missing), then applies it to the
:class:`StoreState`, queues its reply with the client's ``reply`` and returns the
*other* waiters released by the request (they must be sent ``STOP_WAITING``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

from relaunch.store import _tcp_wire as wire
from relaunch.store._tcp_state import StoreState

__all__ = ["STOP", "Client", "handle"]

STOP = bytes([wire.WaitResponse.STOP_WAITING])
_CANCELED = bytes([wire.WaitResponse.WAIT_CANCELED])
_READY = bytes([wire.CheckResponse.READY])
_NOT_READY = bytes([wire.CheckResponse.NOT_READY])


class Client(Hashable, Protocol):
    """What a handler needs of a connection: a way to queue reply bytes."""

    def reply(self, *parts: bytes) -> None:
        """Queue ``parts`` to be sent in order; a large part may be kept, not copied
        (a stored value read by many clients is held once)."""


_State = StoreState[Client]
_Handler = Callable[[_State, Client, wire.Reader], list[Client]]
_NONE: list[Client] = []


def _blob(value: bytes) -> tuple[bytes, bytes]:
    """A value's reply parts: its length, then the value itself (not copied)."""
    return wire.pack_len(len(value)), value


def _keys(r: wire.Reader) -> list[bytes]:
    return [r.key() for _ in range(r.count())]


def _set(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    key, value = r.key(), r.value()
    return s.set(key, value)


def _compare_set(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    key, expected, desired = r.key(), r.value(), r.value()
    result, woken = s.compare_set(key, expected, desired)
    c.reply(*_blob(result))
    return woken


def _get(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    c.reply(*_blob(s.get(r.key())))
    return _NONE


def _add(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    key, delta = r.key(), r.i64()
    total, woken = s.add(key, delta)
    c.reply(wire.pack_i64(total))
    return woken


def _check(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    c.reply(_READY if s.check(_keys(r)) else _NOT_READY)
    return _NONE


def _wait(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    if s.wait(_keys(r), c):
        c.reply(STOP)
    return _NONE


def _num_keys(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    c.reply(wire.pack_i64(s.num_keys()))
    return _NONE


def _delete(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    c.reply(wire.pack_i64(s.delete(r.key())))
    return _NONE


def _append(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    key, value = r.key(), r.value()
    return s.append(key, value)


def _multi_get(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    c.reply(*(part for key in _keys(r) for part in _blob(s.get(key))))
    return _NONE


def _multi_set(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    count = r.i64()
    if not 0 <= count <= wire.MAX_KEY_COUNT:
        raise wire.MalformedRequest(f"multi_set key count {count} out of range")
    pairs = [(r.key(), r.value()) for _ in range(count)]
    woken: list[Client] = []
    for key, value in pairs:
        woken += s.set(key, value)
    return woken


def _cancel_wait(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    s.cancel(c)
    c.reply(_CANCELED)
    return _NONE


def _ping(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    c.reply(wire.pack_u32(r.u32()))
    return _NONE


def _queue_push(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    key, value = r.key(), r.value()
    return s.queue_push(key, value)


def _queue_pop(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    length, value = s.queue_pop(r.key())
    c.reply(wire.pack_i64(length))
    if value is not None:
        c.reply(*_blob(value))
    return _NONE


def _queue_len(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    c.reply(wire.pack_i64(s.queue_len(r.key())))
    return _NONE


def _list_keys(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    keys = s.list_keys()
    c.reply(wire.pack_i64(len(keys)), *(part for k in keys for part in _blob(k)))
    return _NONE


def _barrier(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    key, world_size = r.key(), r.i64()
    ready, woken = s.barrier(key, world_size, c)
    if ready:
        c.reply(STOP)
    return woken


def _validate(s: _State, c: Client, r: wire.Reader) -> list[Client]:
    magic = r.u32()
    if magic != wire.VALIDATION_MAGIC:
        raise wire.MalformedRequest(f"bad validation magic {magic:#x}")
    return _NONE


_HANDLERS: dict[int, _Handler] = {
    wire.Query.VALIDATE: _validate,
    wire.Query.SET: _set,
    wire.Query.COMPARE_SET: _compare_set,
    wire.Query.GET: _get,
    wire.Query.ADD: _add,
    wire.Query.CHECK: _check,
    wire.Query.WAIT: _wait,
    wire.Query.GETNUMKEYS: _num_keys,
    wire.Query.DELETE_KEY: _delete,
    wire.Query.APPEND: _append,
    wire.Query.MULTI_GET: _multi_get,
    wire.Query.MULTI_SET: _multi_set,
    wire.Query.CANCEL_WAIT: _cancel_wait,
    wire.Query.PING: _ping,
    wire.Query.QUEUE_PUSH: _queue_push,
    wire.Query.QUEUE_POP: _queue_pop,
    wire.Query.QUEUE_LEN: _queue_len,
    wire.Query.LIST_KEYS: _list_keys,
    wire.Query.BARRIER: _barrier,
}
_TABLE: list[_Handler | None] = [_HANDLERS.get(q) for q in range(256)]


def handle(state: _State, client: Client, query: int, reader: wire.Reader) -> list[Client]:
    """Apply one request of type ``query``; return the other waiters it released.

    Raises :class:`wire.Incomplete` (nothing applied) when the request is cut short,
    :class:`wire.MalformedRequest` or ``ValueError`` when it is invalid.
    """
    handler = _TABLE[query]
    if handler is None:
        raise wire.MalformedRequest(f"unknown query type {query}")
    return handler(state, client, reader)
