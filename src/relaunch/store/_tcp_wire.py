"""The byte layout of torch's TCPStore protocol (torch 2.13), shared by our server and client.

Every request is one query-type byte followed by its arguments; every integer is
little-endian (torch writes native x86/ARM order). A *string* or *bytes* argument
is a ``u64`` length followed by that many bytes. Requests and their replies::

    VALIDATE     u32 magic                          -> (nothing)
    SET          key, value                         -> (nothing)
    COMPARE_SET  key, expected, desired             -> bytes (value afterwards)
    GET          key                                -> bytes (empty when unset)
    ADD          key, i64 delta                     -> i64 (new value)
    CHECK        u64 n, n keys                      -> u8 READY(0) / NOT_READY(1)
    WAIT         u64 n, n keys                      -> u8 STOP_WAITING(0) once all are set
    GETNUMKEYS                                      -> i64
    DELETE_KEY   key                                -> i64 (number deleted)
    APPEND       key, value                         -> (nothing)
    MULTI_GET    u64 n, n keys                      -> n x bytes
    MULTI_SET    i64 n, n x (key, value)            -> (nothing)
    CANCEL_WAIT                                     -> u8 WAIT_CANCELED(1)
    PING         u32 nonce                          -> u32 nonce
    QUEUE_PUSH   key, value                         -> (nothing)
    QUEUE_POP    key                                -> i64 length, then bytes if length > 0
    QUEUE_LEN    key                                -> i64
    LIST_KEYS                                       -> i64 n, n x key
    BARRIER      key, i64 world_size                -> u8 STOP_WAITING(0) once reached

A connection must start with VALIDATE carrying :data:`VALIDATION_MAGIC`.
"""

from __future__ import annotations

import enum
import struct

__all__ = [
    "HTTP_REPLY",
    "MAX_KEY_COUNT",
    "MAX_KEY_LEN",
    "MAX_VALUE_LEN",
    "VALIDATION_MAGIC",
    "CheckResponse",
    "HttpRequest",
    "Incomplete",
    "MalformedRequest",
    "Query",
    "Reader",
    "WaitResponse",
    "is_http",
    "pack_bytes",
    "pack_i64",
    "pack_len",
    "pack_u32",
    "pack_u64",
]

VALIDATION_MAGIC = 0x3C85F7CE
"""The number a client sends first to show it speaks this protocol."""

MAX_KEY_LEN = 64 * 1024
"""Longest key accepted (torch's libuv server accepts 8 KiB)."""

MAX_VALUE_LEN = 32 * 1024 * 1024
"""Longest value a server accepts by default (a rendezvous state of 10,000 nodes is
about 2 MB); :class:`~relaunch.store.tcp.TCPStoreServer` takes another limit."""

MAX_KEY_COUNT = 128 * 1024
"""Most keys in one CHECK / WAIT / MULTI_GET / MULTI_SET request (as torch)."""


class Query(enum.IntEnum):
    """The query-type byte that starts every request."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


class CheckResponse(enum.IntEnum):
    """Reply byte of CHECK."""

    READY = 0
    NOT_READY = 1


class WaitResponse(enum.IntEnum):
    """Reply byte of WAIT, BARRIER and CANCEL_WAIT."""

    STOP_WAITING = 0
    WAIT_CANCELED = 1


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


def pack_u32(value: int) -> bytes:
    """Encode an unsigned 32-bit integer."""
    return _U32.pack(value)


def pack_u64(value: int) -> bytes:
    """Encode an unsigned 64-bit integer."""
    return _U64.pack(value)


def pack_i64(value: int) -> bytes:
    """Encode a signed 64-bit integer."""
    return _I64.pack(value)


def pack_len(length: int) -> bytes:
    """Encode the ``u64`` length that precedes a string or bytes argument."""
    return _U64.pack(length)


def pack_bytes(value: bytes) -> bytes:
    """Encode a string or bytes argument: ``u64`` length, then the bytes."""
    return _U64.pack(len(value)) + value


class Incomplete(Exception):
    """The buffer does not hold a whole request yet (internal control flow)."""


class MalformedRequest(Exception):
    """The bytes cannot be a valid request; the connection must be dropped."""


class HttpRequest(MalformedRequest):
    """The connection began as an HTTP request, not this protocol: a browser or ``curl``
    pointed at the store's port, or ``relaunch status`` asking whether an etcd member
    listens there (its ``/version``). Answered with :data:`HTTP_REPLY`, then dropped."""


_HTTP_METHODS = (b"GET ", b"HEAD ", b"POST ", b"PUT ", b"DELETE ", b"OPTIONS ", b"PATCH ")

_HTTP_TEXT = b"This port serves a TCP store (torch's c10d store protocol), not HTTP.\n"

HTTP_REPLY = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_HTTP_TEXT), _HTTP_TEXT)
)
"""What a connection that began as an HTTP request is told before it is dropped."""


def is_http(head: bytes) -> bool:
    """Whether ``head``, a connection's first bytes, begins an HTTP request (a method
    and a space); :class:`Incomplete` while it is too short to tell."""
    for method in _HTTP_METHODS:
        if head.startswith(method):
            return True
        if method.startswith(head):
            raise Incomplete
    return False


class Reader:
    """Reads typed fields from a buffer, raising :class:`Incomplete` past its end."""

    __slots__ = ("_buf", "_end", "max_value", "pos")

    def __init__(
        self, buf: bytes | bytearray | memoryview, pos: int = 0, *, max_value: int = MAX_VALUE_LEN
    ) -> None:
        self._buf = buf
        self._end = len(buf)
        self.pos = pos
        self.max_value = max_value

    def _take(self, size: int) -> int:
        start = self.pos
        if start + size > self._end:
            raise Incomplete
        self.pos = start + size
        return start

    def head(self, size: int) -> bytes:
        """Up to ``size`` bytes from the current position, which does not move."""
        return bytes(self._buf[self.pos : min(self.pos + size, self._end)])

    def u8(self) -> int:
        """Read one unsigned byte."""
        return self._buf[self._take(1)]

    def u32(self) -> int:
        """Read an unsigned 32-bit integer."""
        value: int = _U32.unpack_from(self._buf, self._take(4))[0]
        return value

    def u64(self) -> int:
        """Read an unsigned 64-bit integer."""
        value: int = _U64.unpack_from(self._buf, self._take(8))[0]
        return value

    def i64(self) -> int:
        """Read a signed 64-bit integer."""
        value: int = _I64.unpack_from(self._buf, self._take(8))[0]
        return value

    def count(self) -> int:
        """Read a key count (``u64`` on the wire), refusing absurd ones."""
        value = self.u64()
        if value > MAX_KEY_COUNT:
            raise MalformedRequest(f"key count {value} exceeds {MAX_KEY_COUNT}")
        return value

    def key(self) -> bytes:
        """Read a key, refusing one longer than :data:`MAX_KEY_LEN`."""
        return self._blob(MAX_KEY_LEN, "key")

    def value(self) -> bytes:
        """Read a value, refusing one longer than :attr:`max_value` (as soon as its length
        is read: the bytes are never buffered)."""
        return self._blob(self.max_value, "value")

    def _blob(self, limit: int, what: str) -> bytes:
        size = self.u64()
        if size > limit:
            raise MalformedRequest(f"{what} length {size} exceeds {limit}")
        start = self._take(size)
        return bytes(self._buf[start : start + size])
