"""Before a round's workers start: the snapshots of the ranks a node now runs and does
not hold, fetched from the nodes that hold them.

First the round's nodes (their records in the round's store). When they leave a rank
of the round with nothing to restore, or with no step that every rank can restore,
the nodes of the round before that are not in this one are asked too, those that still
run: a node whose workers finished and waited at the exit barrier, a node back after
its held seat lapsed, each holding its ranks' newest snapshots and its predecessor's
copies (the round before that when the last one published no node: it never started).
They were the last round's, so their snapshots are of the job's timeline up to this
round's restore; a step that any node (of the round, outside it, this one) holds with
other bytes is taken from none of them, and they count only when they give every rank
a step to restore. Up to :data:`OUTSIDE_MOST` are asked at once (first those that
ran this node's ranks and their ring successors, which hold their copies), within
:data:`OUTSIDE_TIMEOUT` seconds (a lost machine answers nothing), and only then: when
the round holds what it needs, a lost node's address costs the recovery nothing.
Standard library only: the agent never imports torch.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from relaunch.checkpoint import _layout as layout
from relaunch.checkpoint import _wire as wire
from relaunch.checkpoint._channel import Channel, Channels
from relaunch.checkpoint._fetch_choice import fetch_targets, short_of, two_timelines
from relaunch.checkpoint._peer_client import fetch_step, list_steps
from relaunch.checkpoint._peer_record import PeerRecord
from relaunch.checkpoint._peer_server import held_steps
from relaunch.errors import RelaunchError
from relaunch.store import Store, get_many

__all__ = ["OUTSIDE_MOST", "OUTSIDE_TIMEOUT", "Fetch", "Need", "record"]

log = logging.getLogger(__name__)

OUTSIDE_MOST = 32
"""The last round's nodes outside this one that a fetch asks, at most."""
OUTSIDE_TIMEOUT = 1.0
"""Seconds a node outside the round has to connect and list its snapshots."""
_CHUNK = 64
"""Records of a past round read in one call."""
_SCAN_MOST = 16384
"""Records of a past round read at most (its nodes are numbered 0, 1, ...)."""


@dataclass
class _Seen:
    """What the nodes asked hold, for the ranks this node runs and the round's others."""

    offers: dict[int, dict[int, list[PeerRecord]]] = field(default_factory=dict)
    """This node's ranks -> step -> the nodes that hold it."""
    listed: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    """(rank, step) of this node's ranks -> the CRC-32s the round's nodes list for it."""
    runners: dict[int, set[int]] = field(default_factory=dict)
    """The round's other ranks -> the steps the node that runs them holds."""
    crcs: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    """(rank, step) of every rank -> the CRC-32s this node and every node asked hold."""
    outside: set[tuple[str, int]] = field(default_factory=set)
    """The servers asked that are not the round's."""

    def add(
        self, rec: PeerRecord, steps: dict[int, list[tuple[int, int]]], mine: tuple[int, ...]
    ) -> None:
        """A node of the round lists ``steps``."""
        for rank in mine:
            for step, crc in steps.get(rank, []):
                self.offers.setdefault(rank, {}).setdefault(step, []).append(rec)
                self.listed.setdefault((rank, step), set()).add(crc)
        self.hold(steps)

    def hold(self, steps: dict[int, list[tuple[int, int]]]) -> None:
        """Some node (this one, one asked) holds ``steps``: rank -> (step, CRC-32)."""
        for rank, pairs in steps.items():
            for step, crc in pairs:
                self.crcs.setdefault((rank, step), set()).add(crc)

    def add_outside(
        self,
        listings: list[tuple[PeerRecord, dict[int, list[tuple[int, int]]]]],
        mine: tuple[int, ...],
    ) -> None:
        """Nodes outside the round list these steps: a step of this node's ranks is
        offered from them only when no node (of the round, outside it, this one) holds
        it with other bytes."""
        for _rec, steps in listings:
            self.hold(steps)
        for rec, steps in listings:
            for rank in mine:
                for step, crc in steps.get(rank, []):
                    if self.crcs[(rank, step)] == {crc}:
                        self.offers.setdefault(rank, {}).setdefault(step, []).append(rec)
            self.outside.add((rec.addr, rec.port))

    def others(self) -> dict[int, set[int]]:
        """What the round's other ranks will restore from: their node's snapshots, or,
        where it holds none (it fetches too), the steps this node or any node asked
        holds of them, with the same bytes wherever held."""
        anywhere: dict[int, set[int]] = {}
        for (rank, step), crcs in self.crcs.items():
            if len(crcs) == 1:
                anywhere.setdefault(rank, set()).add(step)
        return {rank: held or anywhere.get(rank, set()) for rank, held in self.runners.items()}

    def copy(self) -> _Seen:
        return _Seen(
            offers={rank: {s: list(h) for s, h in by.items()} for rank, by in self.offers.items()},
            listed={key: set(c) for key, c in self.listed.items()},
            runners={rank: set(steps) for rank, steps in self.runners.items()},
            crcs={key: set(c) for key, c in self.crcs.items()},
            outside=set(self.outside),
        )

    def offered(self, ambiguous: Iterable[tuple[int, int]]) -> dict[int, set[int]]:
        """This node's ranks -> the steps offered, less the ``ambiguous`` ones."""
        out = {rank: set(by_step) for rank, by_step in self.offers.items()}
        for rank, step in ambiguous:
            out.get(rank, set()).discard(step)
        return out


