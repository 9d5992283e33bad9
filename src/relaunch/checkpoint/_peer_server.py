"""The snapshot server of one agent: its node's snapshot directory, served over TCP.

The other agents of the job (the ring successor that keeps copies, a node taking over
ranks) and the node's own workers (waiting for their copies' acks) talk to it with the
messages of ``_wire``; :mod:`._peer_client` is the other end. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint import _wire as wire
from relaunch.checkpoint._channel import IDLE_TIMEOUT, no_delay

__all__ = ["SnapshotServer", "held_steps"]

log = logging.getLogger(__name__)

_PINS = ".peer-pins"
_SHORT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_PAUSE = 0.25  # seconds before an accept short of descriptors is tried again
_MAX_CONNECTIONS = 1024
"""Connections served at once. Each local worker keeps one (``--nproc-per-node cpu``
can mean a hundred or more), each successor's puller one, a node fetching ranks a few."""
_LONG_POLL = 1.0
"""Seconds a list with ``since`` or a wait_ack waits before it answers anyway."""
_SUCCESSOR_GONE = 3.0
"""Seconds without a poll after which this node has no successor (its workers stop
waiting for copies)."""
_LOOPBACK = ("127.", "::1", "::ffff:127.")


def _nobody(host: str) -> bool:
    """No host but loopback (a guarded server before its first round)."""
    return False


def held_steps(root: str) -> wire.Steps:
    """``(step, crc32)`` of every complete snapshot under ``root``, by rank, newest first
    (a snapshot whose manifest cannot be read is left out)."""
    out: wire.Steps = {}
    for rank, steps in layout.held_ranks(root).items():
        rank_root = layout.rank_dir(root, rank)
        pairs = []
        for step in steps:
            try:
                m = layout.read_manifest(layout.step_dir(rank_root, step))
            except layout.CorruptSnapshot:
                continue
            pairs.append((step, m.crc32))
        if pairs:
            out[rank] = pairs
    return out


