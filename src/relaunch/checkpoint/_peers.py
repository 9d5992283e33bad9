"""Copies of every node's snapshots on another node, moved by the agents.

Each agent serves its snapshot directory over TCP (``_peer_server``, the messages of
``_wire``, ``_peer_client`` the other end, over a kept ``_channel``) and, in every
rendezvous round, publishes in the round's store where it serves and which global
ranks its workers run (``relaunch/snapshot_peer/<group rank>``). The nodes of a round
form a ring: the node of group rank g keeps copies of the snapshots of the node of
group rank g-1 (mod the round's size), pulled by a thread that long-polls it
(:class:`PeerCopies`), so one lost node never takes both copies of a snapshot. The
copies sit in the node's snapshot directory in the same layout as its own ranks'
(``rank-N/step-N``), written under a partial name, their length and CRC-32 checked
against the manifest, then renamed; they mirror the source: the same newest ``keep``
steps, a step whose CRC changed (a timeline the job left after a restore) fetched
again.

Before a round's workers start, a node whose memory has no snapshot of a rank it now
runs (a spare or a later node that took a lost node's ranks, ranks that moved when the
nodes were ranked again) fetches that rank's newest snapshot from whichever node holds
it: the round's, or, when they lack it, the last round's others that still run
(``_fetch``). Standard library only: the agent never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint import _wire as wire
from relaunch.checkpoint._channel import Channel
from relaunch.checkpoint._fetch import Fetch, Need, record
from relaunch.checkpoint._peer_client import ack, fetch_step, list_steps
from relaunch.checkpoint._peer_record import PeerRecord
from relaunch.checkpoint._peer_server import SnapshotServer, held_steps
from relaunch.errors import StoreError
from relaunch.store import Store

__all__ = ["PeerCopies", "PeerRecord", "PeerRound"]

log = logging.getLogger(__name__)

_KEY = "relaunch/snapshot_peer/"
_SUCCESSOR_START = 15.0
"""Seconds after a round started within which the successor's first poll is awaited."""
_REREAD_AFTER = 1.0
"""Seconds between the reads of the predecessor's record while it cannot be reached."""


@dataclass(frozen=True)
class PeerRound:
    """This node's place in a rendezvous round, as the peer copies need it: the round's
    store, its number, this node's group rank among ``world_size`` nodes, the global
    ranks its workers run, the address its peers reach it at, whether a host other than
    loopback may fetch from it (``admits``; None: any); ``earlier``: the stores of the rounds before, newest
    first (a fetch that the round's nodes leave short asks the last round's others)."""

    store: Store
    round_number: int
    group_rank: int
    world_size: int
    ranks: tuple[int, ...]
    addr: str
    admits: Callable[[str], bool] | None = None
    earlier: tuple[Store, ...] = ()


@dataclass(frozen=True)
class _Round:
    store: Store
    group_rank: int
    world_size: int
    ranks: tuple[int, ...]
    started_at: dict[int, int] = field(default_factory=dict, compare=False)
    """This node's ranks' newest steps when their workers started (``_sweep``)."""


