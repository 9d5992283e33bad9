"""The dynamic rendezvous handler: the thin I/O loop around the pure state machine."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from relaunch.errors import (
    RelaunchError,
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from relaunch.rendezvous._backend import StateBackend
from relaunch.rendezvous._corrupt import CorruptWatch
from relaunch.rendezvous._keepalive import KeepAlive
from relaunch.rendezvous._ops import JOIN_REQUEST_ACTIONS, Action, apply, decide_join, nodes_waiting
from relaunch.rendezvous._places import Assignment, assignment_of
from relaunch.rendezvous._polled import PolledState, load_through_corruption
from relaunch.rendezvous._program import RefusedLog, claim_program
from relaunch.rendezvous._queue import RequestQueue
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState, new_node_id, peer_addresses
from relaunch.rendezvous._writes import (
    claim_store_host,
    close,
    count_failure,
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
    lifeline listens (None: its loss is seen by heartbeats only). ``clock``: wall time.
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
        self._rdzv = StateBackend(store, settings, clock=clock)
        self._queue = RequestQueue(self._rdzv)
        self._ka_rdzv = StateBackend(keep_alive_store or store, settings, clock=clock)
        self._round: int | None = None
        self._interrupted = threading.Event()
        self._shut = False
        self._joined = False
        self._program: str | None = None
        self._corrupt = CorruptWatch(settings.run_id, settings.dead_after)
        self._polled = PolledState(self._rdzv, self._corrupt, self._node)
        refused = RefusedLog(self._ka_rdzv.store, self._rdzv.prefix, settings.run_id,
                             settings.dead_after, clock)  # fmt: skip
        self._keep_alive = KeepAlive(
            node=self._node,
            backend=self._ka_rdzv,
            settings=settings,
            corrupt=self._corrupt,
            clock=clock,
            after_beat=refused,
            lifeline_host=lifeline_host,
        )

    # -- small accessors ----------------------------------------------------------

    @property
    def node_id(self) -> str:
        """This handler's node id (``<addr>_<pid>_<local_id>``)."""
        return self._node

    @property
    def settings(self) -> RendezvousSettings:
        return self._settings

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
        self._keep_alive.start()
        state: RendezvousState | None = None
        raw: bytes | None = None
        if self._joined:
            state, raw = leave_round(self._rdzv, self._node, settings, self._clock, deadline)
        self._joined = True
        while True:
            if self._interrupted.is_set():
                raise RendezvousClosedError(f"node {self._node}: next_rendezvous interrupted")
            now = self._clock()
            if state is None:
                # First call: queue the request at once; its applier decides the placement.
                action = Action.ADD_TO_PARTICIPANTS
            else:
                cleaned, dead = self._rdzv.remove_dead(state, now)
                if dead:
                    logger.info("rendezvous %s: removing dead nodes %s", settings.run_id, dead)
                    state, raw, _ = self._rdzv.commit(state, raw, cleaned)
                    continue
                action = decide_join(state, self._node, now, settings, deadline)
            self._raise_if_ended(action)
            info: RendezvousInfo | None = None
            if action is Action.FINISH:
                assert state is not None
                info = self._info(state.round, assignment_of(state, self._node), state)
            elif action in JOIN_REQUEST_ACTIONS:
                if action is Action.REMOVE_FROM_REDUNDANCY_LIST:
                    deadline = now + settings.join_timeout
                info = self._request_join(now, deadline)
            elif action is Action.SYNC:
                assert state is not None
                info = self._sync(state, now, deadline, while_waiting)
            else:
                assert state is not None
                new = apply(action, state, self._node, now, settings)
                state, raw, _ = self._rdzv.commit(state, raw, new)
                continue
            if info is not None:
                return info
            state, raw = load_through_corruption(
                self._rdzv, self._corrupt, self._interrupted, patient=state is not None
            )

    def _raise_if_ended(self, action: Action) -> None:
        """Raise what ends next_rendezvous for ``action``, if it is one of the ends."""
        run_id, node = self._settings.run_id, self._node
        if action is Action.ERROR_CLOSED:
            raise RendezvousClosedError(f"the rendezvous {run_id!r} is closed")
        if action is Action.EXIT_GRACEFULLY:
            raise RendezvousGracefulExitError(f"the rendezvous {run_id!r} is closed; spare {node} leaves")  # fmt: skip
        if action is Action.ERROR_TIMEOUT:
            raise RendezvousTimeoutError(f"node {node} did not join a complete round of {run_id!r} "
                                         f"within join_timeout={self._settings.join_timeout} s")  # fmt: skip

    def _request_join(self, now: float, deadline: float) -> RendezvousInfo | None:
        """Ask the applier to place this node; its place once the round it joined is
        complete (within a dead-node timeout), or None to look at the state again."""
        ack = self._queue.request(self._node, self._interrupted.is_set)
        if ack is None or not ack.participant:
            return None
        if ack.place is not None:  # this request completed the round
            return self._info(ack.round, ack.place)
        if ack.complete:
            got = self._rdzv.assignment(ack.round, self._node)
        else:
            timeout = min(self._settings.dead_after, deadline - now)
            got = self._rdzv.await_place(ack.round, self._node, ack.epoch, timeout, self._interrupted.is_set)  # fmt: skip
        return None if got is None else self._info(ack.round, got)

    def _sync(
        self,
        state: RendezvousState,
        now: float,
        deadline: float,
        while_waiting: Callable[[], None] | None,
    ) -> RendezvousInfo | None:
        """Wait for the state to change (running ``while_waiting`` beside a running
        round); this node's place when its round completed meanwhile, else None."""
        beside = state.complete and self._node not in state.participants  # spare, waiting
        if while_waiting is not None and beside:
            while_waiting()
        timeout = self._sync_timeout(state, now, deadline)
        if self._node not in state.participants:
            self._rdzv.wait_change(state, timeout)
            return None
        got = self._rdzv.await_place(state.round, self._node, state.epoch, timeout, self._interrupted.is_set)  # fmt: skip
        return None if got is None else self._info(state.round, got)

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
                logger.warning("the workers' store admits every address: the nodes' addresses"
                               " %s are not all IP literals (give --local-addr as an IP to "
                               "restrict it)", sorted(state.participants))  # fmt: skip
        logger.info("rendezvous %s round %d complete: node %s has rank %d of %d",
                    self._settings.run_id, round_, self._node, rank, world_size)  # fmt: skip
        return RendezvousInfo(
            store=PrefixStore.over(self._store, f"{self._rdzv.prefix}round/{round_}/"),
            rank=rank,
            world_size=world_size,
            round=round_,
            peers=peers,
            incarnation=place.incarnation,
        )

    def _sync_timeout(self, state: RendezvousState, now: float, deadline: float) -> float:
        timeout = self._settings.dead_after
        if state.deadline is not None and self._node in state.participants:
            timeout = min(timeout, state.deadline - now)
        if self._node not in state.redundancy_list:
            timeout = min(timeout, deadline - now + 0.01)
        return max(timeout, 0.001)

    def is_closed(self) -> bool:
        """Whether the rendezvous is closed for good (one small store read when unchanged)."""
        return self._polled.get().closed

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round; > 0 also when a new round started without us.

        The agent restarts its workers and calls :meth:`next_rendezvous` when it is > 0.
        """
        return nodes_waiting(self._polled.get(), self._round)

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

    def record_failure(self, failed_round: int) -> int:
        """Count a failure restart of the job for ``failed_round``; return the job's total.

        Every agent that sees a worker failure in round ``r`` calls this with ``r``;
        the restart is counted once per round, however many nodes report it.
        """
        return count_failure(self._rdzv, failed_round)

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

    def shutdown(self) -> bool:
        """Leave the rendezvous for good, without closing it; release threads and connections.

        The store's host (the TCP server's; the embedded member the others reach last)
        waits up to ``close_timeout`` until every other node left or died. False when
        leaving failed (the heartbeat then expires on its own). Idempotent."""
        if self._shut:
            return True
        self._shut = True
        self._keep_alive.follow(None)  # a leaving successor is not a lost one
        ok = True
        try:
            embedded = self._embedded
            serving = self._hosts_store or (embedded is not None and embedded.is_member)
            known = self._rdzv.load()[0].known() | self._polled.seen if serving else ()
            if embedded is not None:  # no seat taken from now on
                embedded.leaving()
            if self._joined:  # beating until the leave landed: one that stops is dead
                leave(self._queue, self._node, self._settings, self._clock, self._keep_alive.stop)
            if (embedded is None or not embedded.leave()) and serving:
                wait_for_others(self._rdzv, self._node, self._settings, self._clock, known)
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
