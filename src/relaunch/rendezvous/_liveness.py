"""Who is alive, at O(1) store work per node and keep-alive interval.

Keys, under ``relaunch/rdzv/<run_id>/``:

``hb/<node>``
    The node's heartbeat: its wall-clock time in milliseconds, written by the node
    itself every keep-alive interval (one small write; the shared state is not
    rewritten), and first by the applier of its join request, before it places it.
    A node whose heartbeat has not changed for the dead-node delay, by the reader's
    own clock, is dead: the time in it is only credited to a value the reader sees
    for the first time, up to the dead-node delay less two intervals (so a live node's
    next beat always comes in time), so that no skew between the hosts' clocks makes
    a live node dead (compared with the reader's clock, a heartbeat from a host whose
    clock is 2 s behind was dead when written; one from a host whose clock ran an
    hour ahead was alive for an hour once its node was lost). A leaving node stops
    beating and writes its heartbeat once more as ``<ms>+<ms>``: the time, and how
    long it stays alive from then (until its leave's deadline, a span: no clock is
    compared; :meth:`Liveness.leaving`). On a store with leases (etcd) the node's
    ``alive/<node>`` key, under its lease, decides instead (etcd's clock, no skew
    between hosts), and the heartbeat, written every 5 s there (:data:`STATUS_BEAT`),
    only tells ``relaunch status`` how recent the node is.
``steward``
    ``{"v": 1, "node": N, "ms": T, "corrupt": null or "why"}``: the node that reads
    everyone's liveness this interval, when it last said so, and whether the state it
    last read was corrupt. The steward reads the state and every node's liveness once
    per beat (two reads of O(N) bytes; on a store with leases the state only when the
    liveness keys changed, :class:`~relaunch.rendezvous._keepalive.KeepAlive`), removes
    the dead, and rewrites its key every half dead-node delay (at once when its report
    changes); every other node reads this key (one small read), learns from it that
    the state is corrupt (and valid again), and takes the role over by compare-and-set
    once it has not changed for the dead-node delay by the reader's clock (its holder
    stopped beating; the time in it is not compared with the reader's clock: a holder
    whose clock ran ahead would have held the role for that much longer once lost). So finding
    dead nodes costs the store O(N) per interval in total, not O(N) per node. Where the
    store has leases (etcd), a node reads the key only when it may be overdue (the time
    in it plus the dead-node delay, by its own clock at most): every half to whole
    dead-node delay, not every interval (most of the embedded store's calls at idle
    were these reads: it reads once the key it read last may have stood unchanged for
    the dead-node delay); it takes the role over as soon as before, and hears of a
    corrupt state up to a dead-node delay later (of its end every interval, as before:
    a node that heard of one reads the key every interval until the key says the state
    is valid). The holder there rewrites its key without reading it first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable

from relaunch._json import loads as json_loads
from relaunch.errors import RendezvousStateError
from relaunch.rendezvous._corrupt import CorruptWatch
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.store import Store, get_many, has_leases, peek, set_many

__all__ = ["STATUS_BEAT", "Liveness", "heartbeat_times"]

STATUS_BEAT = 5.0
"""Seconds between a node's heartbeat writes, at least, where the store has leases
(its heartbeat is then only the age ``relaunch status`` shows)."""


class Liveness:
    """The heartbeat and steward keys of one run in ``store`` (``prefix``: its keys')."""

    def __init__(
        self,
        store: Store,
        prefix: str,
        settings: RendezvousSettings,
        clock: Callable[[], float],
        ticks: Callable[[], float] | None = None,
    ) -> None:
        self.store = store
        self._prefix = prefix
        self._settings = settings
        self._clock = clock
        """Wall-clock seconds: the times written into the keys."""
        self._ticks = ticks or clock
        """Seconds that never step (monotonic; None: ``clock``, a test's): how long a
        key stood unchanged, so that a step of this host's wall clock (a correction by
        an hour) neither kills every node nor keeps a lost one alive for the hour."""
        self._steward_raw: bytes | None = None
        """The steward key as this node last wrote it (it holds the role while it is so)."""
        self._reporting: str | None = None
        """The corruption this node, as the steward, saw in its last read of the state."""
        self._heard: bool = False
        """Whether this node learned of a corrupt state from the steward's key."""
        self._beaten = -math.inf
        """When this node last wrote its heartbeat."""
        self._said: tuple[float, str | None] = (-math.inf, None)
        """When this node, as the steward, last wrote its key (its ticks), and the report
        in it."""
        self._quiet_until = -math.inf
        """Before then another node's steward key cannot be overdue (stores with leases:
        this node does not read it until then)."""
        self._seen: dict[str, tuple[bytes, float, float]] = {}
        """Each node's heartbeat as this node last read it, since when it has been so,
        and when this node read it (this node's ticks)."""
        self._steward_seen: tuple[bytes | None, float] = (None, -math.inf)
        """The steward key as this node last read it, and since when (its ticks)."""

    def hb_key(self, node: str) -> str:
        return f"{self._prefix}hb/{node}"

    def _alive_key(self, node: str) -> str:
        return f"{self._prefix}alive/{node}"

    def announce(self, node: str) -> None:
        """Before ``node`` joins, where the store has leases: its liveness key under its
        lease, and its heartbeat. Elsewhere nothing: the applier of its join request
        stamps its heartbeat (:meth:`stamp`) before it places it, one write for the
        whole batch instead of one per node (a third of the calls of a 4,096-node
        round's joins), and its keep-alive beats from then on."""
        if has_leases(self.store):
            self.store.set_ephemeral(self._alive_key(node), b"1", self._settings.dead_after)
            self.beat(node)

    def stamp(self, nodes: list[str]) -> None:
        """Write the heartbeats of ``nodes`` about to be placed in the state, now (one
        call): a node in the state always has one, or the next look at the dead would
        drop it before its own first beat. Nothing where the store has leases (each
        node announced its lease before it asked to join)."""
        if has_leases(self.store) or not nodes:
            return
        now = _millis(self._clock())
        set_many(self.store, {self.hb_key(node): now for node in nodes})

    @property
    def beat_every(self) -> float:
        """Seconds between a live node's heartbeat writes, at most (past a stall): the
        keep-alive interval, or on a store with leases :data:`STATUS_BEAT` (the lease
        decides who is alive; a write costs etcd a raft round, so the heartbeat is only
        ``relaunch status``'s age there)."""
        if has_leases(self.store):
            return max(self._settings.dead_after, STATUS_BEAT)
        return self._settings.keep_alive_interval

    def beat(self, node: str) -> None:
        """Write ``node``'s heartbeat (one small write; on a store with leases only
        once per :attr:`beat_every`)."""
        tick = self._ticks()
        if has_leases(self.store) and tick - self._beaten < self.beat_every:
            return
        self.store.set(self.hb_key(node), _millis(self._clock()))
        self._beaten = tick

    def leaving(self, node: str, until: float) -> None:
        """``node`` stopped beating to leave by ``until`` (its leave's deadline): its
        heartbeat says how long it stays alive from now (until then), one write for
        the whole leave. Nothing where the store has leases (its client keeps its lease)."""
        if not has_leases(self.store):
            now = self._clock()
            span = _millis(max(until - now, 0.0))
            self.store.set(self.hb_key(node), _millis(now) + b"+" + span)

    def forget(self, node: str) -> None:
        """``node`` left: its heartbeat goes with it."""
        self.store.delete(self.hb_key(node))

    def alive(self, nodes: Iterable[str]) -> set[str]:
        """Those of ``nodes`` that are alive: their lease's key is there (etcd), else
        their heartbeat changed within the dead-node delay (:meth:`beating`)."""
        if has_leases(self.store):
            return set(self.everyone_alive() & set(nodes))
        return self.beating(nodes, self._settings.dead_after)

    def beating(
        self, nodes: Iterable[str], within: float, *, credit: float | None = None
    ) -> set[str]:
        """Those of ``nodes`` whose heartbeat is there and changed within ``within``
        seconds, by this node's clock (one read of the keys). A new value counts as
        changed when the time in it says, by this node's clock, but not later than now,
        nor earlier than this node's last read of the key (it changed since), nor than
        ``credit`` ago (default: ``within`` less two of the node's beats, so that a live
        node, whatever its clock, beats again before it would be dead); a leaving node's
        counts as changed its span less ``within`` from now (it is alive for that span,
        a close timeout at most)."""
        wanted = list(nodes)
        raws = get_many(self.store, [self.hb_key(n) for n in wanted])
        now, tick = self._clock(), self._ticks()
        if credit is None:
            credit = max(0.0, within - 2 * self.beat_every)
        longest = self._settings.close_timeout + within  # (a leave's, at most)
        found = set()
        for node, raw in zip(wanted, raws, strict=True):
            beat = None if raw is None else _parse_beat(raw)
            if raw is None or beat is None:  # none, or not a heartbeat: never written
                self._seen.pop(node, None)
                continue
            seen = self._seen.get(node)
            if seen is not None and seen[0] == raw:
                since = seen[1]
            else:
                written, span = beat
                if span is None:
                    age = min(max(now - written, 0.0), credit)
                else:
                    age = within - min(span, longest)
                if seen is not None and span is None:
                    age = min(age, max(tick - seen[2], 0.0))
                since = tick - age
            self._seen[node] = raw, since, tick
            if tick - since <= within:
                found.add(node)
        if len(self._seen) > 2 * len(wanted) + 1024:  # nodes long gone (never read again)
            self._seen = {n: s for n, s in self._seen.items() if tick - s[2] <= 10 * within}
        return found

    def everyone_alive(self) -> frozenset[str]:
        """Every node whose lease's key is there (a store with leases only: one read of
        the keys, O(N) bytes)."""
        assert has_leases(self.store)
        cut = len(self._prefix) + len("alive/")
        return frozenset(key[cut:] for key in self.store.keys_with_prefix(self._prefix + "alive/"))

    def steward(self, node: str, watch: CorruptWatch) -> bool:
        """Whether ``node`` is the steward this interval: it holds the role and says so
        again, or takes it over from a holder that stopped beating (compare-and-set:
        one node wins). One small read, and a small write while it holds the role; on
        a store with leases, the holder writes without reading (its compare-and-set
        fails if another node took the role, which it does only once the key is
        overdue), and the others read only once it may be overdue. Another node's
        steward key that says the state is corrupt (or valid again) is told to
        ``watch``."""
        key = f"{self._prefix}steward"
        now = self._ticks()
        said_at, said = self._said
        said_lately = said == self._reporting and now - said_at < self._settings.dead_after / 2
        if has_leases(self.store) and self._steward_raw is not None:
            if said_lately:
                return True
            raw: bytes | None = self._steward_raw
        elif now < self._quiet_until:
            return False
        else:
            # a read with no consensus round where the store has one (etcd): an answer
            # a moment old at worst delays a takeover by that moment, or fails the
            # compare-and-set that takes the role
            raw = peek(self.store, key)
            held = None if raw is None else _parse(raw)
            mine = raw is not None and raw == self._steward_raw
            now = self._ticks()
            if raw != self._steward_seen[0]:
                self._steward_seen = raw, now
            since = self._steward_seen[1]
            if held is not None and not mine and now - since <= self._settings.dead_after:
                self._steward_raw = None
                self._hear(held[2], watch)
                if has_leases(self.store) and not self._heard:
                    # its holder says so again before then, or it is overdue
                    self._quiet_until = since + self._settings.dead_after
                return False
            if mine and said_lately:
                return True  # said recently, and the same: no write
        ms = round(self._clock() * 1000)
        doc = {"v": 1, "node": node, "ms": ms, "corrupt": self._reporting}
        data = json.dumps(doc).encode()
        current, written = self.store.compare_set(key, raw, data)
        written = written or current == data  # a resent write's own bytes (commit's note)
        self._steward_raw = current if written else None
        self._said = (now, self._reporting) if written else (-math.inf, None)
        return written

    def report_corrupt(self, why: RendezvousStateError | None) -> None:
        """What this node, as the steward, found in the state (None: it decoded); said
        in its key from the next beat."""
        self._reporting = None if why is None else str(why)[:1000]

    def _hear(self, corrupt: str | None, watch: CorruptWatch) -> None:
        if corrupt is not None:
            self._heard = True
            watch.seen(RendezvousStateError(corrupt))
        elif self._heard:
            self._heard = False
            watch.ok()


def _millis(seconds: float) -> bytes:
    """A heartbeat's value: the time in whole milliseconds, as digits."""
    return str(round(seconds * 1000)).encode()


def _parse(raw: bytes) -> tuple[str, float, str | None] | None:
    """``(node, seconds, corrupt)`` of a steward key, or None when it is not one (a
    corrupt key is taken over)."""
    try:
        doc = json_loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("v") != 1:
        return None
    node, ms, corrupt = doc.get("node"), doc.get("ms"), doc.get("corrupt")
    if not isinstance(node, str) or type(ms) is not int or not 0 <= ms < 2**53:
        return None
    if corrupt is not None and not isinstance(corrupt, str):
        return None
    return node, ms / 1000, corrupt


def heartbeat_times(nodes: Iterable[str], raws: Iterable[bytes | None]) -> dict[str, float]:
    """Each node's heartbeat time (seconds) from its ``hb/`` key's value (milliseconds);
    a node without one, or with one that is not a number, is left out (never written)."""
    found = {}
    for node, raw in zip(nodes, raws, strict=True):
        beat = None if raw is None else _parse_beat(raw)
        if beat is not None:
            found[node] = beat[0]
    return found


def _parse_beat(raw: bytes) -> tuple[float, float | None] | None:
    """A heartbeat's time (seconds) and, a leaving node's, the span it is alive for
    from then, from its value (``<ms>`` or ``<ms>+<ms>``); None when it is not one."""
    written, plus, span = raw.partition(b"+")
    if not (written.isdigit() and len(written) <= 16):
        return None
    if not plus:
        return int(written) / 1000, None
    if not (span.isdigit() and len(span) <= 16):
        return None
    return int(written) / 1000, int(span) / 1000
