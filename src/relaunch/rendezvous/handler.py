"""The dynamic rendezvous handler: the thin I/O loop around the pure state machine."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from relaunch.errors import RelaunchError, RendezvousClosedError, StoreLostError
from relaunch.rendezvous._admission import JobAddresses
from relaunch.rendezvous._backend import StateBackend
from relaunch.rendezvous._corrupt import CorruptWatch
from relaunch.rendezvous._join import RoundJoin
from relaunch.rendezvous._keepalive import KeepAlive
from relaunch.rendezvous._news import nodes_waiting, round_ended
from relaunch.rendezvous._places import Assignment
from relaunch.rendezvous._polled import PolledState
from relaunch.rendezvous._program import RefusedLog, claim_program
from relaunch.rendezvous._queue import RequestQueue
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._spent import SpentKeys
from relaunch.rendezvous._state import RendezvousState, new_node_id, peer_addresses
from relaunch.rendezvous._writes import (
    claim_store_host,
    close,
    count_failure,
    depart,
    leave,
    leave_round,
    mark_inprocess,
    wait_for_others,
)
from relaunch.rendezvous.api import RendezvousInfo
from relaunch.store import Store
from relaunch.store.prefix import PrefixStore
from relaunch.store.signed import SignedStore

if TYPE_CHECKING:
    from relaunch.rendezvous._replicated import EmbeddedStore

__all__ = ["DynamicRendezvousHandler"]

logger = logging.getLogger(__name__)

DEPART_TIMEOUT = 5.0
"""Seconds a node told to stop may spend leaving its running round before it stops its
workers (a store that does not answer: they stop then all the same)."""
_REFUSED_EVERY = 5.0
"""Seconds between two looks for refused nodes (to log them), at least."""


class _Closeable(Protocol):
    def close(self) -> None: ...


class DynamicRendezvousHandler:
    """A :class:`~relaunch.rendezvous.RendezvousHandler` over any Store.

    ``store`` serves the caller's thread; ``keep_alive_store`` (default: ``store``)
    serves the keep-alive thread, for stores whose connection is not thread-safe.
    ``server`` (e.g. the TCP store this node hosts) is closed by :meth:`shutdown`,
    after every other node left or died, so no node restarting is stranded. The
    stores are closed there too unless ``owns_store`` is False (a shared store), and
    ``embedded``, the etcd cluster the agents run. ``lifeline_host``: where this node's
    lifeline listens (None: its loss is seen by heartbeats only). ``clock``: wall time;
    ``ticks``: time that never steps (default: the monotonic clock with the real
    ``clock``, else ``clock``).
    """

    def __init__(
        self,
        *,
        backend: str,
        store: Store,
        settings: RendezvousSettings,
        local_addr: str | None = None,
        keep_alive_store: Store | None = None,
        server: _Closeable | None = None,
        owns_store: bool = True,
        embedded: EmbeddedStore | None = None,
        lifeline_host: str | None = None,
        clock: Callable[[], float] = time.time,
        ticks: Callable[[], float] | None = None,
    ) -> None:
        self._backend_name = backend
        self._settings = settings
        self._store = store
        self._keep_alive_store = keep_alive_store
        self._server = server or embedded
        self._hosts_store = server is not None  # the TCP store's host takes rank 0
        self._embedded = embedded
        self._owns_store = owns_store
        self._clock = clock
        self._node = new_node_id(local_addr)
        ticks = ticks or (time.monotonic if clock is time.time else clock)
        self._rdzv = StateBackend(store, settings, clock=clock, ticks=ticks)
        ka_store = keep_alive_store or store
        self._ka_rdzv = StateBackend(ka_store, settings, clock=clock, ticks=ticks)
        self._round: int | None = None
        self._interrupted = threading.Event()
        self._shut = False
        self._joined = False
        self._program: str | None = None
        self._spent = SpentKeys()  # deleted by the keep-alive thread after a beat
        self._queue = RequestQueue(self._rdzv, self._spent)
        self._corrupt = CorruptWatch(settings.run_id, settings.dead_after)
        self._polled = PolledState(self._rdzv, self._corrupt, self._node)
        # (a warning a few seconds late costs nothing; each look costs etcd a call)
        every = max(settings.dead_after, _REFUSED_EVERY)
        refused = RefusedLog(self._ka_rdzv.store, self._rdzv.prefix, settings.run_id, every, clock)
        self._keep_alive = KeepAlive(
            node=self._node,
            backend=self._ka_rdzv,
            settings=settings,
            corrupt=self._corrupt,
            clock=clock,
            after_beat=lambda: self._after_beat(refused),
            lifeline_host=lifeline_host,
        )
        self._join = RoundJoin(
            self._node, self._rdzv, self._queue, settings, self._corrupt, self._interrupted,
            clock, self._keep_alive.start,
        )  # fmt: skip

    def _after_beat(self, refused: RefusedLog) -> None:
        """The keep-alive thread's, after each heartbeat (in the beat's run of calls):
        the refused nodes' log, and the keys this node is done with deleted."""
        refused()
        self._spent.forget(self._ka_rdzv.store)

    # -- small accessors ----------------------------------------------------------

    @property
    def node_id(self) -> str:
        """This handler's node id (``<addr>_<pid>_<local_id>``)."""
        return self._node

    @property
    def settings(self) -> RendezvousSettings:
        return self._settings

    @property
    def max_nodes(self) -> int:
        return self._settings.max_nodes

    def get_backend(self) -> str:
        return self._backend_name

    def store_endpoints(self) -> list[tuple[str, int]]:
        return self._embedded.endpoints() if self._embedded is not None else []

    def store_lost_reason(self, exc: BaseException) -> str | None:
        """The line naming the lost members, when the store is replicated."""
        return self._embedded.lost_reason(exc) if self._embedded is not None else None

    def get_run_id(self) -> str:
        return self._settings.run_id

    # -- the rendezvous -----------------------------------------------------------

    def next_rendezvous(self, while_waiting: Callable[[], None] | None = None) -> RendezvousInfo:
        """Leave the current round, join the next one and wait until it is complete.

        Raises RendezvousClosedError, RendezvousTimeoutError (past ``join_timeout``),
        RendezvousGracefulExitError (a spare no longer needed), RendezvousStateError,
        StoreError (the store broke).
        """
        if self._shut:
            raise RendezvousClosedError("this rendezvous handler was shut down")
        settings = self._settings
        deadline = self._clock() + settings.join_timeout
        if not self._joined:
            self._check_program()
            if self._hosts_store:
                claim_store_host(self._rdzv, self._node, settings, self._clock)
        if self._embedded is not None:  # let in; and a new round may follow a member's loss
            self._embedded.admitted()
        self._rdzv.announce(self._node)
        if self._joined:
            self._keep_alive.start()
        else:  # its first beat once its request left the queue (RoundJoin.dequeued)
            self._keep_alive.open()
        state: RendezvousState | None = None
        raw: bytes | None = None
        if self._joined:
            state, raw = leave_round(self._rdzv, self._node, settings, self._clock, deadline)
        self._joined = True
        placed = self._join.run(state, raw, deadline, while_waiting)
        return self._info(placed.round, placed.place, placed.state)

    # -- the program check ----------------------------------------------------------

    def set_program(self, program: str) -> None:
        """What this node runs (entrypoint and arguments): a node running something else
        under the same job id is refused, unless ``allow_mixed``."""
        self._program = program

    def _check_program(self) -> None:
        if self._program is not None and not self._settings.allow_mixed:
            claim_program(self._store, self._rdzv.prefix, self._node, self._program, self._settings)

    def interrupt(self) -> None:
        """Make a blocked :meth:`next_rendezvous` raise RendezvousClosedError soon.

        Safe to call from a signal handler (it only sets an event); the call returns
        within one wait slice (at most ``dead_after`` seconds, 2 s by default).
        """
        self._interrupted.set()

    def _info(
        self, round_: int, place: Assignment, state: RendezvousState | None = None
    ) -> RendezvousInfo:
        """The round's info for this node at ``place`` (the state is read only for a
        signed store's peers, and only when not given)."""
        if self._round is not None and self._round != round_:  # the last round's place
            self._spent.add(self._rdzv.assign_key(self._round, self._node))
        self._round = round_
        self._polled.forget()
        self._keep_alive.follow(place.successor)  # the new round's ring
        rank, world_size = place.rank, place.world_size
        peers = None
        if isinstance(self._store, SignedStore):
            if state is None or state.round != round_:
                state = self._rdzv.load()[0]
            peers = peer_addresses(state.participants)  # IP literals: no DNS lookups
            if peers is None:
                logger.warning(
                    "the workers' store admits every address: the nodes' addresses"
                    " %s are not all IP literals (give --local-addr as an IP to "
                    "restrict it)",
                    sorted(state.participants),
                )
        logger.info(
            "rendezvous %s round %d complete: node %s has rank %d of %d",
            self._settings.run_id,
            round_,
            self._node,
            rank,
            world_size,
        )
        return RendezvousInfo(
            store=self._round_store(round_),
            rank=rank,
            world_size=world_size,
            round=round_,
            peers=peers,
            admits=None if peers is None else JobAddresses(self._rdzv, peers),
            incarnation=place.incarnation,
            earlier=tuple(self._round_store(n) for n in (round_ - 1, round_ - 2) if n >= 0),
        )

    def _round_store(self, round_: int) -> PrefixStore:
        """The store of round ``round_``: its keys under a prefix of their own."""
        return PrefixStore.over(self._store, f"{self._rdzv.prefix}round/{round_}/")

    def is_closed(self) -> bool:
        """Whether the rendezvous is closed for good (one small store read when unchanged)."""
        return self._polled.get().closed

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round; > 0 also when a new round started without us.

        The agent restarts its workers and calls :meth:`next_rendezvous` when it is > 0.
        """
        return nodes_waiting(self._polled.get(), self._round)

    def round_ended(self) -> bool:
        """Whether this node's round is over without it (one small store read when
        unchanged)."""
        return round_ended(self._polled.get(), self._round)

    def depart(self) -> None:
        """Leave this node's running round as a lost node would, before its workers stop
        (the agent was told to stop while they run); within ``DEPART_TIMEOUT``. Not for
        a job of one node, nor for the node that hosts the only copy of the store (the
        job goes with it: a round without it would only wait for its end)."""
        only_store = self._hosts_store and self._embedded is None
        if self._joined and self._settings.max_nodes > 1 and not only_store:
            deadline = self._clock() + min(DEPART_TIMEOUT, self._settings.close_timeout)
            depart(self._queue, self._node, self._settings, self._clock, deadline)

    def vacancies(self) -> dict[int, int]:
        """Group ranks of this node's round left by lost nodes (tiered recovery), each
        with the incarnation its replacement starts at; empty in another round."""
        state = self._this_round()
        return {} if state is None else dict(state.vacancies)

    def replaced(self) -> dict[int, int]:
        """Group ranks of this node's round taken over from lost nodes, with the
        incarnation their workers started at; empty in another round."""
        state = self._this_round()
        return {} if state is None else dict(state.incarnations)

    def _this_round(self) -> RendezvousState | None:
        """The state (as last polled) while it is this node's round, complete."""
        state = self._polled.get()
        ok = self._round is not None and state.round == self._round and state.complete
        return state if ok else None

    def mark_inprocess(self) -> None:
        """This node's workers restart in-process: when it is lost, its rank may be
        filled without restarting the others (while every node of the round says so)."""
        mark_inprocess(self._rdzv, self._node, self._round, self._settings, self._clock)

    def set_closed(self) -> None:
        """Close the rendezvous for good: every node's next_rendezvous raises closed."""
        close(self._rdzv, self._node, self._settings, self._clock)

    # -- job-level restart accounting ----------------------------------------------

    def record_failure(self, failed_round: int) -> int | None:
        """Count a failure restart of the job for ``failed_round``; return the job's total.

        Every agent that sees a worker failure in round ``r`` calls this with ``r``;
        the restart is counted once per round, however many nodes report it. None, and
        nothing counted, when the job had gone on from that round first (another node
        began the next one, or the job dropped this node while it was silent): the
        failure follows from that.
        """
        return count_failure(self._rdzv, failed_round, self._node)

    def publish_worker_modules(self, modules: bytes) -> None:
        """Say what this node's workers import (a spare's fork server preloads it)."""
        self._store.set(f"{self._rdzv.prefix}worker_modules", modules)

    def worker_modules(self) -> bytes | None:
        """What a node's workers import, as published (unchecked bytes), or None."""
        return self._store.get(f"{self._rdzv.prefix}worker_modules")

    def publish_status(self, report: bytes) -> None:
        """Write this node's status report (``relaunch status`` reads it)."""
        self._store.set(f"{self._rdzv.prefix}status/{self._node}", report)

    def restart_count(self) -> int:
        """Failure restarts the job has spent so far (for ``TORCHELASTIC_RESTART_COUNT``)."""
        return self._rdzv.load()[0].restarts

    # -- leaving ----------------------------------------------------------------------

    def shutdown(self, *, leave: bool = True) -> bool:
        """Leave the rendezvous for good, without closing it; release threads and connections.

        The store's host (the TCP server's; the embedded member the others reach last)
        waits up to ``close_timeout`` until every other node left or died. False when
        leaving failed, or was not tried (``leave=False``: the store is known lost); the
        heartbeat then expires on its own. Idempotent."""
        if self._shut:
            return True
        self._shut = True
        self._keep_alive.follow(None)  # a leaving successor is not a lost one
        ok = leave
        try:
            if leave:
                self._leave()
        except StoreLostError:  # (the job's end says why, in one line)
            ok = False
        except RelaunchError as exc:
            logger.warning("node %s could not leave the rendezvous cleanly: %s", self._node, exc)
            ok = False
        finally:
            self._keep_alive.stop()
            self._keep_alive.close_lifeline()  # after the leave: nothing left to report
            owned = (self._keep_alive_store, self._store) if self._owns_store else ()
            for closeable in (*owned, self._server):
                if closeable is not None:
                    try:
                        closeable.close()
                    except RelaunchError as exc:
                        logger.warning("closing %r failed: %s", closeable, exc)
            self._polled.close()  # its watch ended with the store's close
        return ok

    def _leave(self) -> None:
        embedded = self._embedded
        serving = self._hosts_store or (embedded is not None and embedded.is_member)
        known = self._rdzv.load()[0].known() | self._polled.seen if serving else ()
        if embedded is not None:  # no seat taken from now on
            embedded.leaving()
        if self._joined:  # (alive until the leave's deadline, without beats)
            leave(self._queue, self._node, self._settings, self._clock, self._keep_alive.stop)
        if (embedded is None or not embedded.leave()) and serving:
            wait_for_others(self._rdzv, self._node, self._settings, self._clock, known)
