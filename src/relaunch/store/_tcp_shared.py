"""A TCPStore client's main connection, shared by the client's threads: calls take turns
on it, and one wait at a time parks on it, stepping aside whenever a call needs it.

torch's protocol answers a connection's requests in order and a WAIT only once its keys
are set, so a connection with a wait in flight carries nothing else. A client that gave
every wait a connection of its own held two per node (its calls, its waits): 32,768
connections to the store at 16,384 nodes, past a server's open-file limit, and a
connect in the middle of each node's first wait. Here the first wait goes on the main
connection; a call that finds it parked there cancels it (CANCEL_WAIT, answered by
WAIT_CANCELED, after a STOP_WAITING when the keys were set meanwhile), makes its
request, and the wait is sent again with the time it has left: three more messages
per call made during a wait, or per run of calls a thread makes :meth:`together`
(a heartbeat's: its key, the steward's, the node's spent keys). Waits made while
the main connection already carries one go to the client's pool of wait connections,
each a :class:`SharedConnection` that no call uses.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from relaunch.errors import StoreClosedError, StoreError
from relaunch.store import _tcp_wire as wire
from relaunch.store._tcp_conn import Connection, ProtocolError

__all__ = ["SharedConnection"]

T = TypeVar("T")

_CANCEL = bytes([wire.Query.CANCEL_WAIT])


class SharedConnection:
    """The main connection: :meth:`call` in turn, :meth:`wait` parked between calls.

    ``connect`` opens a connection (raising :class:`StoreError` when it cannot),
    ``broken`` turns a socket error into the error the client raises, and every reply
    comes within ``reply_timeout`` seconds. The connection is opened again by the next
    call after one broke.
    """

    def __init__(
        self,
        conn: Connection,
        connect: Callable[[], Connection],
        broken: Callable[[BaseException], StoreError],
        reply_timeout: float,
    ) -> None:
        self._conn: Connection | None = conn
        self._connect = connect
        self._broken = broken
        self._reply_timeout = reply_timeout
        self._lock = threading.Lock()  # the turn: one request and its reply at a time
        self._gate = threading.Condition()  # guards the fields below
        self._pending = 0  # calls waiting for the turn
        self._parked = False  # a WAIT is in flight, not cancelled
        self._cancelled = False  # its CANCEL_WAIT was sent
        self._seat_taken = False  # a wait uses this connection
        self._parking = False  # that wait is about to be sent (again): calls hold back
        self._closed = False
        self._holder: int | None = None  # the thread holding the turn for a run of calls

    def call(self, request: bytes, parse: Callable[[Connection], T]) -> T:
        """Send ``request`` and read its reply with ``parse``, in this thread's turn."""
        with self._turn():
            conn = self._open()
            try:
                conn.send(request, self._reply_timeout)
                return parse(conn)
            except OSError as exc:
                self._drop(conn)
                raise self._broken(exc) from exc

    def wait(self, request: bytes, timeout: float) -> bool | None:
        """Send the WAIT ``request`` here: True once its keys are set, False after
        ``timeout`` seconds (cancelled), None when another wait already uses this
        connection (the caller takes one of its own)."""
        with self._gate:
            if self._seat_taken or self._closed or self._holder == threading.get_ident():
                return None
            self._seat_taken = True
        deadline = time.monotonic() + timeout
        try:
            while True:
                outcome = self._wait_once(request, deadline)
                if outcome is not None:
                    return outcome
        finally:
            with self._gate:
                self._seat_taken = False

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Hold the turn for every call this thread makes inside (nested: the outer one
        holds it): a wait parked here is cancelled once for the run and sent again after
        it, not once per call. A wait made inside takes another connection (None)."""
        if self._holder == threading.get_ident():
            yield
            return
        with self._turn():
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    @property
    def connected(self) -> bool:
        """Whether a connection is open now (False after one broke, until the next call)."""
        return self._conn is not None and not self._closed

    def drop(self) -> None:
        """Close the connection (its replies cannot be trusted); the next call reconnects."""
        with self._turn():
            if self._conn is not None:
                self._drop(self._conn)

    def close(self) -> None:
        """Close the connection for good; a call or wait blocked on it returns."""
        with self._gate:
            self._closed = True
            conn = self._conn
        if conn is not None:  # unblock a reply being read, then take the turn
            conn.shutdown()
        with self._lock:
            if self._conn is not None:
                self._drop(self._conn)

    # --------------------------------------------------------------- internals

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """Hold the connection; a wait parked on it is cancelled to make room. A wait
        that was cut into parks again before the next call cuts in: it sees its keys
        at least once between two calls, however busy the other threads. In a run of
        calls :meth:`together`, its thread holds the turn already."""
        if self._holder == threading.get_ident():
            yield
            return
        with self._gate:
            self._gate.wait_for(lambda: not self._parking)
            self._pending += 1
        try:
            with self._gate:
                self._cancel_parked()
            self._lock.acquire()
        finally:
            with self._gate:
                self._pending -= 1
                self._gate.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    def _cancel_parked(self) -> None:
        """With the gate held: send CANCEL_WAIT for the wait in flight, once."""
        if self._parked and not self._cancelled and self._conn is not None:
            self._cancelled = True
            with contextlib.suppress(OSError):  # the waiter sees the broken connection
                self._conn.send(_CANCEL)

    def _wait_once(self, request: bytes, deadline: float) -> bool | None:
        """One WAIT in flight: True (keys set), False (deadline), None (a call cut in:
        send it again)."""
        try:
            with self._gate:  # new calls hold back; the ones already in line go first
                self._parking = True
                self._gate.wait_for(lambda: not self._pending)
            self._lock.acquire()
        except BaseException:  # (an interrupt) calls must not wait for a park that never comes
            self._done_parking()
            raise
        try:
            conn = self._park(request)
            return self._outcome(conn, deadline)
        finally:
            self._lock.release()

    def _park(self, request: bytes) -> Connection:
        """Send the WAIT (the turn held) and let calls in line behind it again."""
        try:
            conn = self._open()
            with self._gate:
                if self._closed:  # (close then sees this connection, or we see it)
                    raise StoreClosedError("the TCP store client was closed")
                try:
                    conn.send(request, self._reply_timeout)
                except OSError as exc:
                    self._drop(conn)
                    raise self._broken(exc) from exc
                self._parked, self._cancelled = True, False
        finally:
            self._done_parking()
        return conn

    def _done_parking(self) -> None:
        with self._gate:
            self._parking = False
            self._gate.notify_all()

    def _outcome(self, conn: Connection, deadline: float) -> bool | None:
        """Read the parked WAIT's reply (the turn held): True, False or None as
        :meth:`_wait_once`."""
        try:
            timed_out = False
            try:
                reply = conn.u8(max(deadline - time.monotonic(), 1e-3))
            except TimeoutError as exc:
                if exc.errno is not None:  # (ETIMEDOUT: the server's machine fell silent)
                    raise
                timed_out = True
                with self._gate:
                    self._cancel_parked()
                reply = conn.u8(self._reply_timeout)
            with self._gate:
                cancelled, self._parked, self._cancelled = self._cancelled, False, False
            if reply == wire.WaitResponse.STOP_WAITING:
                if cancelled and conn.u8(self._reply_timeout) != wire.WaitResponse.WAIT_CANCELED:
                    raise ProtocolError("unexpected reply to CANCEL_WAIT after STOP_WAITING")
                return True
            if reply != wire.WaitResponse.WAIT_CANCELED or not cancelled:
                raise ProtocolError(f"unexpected reply {reply} to WAIT")
            # cut into: the WAIT sent has seen its keys unset; past the deadline, that is final
            return False if timed_out or time.monotonic() >= deadline else None
        except BaseException as exc:  # a reply may be left unread: the connection goes
            with self._gate:
                self._parked = self._cancelled = False
            self._drop(conn)
            if isinstance(exc, OSError):
                raise self._broken(exc) from exc
            raise

    def _open(self) -> Connection:
        """The connection, opened again if the last one broke (the turn held)."""
        if self._closed:
            raise StoreClosedError("the TCP store client was closed")
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    def _drop(self, conn: Connection) -> None:
        """Close ``conn`` (the turn held) and forget it."""
        conn.close()
        if self._conn is conn:
            self._conn = None
