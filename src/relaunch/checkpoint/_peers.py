"""Copies of every node's snapshots on another node, moved by the agents.

Each agent serves its snapshot directory over TCP (:class:`SnapshotServer`, the
messages of ``_wire``) and, in every rendezvous round, publishes in the round's store
where it serves and which global ranks its workers run
(``relaunch/snapshot_peer/<group rank>``). The nodes of a round form a ring: the node
of group rank g keeps copies of the snapshots of the node of group rank g-1 (mod the
round's size), pulled by a thread every half second (:class:`PeerCopies`), so one lost
node never takes both copies of a snapshot. The copies sit in the node's snapshot
directory in the same layout as its own ranks' (``rank-N/step-N``), written under a
partial name, their length and CRC-32 checked against the manifest, then renamed;
they mirror the source: the same newest ``keep`` steps, a step whose CRC changed (a
timeline the job left after a restore) fetched again.

Before a round's workers start, a node whose memory has no snapshot of a rank it now
runs (a spare or a later node that took a lost node's ranks, ranks that moved when the
nodes were ranked again) fetches that rank's newest snapshot from whichever node of the
round holds it. Standard library only: the agent never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint import _wire as wire
from relaunch.errors import StoreError
from relaunch.store import Store

__all__ = [
    "PeerCopies",
    "PeerRecord",
    "SnapshotServer",
    "ack",
    "fetch_step",
    "held_steps",
    "list_steps",
]

log = logging.getLogger(__name__)

_KEY = "relaunch/snapshot_peer/"
_PINS = ".peer-pins"
_CHUNK = 1 << 20
_BUFFERS = 4
_MAX_CONNECTIONS = 64
_LONG_POLL = 1.0
"""Seconds a list with ``since`` or a wait_ack waits before it answers anyway."""
_SUCCESSOR_START = 15.0
"""Seconds after a round started within which the successor's first poll is awaited."""
_SUCCESSOR_GONE = 3.0
"""Seconds without a poll after which this node has no successor (its workers stop
waiting for copies)."""
_LOOPBACK = ("127.", "::1", "::ffff:127.")