@dataclass(frozen=True)
class Need:
    """One fetch before a round's workers start: the round's ``store``, this node's
    ``group_rank`` among ``world_size`` nodes, the ``ranks`` its workers will run, the
    ranks it ran in the round just before (``ran``), where this node serves (``me``),
    and the stores of the rounds before, newest first (``earlier``: their nodes outside
    this round are asked when this round's leave it short)."""

    store: Store
    group_rank: int
    world_size: int
    ranks: tuple[int, ...]
    ran: tuple[int, ...]
    me: tuple[str, int]
    earlier: tuple[Store, ...] = ()


@dataclass
class Fetch:
    """Fetches the snapshots a round's workers need into ``root`` (:meth:`run`), those
    of job ``job``, the round's nodes' records at ``key<group rank>``."""

    _root: str
    _job: str
    _key: str
    fetched: dict[int, int] = field(default_factory=dict)
    """Global rank -> step fetched (the last run's)."""
    from_outside: set[int] = field(default_factory=set)
    """The ranks of :attr:`fetched` that came from a node outside the round."""

    def run(self, need: Need) -> bool:
        """Fetch, at one step for all of this node's ranks (:func:`fetch_targets`), what
        they lack; a snapshot here of a rank it did not run in the round before goes when
        another node of the round holds that step with other bytes, and a step the
        round's others hold with different bytes is fetched from none
        (:func:`two_timelines`). When the round's nodes leave it short
        (:func:`short_of`), the last round's others are asked too, and count when they
        make it whole. Returns whether every one it chose was fetched."""
        t0 = time.monotonic()
        mine = {rank: dict(steps) for rank, steps in held_steps(self._root).items()}
        held = {rank: set(steps) for rank, steps in mine.items()}
        seen = _Seen()
        with Channels() as peers:
            inside = self._ask_round(need, peers, seen)
            stale, ambiguous = two_timelines(mine, seen.listed, need.ran)
            self._drop_stale(stale, held)
            seen.hold(
                {r: [(s, c) for s, c in by.items() if s in held[r]] for r, by in mine.items()}
            )
            if need.earlier and self._short(need, held, seen, ambiguous):
                asked = seen.copy()
                self._ask_outside(need, inside | {need.me}, asked)
                # the nodes outside the round count only when they make a step that every
                # rank can restore: else the round's choice, as if none had been asked (a
                # node that did not find the round short chose without them)
                if not self._short(need, held, asked, ambiguous):
                    seen = asked
            moved, complete = self._fetch(need.ranks, held, seen, ambiguous, peers)
        self._report(moved, t0)
        return complete

    @staticmethod
    def _short(
        need: Need, held: dict[int, set[int]], seen: _Seen, ambiguous: set[tuple[int, int]]
    ) -> bool:
        return short_of(need.ranks, held, seen.offered(ambiguous), seen.others())

    def _ask_round(self, need: Need, peers: Channels, seen: _Seen) -> set[tuple[str, int]]:
        """List the snapshots of the round's other nodes; their servers."""
        deadline = time.monotonic() + 5.0  # they publish as they start the round, at once
        inside: set[tuple[str, int]] = set()
        for g in range(need.world_size):
            if g == need.group_rank:
                continue
            rec = record(need.store, f"{self._key}{g}", max(0.001, deadline - time.monotonic()))
            if rec is None:
                continue
            inside.add((rec.addr, rec.port))
            try:
                steps = list_steps(peers.to(rec), self._job).steps
            except (OSError, wire.WireError) as exc:
                log.warning("snapshots: cannot list node %s's snapshots: %s", g, exc)
                continue
            seen.add(rec, steps, need.ranks)
            for rank in rec.ranks:  # what the ranks that node runs will offer to load()
                seen.runners[rank] = {step for step, _crc in steps.get(rank, [])}
        return inside

    def _ask_outside(self, need: Need, inside: set[tuple[str, int]], seen: _Seen) -> None:
        """List, all at once, the snapshots of the last round's nodes not in this one
        (``inside``: the round's and this node's servers)."""
        records = self._left(need, inside)
        listings: list[wire.Listing | None] = [None] * len(records)

        def list_one(i: int) -> None:
            rec = records[i]
            try:  # a channel of its own, closed here: a thread left late leaks nothing
                with Channel(rec.addr, rec.port) as channel:
                    listings[i] = list_steps(channel, self._job, timeout=OUTSIDE_TIMEOUT)
            except (OSError, wire.WireError) as exc:
                log.info("snapshots: %s:%s, outside the round: %s", rec.addr, rec.port, exc)

        threads = [
            threading.Thread(
                target=list_one, args=(i,), name=f"relaunch-snapshot-list-{i}", daemon=True
            )
            for i in range(len(records))
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + OUTSIDE_TIMEOUT * 2 + 1.0
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        late = sum(t.is_alive() for t in threads)
        if late:
            log.warning("snapshots: %d nodes outside the round still listing; left", late)
        found = [
            (rec, listing.steps)
            for rec, listing, t in zip(records, listings, threads, strict=True)
            if not t.is_alive() and listing is not None and any(listing.steps.values())
        ]
        seen.add_outside(found, need.ranks)
        log.info("snapshots: %d of %d nodes outside the round hold some", len(found), len(records))

    def _left(self, need: Need, inside: set[tuple[str, int]]) -> list[PeerRecord]:
        """The records of the newest round before this one that has any, less the nodes
        ``inside`` this round (and this node): at most :data:`OUTSIDE_MOST`, those that
        ran one of this node's ranks there and their ring successors (which hold their
        copies) first."""
        for store in need.earlier:
            found: dict[int, PeerRecord] = {}
            published = False
            for start in range(0, _SCAN_MOST, _CHUNK):
                keys = [f"{self._key}{g}" for g in range(start, start + _CHUNK)]
                try:
                    raws = get_many(store, keys)
                except RelaunchError as exc:
                    log.warning("snapshots: cannot read the last round's nodes: %s", exc)
                    return []
                for g, (key, raw) in enumerate(zip(keys, raws, strict=True), start):
                    published |= raw is not None
                    rec = _decode(key, raw)
                    if rec is not None:
                        found[g] = rec
                if all(raw is None for raw in raws):  # numbered 0, 1, ...: past the last
                    break
            if published:  # (a round that never started: the one before it)
                return _nearest_first(found, need.ranks, inside)[:OUTSIDE_MOST]
        return []

    def _fetch(
        self,
        ranks: tuple[int, ...],
        held: dict[int, set[int]],
        seen: _Seen,
        ambiguous: set[tuple[int, int]],
        peers: Channels,
    ) -> tuple[int, bool]:
        """Fetch the chosen steps; the bytes moved, and whether every one came."""
        moved = 0
        offered = seen.offered(ambiguous)
        others = seen.others()
        for _ in range(3):  # a step no holder could send: the next best without it
            failed = 0
            for rank, step in fetch_targets(ranks, held, offered, others).items():
                for rec in seen.offers[rank][step]:
                    try:
                        moved += fetch_step(peers.to(rec), self._job, rank, step, self._root)
                        self.fetched[rank] = step
                        if (rec.addr, rec.port) in seen.outside:
                            self.from_outside.add(rank)
                        held.setdefault(rank, set()).add(step)
                        break
                    except (OSError, wire.WireError) as exc:
                        log.warning(
                            "snapshots: rank %s step %s from %s: %s", rank, step, rec.addr, exc
                        )
                else:
                    offered[rank].discard(step)
                    failed += 1
            if not failed:
                return moved, True
        return moved, False

    def _drop_stale(self, stale: set[tuple[int, int]], held: dict[int, set[int]]) -> None:
        """Drop this node's snapshots ``stale`` (rank, step) (:func:`two_timelines`)."""
        for rank, step in sorted(stale):
            folder = layout.step_dir(layout.rank_dir(self._root, rank), step)
            shutil.rmtree(folder, ignore_errors=True)
            held[rank].discard(step)
        if stale:
            log.warning(
                "snapshots: dropped this node's %s: the job wrote them again while it sat out",
                ", ".join(f"rank {rank} step {step}" for rank, step in sorted(stale)),
            )

    def _report(self, moved: int, t0: float) -> None:
        if self.fetched:
            seconds = time.monotonic() - t0
            ranks = ", ".join(f"{k} (step {v})" for k, v in sorted(self.fetched.items()))
            outside = len(self.from_outside)
            where = f", {outside} from nodes outside the round" if outside else ""
            print(
                f"relaunch: snapshots: fetched ranks {ranks} from the nodes that hold them"
                f"{where}, before their workers start ({moved / 1e6:.1f} MB in {seconds:.2f} s)",
                file=sys.stderr,
                flush=True,
            )


def record(store: Store, key: str, timeout: float) -> PeerRecord | None:
    """The peer record at ``key`` of the round's ``store``, awaited ``timeout`` seconds
    (None: not there, or not one)."""
    try:
        if timeout > 0:
            store.wait([key], timeout=timeout)
        raw = store.get(key)
        return None if raw is None else PeerRecord.from_bytes(raw, key)
    except (RelaunchError, wire.WireError) as exc:
        log.debug("snapshots: no peer record at %s: %s", key, exc)
        return None


def _nearest_first(
    found: dict[int, PeerRecord], ranks: Iterable[int], inside: set[tuple[str, int]]
) -> list[PeerRecord]:
    """The records of a past round (group rank -> record) not ``inside`` this one: first
    the nodes that ran one of ``ranks`` there and their ring successors, then the rest,
    each by group rank."""
    wanted = set(ranks)
    ran = {g for g, rec in found.items() if wanted.intersection(rec.ranks)}
    size = max(found, default=-1) + 1
    near = ran | {(g + 1) % size for g in ran}
    return [
        found[g]
        for g in sorted(found, key=lambda g: (g not in near, g))
        if (found[g].addr, found[g].port) not in inside
    ]


def _decode(key: str, raw: bytes | None) -> PeerRecord | None:
    """The peer record ``raw`` read at ``key`` (None: unset, or not one: a warning)."""
    if raw is None:
        return None
    try:
        return PeerRecord.from_bytes(raw, key)
    except wire.WireError as exc:
        log.warning("snapshots: skipped a node of the last round: %s", exc)
        return None