class PeerCopies:
    """This node's part of the peer copies: it serves the node's snapshots (to its
    successor, to nodes taking over ranks, and to its own workers waiting for their
    copies), pulls its ring predecessor's, and fetches the ranks it takes over before
    their workers start. ``round_started`` is called by the agent (through the
    launcher) once per round; ``close`` ends its threads."""

    SWEEP_EVERY = 2.0
    """Seconds between the looks for folders of ranks no longer run here (``_sweep``)."""

    def __init__(self, root: str, job: str, *, bind: str, guarded: bool = False) -> None:
        """``guarded`` (a job secret): other hosts are refused until the first round
        says which may connect (:meth:`round_started`)."""
        self._root = root
        self._job = job
        self._server = SnapshotServer(root, job, bind, guarded=guarded)
        self._round: _Round | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._puller: threading.Thread | None = None
        self._source: Channel | None = None
        """The connection to the ring predecessor's server (the puller's)."""
        self.pulled_bytes = 0
        self.pulls = 0
        """Pulls from the predecessor done (each: a list, then the copy it lacked)."""
        self.fetched: dict[int, int] = {}
        """Global rank -> step fetched before the workers started (the last round's)."""
        self._last: tuple[int, tuple[int, ...]] = (-2, ())
        """The last round this node took part in and the ranks it ran there, once the
        fetch before it was complete (else none: the fetch is tried again)."""
        self._ran: tuple[int, tuple[int, ...]] = (-2, ())
        """The same, complete fetch or not: the ranks whose snapshots here its own
        workers wrote in the round just before (:func:`two_timelines`)."""

    @property
    def port(self) -> int:
        """The port this node's workers reach the server at (on loopback)."""
        return self._server.port

    def round_started(self, seat: PeerRound) -> None:
        """Publish where this node serves, fetch the snapshots of ranks this node runs
        and does not hold, and pull the predecessor's from now on. Never raises: a
        snapshot that cannot be had is restored from elsewhere or not at all (load())."""
        store, group_rank, world_size = seat.store, seat.group_rank, seat.world_size
        current = _Round(store, group_rank, world_size, tuple(sorted(seat.ranks)))
        with self._lock:
            self._round = None  # no pull from the last round's ring meanwhile
        self._server.set_admits(seat.admits)
        # this round's successor starts polling when it started the round too
        self._server.expect_successor(_SUCCESSOR_START if world_size > 1 else None)
        with self._server.settling():
            try:  # first: the other nodes of the round may fetch from this one meanwhile
                record = PeerRecord(seat.addr, self._server.port, current.ranks)
                store.set(f"{_KEY}{group_rank}", record.to_bytes())
            except StoreError as exc:
                log.warning("snapshots: cannot offer this node's snapshots to its peers: %s", exc)
                return
            # what this node's own workers wrote is the newest of its ranks only when it
            # ran them in the round just before (a spare that sat out rounds holds old ones)
            self.fetched = {}
            complete = True
            if world_size > 1 and self._last != (seat.round_number - 1, current.ranks):
                ran = self._ran[1] if self._ran[0] == seat.round_number - 1 else ()
                me = (seat.addr, self._server.port)
                need = Need(store, group_rank, world_size, current.ranks, ran, me, seat.earlier)
                fetch = Fetch(self._root, self._job, _KEY)
                try:
                    complete = fetch.run(need)
                except Exception:  # never raises: the workers start with what is here
                    log.exception("snapshots: fetching this node's ranks failed")
                    complete = False
                self.fetched = fetch.fetched
        # a fetch that failed is tried again at the next round
        self._last = (seat.round_number, current.ranks) if complete else (-2, ())
        self._ran = (seat.round_number, current.ranks)
        held = layout.held_ranks(self._root)
        current.started_at.update({rank: held.get(rank, [-1])[0] for rank in current.ranks})
        with self._lock:
            self._round = current
        if world_size > 1 and self._puller is None:
            self._puller = threading.Thread(
                target=self._pull_loop, name="relaunch-snapshot-puller", daemon=True
            )
            self._puller.start()

    def close(self) -> None:
        self._stop.set()
        # the server first: it ends the successor's long poll at once. Every node's
        # puller long-polls its predecessor, and at a job's end every node closes at
        # once: with the servers closed last, each waited out a whole poll (1 s)
        self._server.close()
        if self._source is not None:  # a predecessor gone silent never ends the poll
            self._source.interrupt()
        if self._puller is not None:
            self._puller.join(60.0)
            if self._puller.is_alive():
                log.warning("the snapshot puller did not end within 60 s")
        if self._source is not None:
            self._source.close()

    def _pull_loop(self) -> None:
        version: int | None = None
        source: PeerRecord | None = None
        read_in: _Round | None = None  # the round whose predecessor record is in hand
        read_at = swept_at = 0.0
        while not self._stop.is_set():
            with self._lock:
                r = self._round
            known = r is not None and (r.world_size <= 1 or (r is read_in and source is not None))
            if r is not None and known and time.monotonic() - swept_at >= self.SWEEP_EVERY:
                self._sweep(r, () if source is None or r.world_size <= 1 else source.ranks)
                swept_at = time.monotonic()
            if r is None or r.world_size <= 1:
                self._stop.wait(0.1)
                continue
            try:
                if r is not read_in or source is None:
                    found = record(r.store, f"{_KEY}{(r.group_rank - 1) % r.world_size}", timeout=0)
                    read_in, read_at = r, time.monotonic()
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
                # Gone: a node may take its place in this very round (node tier: a
                # spare fills the vacancy) and publish a record of its own, read here
                # again once a second at most (while it is reachable, never: a round's
                # record changes only then).
                if time.monotonic() - read_at >= _REREAD_AFTER:
                    read_in = None
                self._stop.wait(0.2)
            except Exception:
                log.exception("snapshots: pulling the predecessor's snapshots failed; retrying")
                version, read_in = None, None
                self._stop.wait(1.0)

    def _pull(self, r: _Round, source: PeerRecord, version: int | None) -> int:
        """One long poll of the predecessor: once its snapshots changed, copy the newest
        of each of its ranks that this node lacks, tell it so, and drop the copies of a
        timeline it left. Returns the version seen."""
        peer = self._channel(source)
        theirs, seen, settled = list_steps(peer, self._job, since=version)
        if not settled:  # it fetches its ranks' snapshots: mirrored now, the old copies
            return seen  # it is replacing replaced the job's here. Wait for its end
        mine = held_steps(self._root)
        for rank in source.ranks:
            if rank in r.ranks or self._stop.is_set() or not self._in_round(r):
                continue  # never overwrite what this node's own workers write
            wanted = theirs.get(rank, [])
            if not wanted:
                continue  # the source has none (yet): ours may be the only copy
            have = dict(mine.get(rank, []))
            newest, crc = wanted[0]
            # what the source still has, as it has it; nothing of a timeline it left
            keep = {newest} | {step for step, c in wanted if have.get(step) == c}
            gone = sorted(step for step in have if step not in keep)
            if have.get(newest) != crc:  # only the newest moves: the older one is being
                # reused by the source's next save; a copy that goes lends its pages
                self.pulled_bytes += fetch_step(
                    peer, self._job, rank, newest, self._root,
                    reuse=gone.pop(0) if gone else None, guard=lambda: self._writing(r),
                )  # fmt: skip
            ack(peer, self._job, rank, newest, crc)
            rank_root = layout.rank_dir(self._root, rank)
            with self._writing(r) as ours:
                for step in gone if ours else ():
                    shutil.rmtree(layout.step_dir(rank_root, step), ignore_errors=True)
        return seen

    def _channel(self, source: PeerRecord) -> Channel:
        """The connection to ``source``'s server, kept from pull to pull."""
        peer = self._source
        if peer is None or (peer.addr, peer.port) != (source.addr, source.port):
            if peer is not None:
                peer.close()
            peer = self._source = Channel(source.addr, source.port)
        return peer

    def _sweep(self, r: _Round, theirs: tuple[int, ...]) -> None:
        """Remove the folders of the ranks that neither this node's workers nor its ring
        predecessor's (``theirs``) run: a lost node's copies after the world shrank, a
        past world's ranks. Only once every rank of this node saved in this round (so
        the round's workers restored, and every node fetched what it lacked before
        they could) and past their newest step: no restore takes them then, and they
        hold node memory that saves need."""
        held = layout.held_ranks(self._root)
        own = {rank: held.get(rank, [-1])[0] for rank in r.ranks}
        if not own or any(s <= r.started_at.get(rank, -1) for rank, s in own.items()):
            return  # a rank that has not saved since its workers started (and restored)
        past = min(own.values())
        with self._writing(r) as ours:
            for rank, steps in held.items() if ours else ():
                if rank not in r.ranks and rank not in theirs and steps[0] < past:
                    shutil.rmtree(layout.rank_dir(self._root, rank), ignore_errors=True)
                    log.info(
                        "snapshots: dropped rank %s's (steps %s): no rank here runs it", rank, steps
                    )

    def _in_round(self, r: _Round) -> bool:
        with self._lock:
            return self._round is r

    @contextlib.contextmanager
    def _writing(self, r: _Round) -> Iterator[bool]:
        """Whether the pull of round ``r`` may still change this node's copies, held
        while it does: a round that started meanwhile may have given this node the
        ranks whose copies the pull was making (its workers now write them; the pull
        once deleted their new snapshots), and ``round_started`` waits for the change
        in hand before its workers start."""
        with self._lock:
            yield self._round is r