class SnapshotServer:
    """Serves this node's snapshot directory to the other agents of the job and to its
    own workers: a listening thread and a thread per connection (at most 1,024 at once),
    each named and joined. A connection carries request after request
    (:class:`~._channel.Channel`) until its client closes it or is quiet for
    ``idle_timeout`` seconds.

    It also keeps what makes a snapshot count as copied: the version of the node's
    snapshots (a worker's ``saved`` wakes the successor's long poll at once), the
    newest ``ack`` of the successor per rank, and when the successor last asked (a
    worker waits for an ack only while a successor polls)."""

    def __init__(
        self,
        root: str,
        job: str,
        host: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        idle_timeout: float = IDLE_TIMEOUT,
        guarded: bool = False,
    ) -> None:
        """``guarded`` (a job secret): a host other than loopback is refused until
        :meth:`set_admits` says which may connect (the first round's)."""
        self._root = root
        self._idle_timeout = idle_timeout
        self._job = job
        self._admits: Callable[[str], bool] | None = _nobody if guarded else None
        """Whether a host other than loopback may connect (None: any)."""
        self._clock = clock
        v6 = ":" in host  # "::" serves IPv4 too, its peers as ::ffff:a.b.c.d
        self._sock = socket.create_server(
            (host, 0),
            family=socket.AF_INET6 if v6 else socket.AF_INET,
            dualstack_ipv6=v6 and socket.has_dualstack_ipv6(),
        )
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        """The connections being served: closing the server ends them."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._version = 0
        self._settled = True
        self._acked: dict[int, tuple[int, int]] = {}
        self._successor_seen = -1e9
        self._expect_successor_until = -1e9
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="relaunch-snapshot-server", daemon=True
        )
        self._acceptor.start()

    @property
    def open_connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._conns)

    def set_admits(self, admits: Callable[[str], bool] | None) -> None:
        """Asked whether a host other than loopback may connect (with a job secret: the
        round's nodes, and a node of the job that joined after the round); None: any."""
        self._admits = admits

    def expect_successor(self, within: float | None) -> None:
        """A round started: a successor will poll within ``within`` seconds (None: this
        node has none, its workers never wait for a copy)."""
        with self._changed:
            self._successor_seen = -1e9
            now = self._clock()
            self._expect_successor_until = -1e9 if within is None else now + within
            self._changed.notify_all()

    @contextlib.contextmanager
    def settling(self) -> Iterator[None]:
        """Inside: this node fetches the snapshots of the ranks it runs this round, and
        its listings say so (its successor mirrors none of them meanwhile)."""
        with self._changed:
            self._settled = False
        try:
            yield
        finally:
            with self._changed:
                self._settled = True
                self._version += 1  # the successor's long poll: look again
                self._changed.notify_all()

    def _has_successor(self) -> bool:  # under the lock
        now = self._clock()
        if now < self._expect_successor_until or now - self._successor_seen < _SUCCESSOR_GONE:
            return True
        if self._expect_successor_until > 0 and self._successor_seen < 0:
            log.warning(
                "snapshots: this node's successor in the ring has not asked for its "
                "snapshots (port %s) since the round started: they have no copy on another "
                "node (can the other nodes reach this port?)",
                self.port,
            )
            self._expect_successor_until = -1e9  # said once a round
        return False

    def close(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self._acceptor.join(5.0)
        self._sock.close()
        with self._lock:
            threads = list(self._threads)
            for conn in self._conns:  # a thread waiting for the next request wakes
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(10.0)
            if t.is_alive():
                log.warning("%s did not end within 10 s", t.name)
        shutil.rmtree(os.path.join(self._root, _PINS), ignore_errors=True)

    def _accept_loop(self) -> None:
        n = 0
        short = False  # (out of file descriptors: said once until an accept succeeds)
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set() or exc.errno not in _SHORT_OF_FILES:
                    return  # (closed)
                # No file descriptor left (the agent's other servers may hold them):
                # the peer waits in the backlog (this loop ended for good before)
                if not short:
                    log.warning("snapshot server: cannot accept a connection (%s): tries "
                                "again every %.2f s", exc.strerror or exc, _PAUSE)  # fmt: skip
                short = True
                self._stop.wait(_PAUSE)
                continue
            short = False
            host = peer[0].removeprefix("::ffff:")
            vetted = self._admits is None or host.startswith(_LOOPBACK)
            no_delay(conn)
            with self._lock:
                self._threads = {t for t in self._threads if t.is_alive()}
                if len(self._threads) >= _MAX_CONNECTIONS:
                    log.warning("snapshot server: %s connections open, refused one more",
                                len(self._threads))  # fmt: skip
                    conn.close()
                    continue
                n += 1
                t = threading.Thread(
                    target=self._serve,
                    args=(conn, None if vetted else host),
                    name=f"relaunch-snapshot-conn-{n}",
                )
                t.daemon = True
                self._threads.add(t)
                self._conns.add(conn)
                if self._stop.is_set():  # (close took the list already)
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)
            t.start()

    def _serve(self, conn: socket.socket, unknown: str | None) -> None:
        """Answer the requests on ``conn`` until the client closes it or stays quiet for
        the idle timeout; first, for a host other than loopback (``unknown``), ask
        whether it may connect (here, not in the acceptor: the answer may read the
        rendezvous store)."""
        try:
            with conn:
                admits = self._admits
                if unknown is not None and admits is not None and not admits(unknown):
                    log.warning("snapshot server: refused a connection from %s", unknown)
                    return
                conn.settimeout(self._idle_timeout)
                self._requests(conn)
        finally:
            with self._lock:
                self._conns.discard(conn)

    def _requests(self, conn: socket.socket) -> None:
        """A request refused is answered so, and the next one read: its line was read
        whole. A line that is not one (too long, cut short) ends the connection."""
        try:
            while not self._stop.is_set():
                line = wire.next_line(conn, wire.MAX_REQUEST)
                if line is None:
                    return
                try:
                    self._answer(conn, wire.decode_request(line, self._job))
                except wire.WireError as exc:
                    self._refuse(conn, exc)
        except wire.WireError as exc:
            self._refuse(conn, exc)
        except OSError as exc:  # the peer went away, or stayed quiet: its own retry
            log.debug("snapshot server: %s", exc)

    def _refuse(self, conn: socket.socket, exc: wire.WireError) -> None:
        log.warning("snapshot server: %s", exc)
        with contextlib.suppress(OSError):
            conn.sendall(wire.encode({"ok": False, "error": str(exc)}))

    def _answer(self, conn: socket.socket, request: wire.Request) -> None:
        match request:
            case wire.Get():
                self._send_step(conn, request)
            case wire.ListSteps(since=since):
                conn.sendall(self._listing(since))
            case wire.Ack(rank=rank, step=step, crc=crc):
                with self._changed:
                    self._acked[rank] = (step, crc)
                    self._changed.notify_all()
                conn.sendall(wire.encode({"ok": True}))
            case wire.Saved(rank=rank, step=step):
                with self._changed:
                    if self._acked.get(rank, (-1, 0))[0] >= step:
                        del self._acked[rank]  # the job went back: a new timeline
                    self._version += 1
                    self._changed.notify_all()
                    peer = self._has_successor()
                conn.sendall(wire.encode({"ok": True, "peer": peer}))
            case wire.WaitAck():
                acked, peer = self._wait_ack(request)
                conn.sendall(wire.encode({"ok": True, "acked": acked, "peer": peer}))

    def _listing(self, since: int | None) -> bytes:
        with self._changed:
            if since is not None:  # a successor's long poll: from now on its polls say
                self._successor_seen = self._clock()  # whether it is there
                self._expect_successor_until = -1e9
                deadline = self._clock() + _LONG_POLL
                while self._version <= since and not self._stop.is_set():
                    left = deadline - self._clock()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                self._successor_seen = self._clock()
            version = self._version
            settled = self._settled
        ranks = {str(r): [list(p) for p in s] for r, s in held_steps(self._root).items()}
        return wire.encode({"ok": True, "ranks": ranks, "version": version, "settled": settled})

    def _wait_ack(self, w: wire.WaitAck) -> tuple[bool, bool]:
        """Whether the successor holds ``w``'s snapshot (or a newer one of its timeline),
        waiting up to a long poll; and whether there is a successor to wait for."""
        with self._changed:
            deadline = self._clock() + _LONG_POLL
            while True:
                got = self._acked.get(w.rank)
                done = got is not None and (got[0] > w.step or got == (w.step, w.crc))
                peer = self._has_successor()
                left = deadline - self._clock()
                if done or not peer or left <= 0 or self._stop.is_set():
                    return done, peer
                self._changed.wait(min(left, 0.25))

    def _send_step(self, conn: socket.socket, get: wire.Get) -> None:
        folder = layout.step_dir(layout.rank_dir(self._root, get.rank), get.step)
        link = None
        try:
            # pinned, so the saver does not reuse the file for its next snapshot, and
            # open: a prune that removes the folder now leaves both readable
            link = layout.pin(os.path.join(folder, layout.DATA), os.path.join(self._root, _PINS))
            with (
                open(os.path.join(folder, layout.MANIFEST), "rb") as mf,
                open(link, "rb") as df,
            ):
                manifest = mf.read(wire.MAX_ANSWER // 2).decode("utf-8", errors="replace")
                nbytes = os.fstat(df.fileno()).st_size
                conn.sendall(wire.encode({"ok": True, "manifest": manifest, "nbytes": nbytes}))
                if nbytes:
                    conn.sendfile(df, 0, nbytes)
        except FileNotFoundError as exc:
            raise wire.WireError(f"no snapshot of rank {get.rank} at step {get.step}") from exc
        finally:
            if link is not None:
                with contextlib.suppress(OSError):
                    os.unlink(link)