@dataclass(frozen=True)
class PeerRecord:
    """Where a node of the round serves its snapshots, and the global ranks it runs."""

    addr: str
    port: int
    ranks: tuple[int, ...]

    def to_bytes(self) -> bytes:
        doc = {"v": 1, "addr": self.addr, "port": self.port, "ranks": list(self.ranks)}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, key: str) -> PeerRecord:
        """WireError naming ``key`` and the field when the record is not one."""
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise wire.WireError(f"{key}: not JSON ({exc})") from exc
        ok = isinstance(doc, dict) and doc.get("v") == 1
        if not ok:
            raise wire.WireError(f"{key}: expected a version 1 peer record, got {raw[:120]!r}")
        addr, port, ranks = doc.get("addr"), doc.get("port"), doc.get("ranks")
        if not isinstance(addr, str) or not addr:
            raise wire.WireError(f"{key}: addr: expected a host, got {addr!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise wire.WireError(f"{key}: port: expected 1-65535, got {port!r}")
        if not isinstance(ranks, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
        ):
            raise wire.WireError(f"{key}: ranks: expected a list of ranks, got {ranks!r}")
        return cls(addr, port, tuple(ranks))


def held_steps(root: str) -> wire.Steps:
    """``(step, crc32)`` of every complete snapshot under ``root``, by rank, newest first
    (a snapshot whose manifest cannot be read is left out)."""
    out: wire.Steps = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if not (name.startswith("rank-") and name[5:].isdigit()):
                continue
            rank_root = os.path.join(root, name)
            pairs = []
            for step in layout.complete_steps(rank_root):
                try:
                    m = layout.read_manifest(layout.step_dir(rank_root, step))
                except layout.CorruptSnapshot:
                    continue
                pairs.append((step, m.crc32))
            if pairs:
                out[int(name[5:])] = pairs
    return out


# -- the server ----------------------------------------------------------------------------
class SnapshotServer:
    """Serves this node's snapshot directory to the other agents of the job and to its
    own workers: a listening thread and a thread per connection (at most 64 at once),
    each named and joined.

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
        allowed: frozenset[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._root = root
        self._job = job
        self._allowed = allowed
        self._clock = clock
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._version = 0
        self._acked: dict[int, tuple[int, int]] = {}
        self._successor_seen = -1e9
        self._expect_successor_until = -1e9
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="relaunch-snapshot-server", daemon=True
        )
        self._acceptor.start()

    def set_allowed(self, allowed: frozenset[str] | None) -> None:
        """The addresses admitted besides loopback (the round's nodes); None: any."""
        self._allowed = allowed

    def expect_successor(self, within: float | None) -> None:
        """A round started: a successor will poll within ``within`` seconds (None: this
        node has none, its workers never wait for a copy)."""
        with self._changed:
            self._successor_seen = -1e9
            now = self._clock()
            self._expect_successor_until = -1e9 if within is None else now + within
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
        for t in threads:
            t.join(10.0)
            if t.is_alive():
                log.warning("%s did not end within 10 s", t.name)
        shutil.rmtree(os.path.join(self._root, _PINS), ignore_errors=True)

    def _accept_loop(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._admits(peer[0]):
                log.warning("snapshot server: refused a connection from %s", peer[0])
                conn.close()
                continue
            with self._lock:
                self._threads = {t for t in self._threads if t.is_alive()}
                if len(self._threads) >= _MAX_CONNECTIONS:
                    conn.close()
                    continue
                n += 1
                t = threading.Thread(
                    target=self._serve, args=(conn,), name=f"relaunch-snapshot-conn-{n}"
                )
                t.daemon = True
                self._threads.add(t)
            t.start()

    def _admits(self, host: str) -> bool:
        allowed = self._allowed
        return allowed is None or host.startswith(_LOOPBACK) or host in allowed

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30.0)
            try:
                request = wire.decode_request(wire.read_line(conn, wire.MAX_REQUEST), self._job)
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
            except wire.WireError as exc:
                log.warning("snapshot server: %s", exc)
                with contextlib.suppress(OSError):
                    conn.sendall(wire.encode({"ok": False, "error": str(exc)}))
            except OSError as exc:  # the peer went away mid-answer: its own retry
                log.debug("snapshot server: %s", exc)

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
        ranks = {str(r): [list(p) for p in s] for r, s in held_steps(self._root).items()}
        return wire.encode({"ok": True, "ranks": ranks, "version": version})

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


# -- the client ----------------------------------------------------------------------------
def _connect(addr: str, port: int, timeout: float) -> socket.socket:
    sock = socket.create_connection((addr, port), timeout=timeout)
    sock.settimeout(timeout)
    with contextlib.suppress(OSError):  # fewer, larger reads of a snapshot's bytes
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    return sock


def list_steps(
    addr: str, port: int, job: str, *, since: int | None = None, timeout: float = 10.0
) -> tuple[wire.Steps, int]:
    """What a peer holds, and the version of its snapshots (with ``since``: once they
    changed after that version, or a second passed). OSError when the peer cannot be
    reached, WireError for a bad answer."""
    doc: dict[str, object] = {"job": job, "op": "list"}
    if since is not None:
        doc["since"] = since
    return wire.decode_listing(wire.ask(addr, port, doc, timeout))


def ack(addr: str, port: int, job: str, rank: int, step: int, crc: int) -> None:
    """Tell a peer that this node holds its snapshot of ``rank`` at ``step``."""
    doc = {"job": job, "op": "ack", "rank": rank, "step": step, "crc": crc}
    raw = wire.ask(addr, port, doc, 10.0)
    wire.check_ok(raw, "ack answer")


def fetch_step(
    addr: str, port: int, job: str, rank: int, step: int, root: str, timeout: float = 30.0
) -> int:
    """Copy a peer's snapshot of ``rank`` at ``step`` into ``root`` (replacing one of the
    same step); return its bytes. It is written under a partial name and kept only when
    its manifest is one and its data has the manifest's length and CRC-32: else
    WireError (nothing kept). OSError when the peer cannot be reached."""
    rank_root = layout.rank_dir(root, rank)
    partial = layout.partial_dir(rank_root, step)
    with _connect(addr, port, timeout) as sock:
        sock.sendall(wire.encode({"job": job, "op": "get", "rank": rank, "step": step}))
        text, nbytes = wire.decode_answer(wire.read_line(sock, wire.MAX_ANSWER))
        os.makedirs(partial, exist_ok=True)
        try:
            with open(os.path.join(partial, layout.MANIFEST), "w", encoding="utf-8") as f:
                f.write(text)
            try:
                m = layout.read_manifest(partial)
            except layout.CorruptSnapshot as exc:
                raise wire.WireError(f"rank {rank} step {step} from {addr}: {exc}") from exc
            if (m.job, m.rank, m.step, m.nbytes) != (job, rank, step, nbytes):
                raise wire.WireError(
                    f"rank {rank} step {step} from {addr}: the manifest says job {m.job!r} "
                    f"rank {m.rank} step {m.step} {m.nbytes} bytes, the answer {nbytes}"
                )
            crc = _receive(sock, os.path.join(partial, layout.DATA), nbytes)
            if crc != m.crc32:
                raise wire.WireError(
                    f"rank {rank} step {step} from {addr}: CRC-32 {crc:#010x}, the manifest "
                    f"says {m.crc32:#010x} (changed while sent?)"
                )
            final = layout.step_dir(rank_root, step)
            if os.path.exists(final):
                shutil.rmtree(final, ignore_errors=True)
            os.rename(partial, final)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return nbytes


def _receive(sock: socket.socket, path: str, nbytes: int) -> int:
    """Write ``nbytes`` from ``sock`` to ``path``; return their CRC-32. Two threads: this
    one receives into a few buffers while a writer checksums and writes the full ones
    (zlib and the write release the GIL: the two overlap on two cores)."""
    free: queue.Queue[bytearray] = queue.Queue()
    full: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
    for _ in range(_BUFFERS):
        free.put(bytearray(_CHUNK))
    crc, failed = [0], []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    def write() -> None:
        try:
            while (item := full.get()) is not None:
                buf, n = item
                view = memoryview(buf)[:n]
                crc[0] = zlib.crc32(view, crc[0])
                while view:
                    view = view[os.write(fd, view) :]
                free.put(buf)
        except OSError as exc:
            failed.append(exc)
            free.put(bytearray(_CHUNK))  # the receiver is not left waiting

    writer = threading.Thread(target=write, name="relaunch-snapshot-receive", daemon=True)
    writer.start()
    done = 0
    try:
        while done < nbytes and not failed:
            buf = free.get()
            view, n = memoryview(buf), 0
            while n < len(buf) and done + n < nbytes:
                got = sock.recv_into(view[n : min(len(buf), nbytes - done)])
                if not got:
                    raise wire.WireError(
                        f"the peer closed with {nbytes - done - n} of {nbytes} bytes unsent"
                    )
                n += got
            full.put((buf, n))
            done += n
    finally:
        full.put(None)
        writer.join(60.0)
        os.close(fd)
    if failed:
        raise failed[0]
    return crc[0]


# -- the node's service --------------------------------------------------------------------
@dataclass(frozen=True)
class _Round:
    store: Store
    group_rank: int
    world_size: int
    ranks: tuple[int, ...]


class PeerCopies:
    """This node's part of the peer copies: it serves the node's snapshots (to its
    successor, to nodes taking over ranks, and to its own workers waiting for their
    copies), pulls its ring predecessor's, and fetches the ranks it takes over before
    their workers start. ``round_started`` is called by the agent (through the
    launcher) once per round; ``close`` ends its threads."""

    def __init__(self, root: str, job: str, *, bind: str) -> None:
        self._root = root
        self._job = job
        self._server = SnapshotServer(root, job, bind)
        self._round: _Round | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._puller: threading.Thread | None = None
        self.pulled_bytes = 0
        self.pulls = 0
        """Pulls from the predecessor done (each: a list, then the copy it lacked)."""
        self.fetched: dict[int, int] = {}
        """Global rank -> step fetched before the workers started (the last round's)."""
        self._last_ranks: tuple[int, ...] = ()

    @property
    def port(self) -> int:
        """The port this node's workers reach the server at (on loopback)."""
        return self._server.port

    def round_started(
        self,
        store: Store,
        *,
        group_rank: int,
        world_size: int,
        ranks: Iterable[int],
        addr: str,
        allowed: frozenset[str] | None,
    ) -> None:
        """Publish where this node serves, fetch the snapshots of ranks this node runs
        and does not hold, and pull the predecessor's from now on. Never raises: a
        snapshot that cannot be had is restored from elsewhere or not at all (load())."""
        current = _Round(store, group_rank, world_size, tuple(sorted(ranks)))
        with self._lock:
            self._round = None  # no pull from the last round's ring meanwhile
        self._server.set_allowed(allowed)
        # this round's successor starts polling when it started the round too
        self._server.expect_successor(_SUCCESSOR_START if world_size > 1 else None)
        try:  # first: the other nodes of the round may fetch from this one meanwhile
            record = PeerRecord(addr, self._server.port, current.ranks)
            store.set(f"{_KEY}{group_rank}", record.to_bytes())
        except StoreError as exc:
            log.warning("snapshots: cannot offer this node's snapshots to its peers: %s", exc)
            return
        if world_size > 1 and current.ranks != self._last_ranks:
            self._fetch_missing(current)
        self._last_ranks = current.ranks
        with self._lock:
            self._round = current
        if world_size > 1 and self._puller is None:
            self._puller = threading.Thread(
                target=self._pull_loop, name="relaunch-snapshot-puller", daemon=True
            )
            self._puller.start()

    def close(self) -> None:
        self._stop.set()
        if self._puller is not None:
            self._puller.join(60.0)
            if self._puller.is_alive():
                log.warning("the snapshot puller did not end within 60 s")
        self._server.close()

    def _peer(self, r: _Round, group_rank: int, timeout: float) -> PeerRecord | None:
        key = f"{_KEY}{group_rank}"
        try:
            if timeout > 0:
                r.store.wait([key], timeout=timeout)
            raw = r.store.get(key)
            return None if raw is None else PeerRecord.from_bytes(raw, key)
        except (StoreError, wire.WireError) as exc:
            log.debug("snapshots: no peer record of node %s: %s", group_rank, exc)
            return None

    def _fetch_missing(self, r: _Round) -> None:
        """Before the workers start on ranks this node did not run in its last round:
        each one's newest snapshot is fetched from the node of the round that holds the
        newest, when that is newer than the one here (none here: a spare or a later
        node taking a lost node's ranks; an old copy: ranks that moved)."""
        held = {rank: steps[0][0] for rank, steps in held_steps(self._root).items()}
        missing = list(r.ranks)
        self.fetched = {}
        t0 = time.monotonic()
        offers: dict[int, list[tuple[int, PeerRecord]]] = {}
        deadline = t0 + 5.0  # the round's nodes publish as they start it, all at once
        for g in range(r.world_size):
            left = max(0.001, deadline - time.monotonic())
            rec = None if g == r.group_rank else self._peer(r, g, timeout=left)
            if rec is None:
                continue
            try:
                steps, _ = list_steps(rec.addr, rec.port, self._job)
            except (OSError, wire.WireError) as exc:
                log.warning("snapshots: cannot list node %s's snapshots: %s", g, exc)
                continue
            for rank in missing:
                for step, _crc in steps.get(rank, [])[:1]:
                    if step > held.get(rank, -1):
                        offers.setdefault(rank, []).append((step, rec))
        moved = 0
        for rank in missing:
            for step, rec in sorted(offers.get(rank, []), key=lambda o: -o[0]):
                try:
                    moved += fetch_step(rec.addr, rec.port, self._job, rank, step, self._root)
                    self.fetched[rank] = step
                    break
                except (OSError, wire.WireError) as exc:
                    log.warning("snapshots: rank %s step %s from %s: %s", rank, step, rec.addr, exc)
        if self.fetched:
            seconds = time.monotonic() - t0
            ranks = ", ".join(f"{k} (step {v})" for k, v in sorted(self.fetched.items()))
            print(
                f"relaunch: snapshots: fetched ranks {ranks} from the nodes that hold them, "
                f"before their workers start ({moved / 1e6:.1f} MB in {seconds:.2f} s)",
                file=sys.stderr,
                flush=True,
            )

    def _pull_loop(self) -> None:
        version: int | None = None
        source: PeerRecord | None = None
        while not self._stop.is_set():
            with self._lock:
                r = self._round
            if r is None or r.world_size <= 1:
                self._stop.wait(0.1)
                continue
            try:
                found = self._peer(r, (r.group_rank - 1) % r.world_size, timeout=0)
                if found != source:
                    source, version = found, None  # a new predecessor: start over
                if source is None:
                    self._stop.wait(0.2)
                    continue
                version = self._pull(r, source, version)
                self.pulls += 1
            except (OSError, wire.WireError) as exc:  # the predecessor is gone or busy
                log.debug("snapshots: pull from the predecessor: %s", exc)
                version = None
                self._stop.wait(0.2)
            except Exception:
                log.exception("snapshots: pulling the predecessor's snapshots failed; retrying")
                version = None
                self._stop.wait(1.0)

    def _pull(self, r: _Round, source: PeerRecord, version: int | None) -> int:
        """One long poll of the predecessor: once its snapshots changed, copy the newest
        of each of its ranks that this node lacks, tell it so, and drop the copies of a
        timeline it left. Returns the version seen."""
        theirs, seen = list_steps(source.addr, source.port, self._job, since=version)
        mine = held_steps(self._root)
        for rank in source.ranks:
            if rank in r.ranks or self._stop.is_set():
                continue  # never overwrite what this node's own workers write
            wanted = theirs.get(rank, [])
            if not wanted:
                continue  # the source has none (yet): ours may be the only copy
            have = dict(mine.get(rank, []))
            newest, crc = wanted[0]
            if have.get(newest) != crc:  # only the newest moves: the older one is being
                # reused by the source's next save
                self.pulled_bytes += fetch_step(
                    source.addr, source.port, self._job, rank, newest, self._root
                )
            ack(source.addr, source.port, self._job, rank, newest, crc)
            # what the source still has, as it has it; nothing of a timeline it left
            keep = {newest} | {step for step, c in wanted if have.get(step) == c}
            rank_root = layout.rank_dir(self._root, rank)
            for step in have:
                if step not in keep:
                    shutil.rmtree(layout.step_dir(rank_root, step), ignore_errors=True)
        return seen
