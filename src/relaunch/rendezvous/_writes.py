"""The handler's one-shot writes to the shared state, each a compare-and-set loop:
close, count a failure, mark a node in-process, leave, and (for the node hosting the
store) wait until every other node is gone."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

from relaunch.errors import (
    RendezvousError,
    RendezvousTimeoutError,
    StoreConnectionError,
    StoreTimeoutError,
)
from relaunch.rendezvous._backend import StateBackend
from relaunch.rendezvous._ops import (
    Action,
    apply,
    decide_close,
    decide_depart,
    decide_exit,
    decide_leave,
    record_failure,
    went_on,
)
from relaunch.rendezvous._queue import RequestQueue
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState

__all__ = [
    "claim_store_host",
    "close",
    "count_failure",
    "depart",
    "leave",
    "leave_round",
    "mark_inprocess",
    "wait_for_others",
]

_LAST_CALL_POLL = 0.02
"""Seconds between two looks at the heartbeats of the nodes the store's host waits for."""


def claim_store_host(
    rdzv: StateBackend, node: str, settings: RendezvousSettings, clock: Callable[[], float]
) -> None:
    """Record that ``node`` hosts the rendezvous store (it takes rank 0 of each round)."""
    state, raw = rdzv.load()
    while state.store_host != node and not state.closed:
        new = apply(Action.CLAIM_STORE_HOST, state, node, clock(), settings)
        state, raw, _ = rdzv.commit(state, raw, new)


def close(
    rdzv: StateBackend, node: str, settings: RendezvousSettings, clock: Callable[[], float]
) -> None:
    """Close the rendezvous for good: every node's next_rendezvous raises closed."""
    deadline = clock() + settings.close_timeout
    late = f"could not close {settings.run_id!r} in time"
    _drive(rdzv, node, settings, clock, decide_close, deadline, late)


def leave_round(
    rdzv: StateBackend,
    node: str,
    settings: RendezvousSettings,
    clock: Callable[[], float],
    deadline: float,
) -> tuple[RendezvousState, bytes | None]:
    """Take ``node`` out of its current round (before it joins the next one); returns
    the state it left."""

    def decide(state: RendezvousState, now: float, until: float) -> Action:
        return decide_exit(state, node, now, until)

    late = f"node {node} could not leave its round"
    return _drive(rdzv, node, settings, clock, decide, deadline, late)


def depart(
    queue: RequestQueue,
    node: str,
    settings: RendezvousSettings,
    clock: Callable[[], float],
    deadline: float,
) -> None:
    """Take ``node`` out of its running round as a lost node is (the round reopens, or
    keeps a vacancy for in-process workers), before it stops its workers: the others'
    workers then fail on its closed connections after their job went on, which spends
    no restart (:func:`~relaunch.rendezvous._ops.went_on`). A request in the queue, as
    a leave is (a whole job told to stop departs in batches, one write each); the state
    is read only where the queue said to."""

    def decide(state: RendezvousState, now: float, until: float) -> Action:
        return decide_depart(state, node, now, until)

    late = f"node {node} could not leave its running round in time"
    ack = queue.request(node, lambda: clock() > deadline, leave=True, depart=True)
    if ack is None and clock() > deadline:
        raise RendezvousTimeoutError(late)
    if ack is None or not ack.left:  # (an applier of an older version refused it)
        _drive(queue.backend, node, settings, clock, decide, deadline, late)


def _drive(
    rdzv: StateBackend,
    node: str,
    settings: RendezvousSettings,
    clock: Callable[[], float],
    decide: Callable[[RendezvousState, float, float], Action],
    deadline: float,
    late: str,
) -> tuple[RendezvousState, bytes | None]:
    """Apply ``decide``'s actions until it says FINISH, and return the state then; past
    ``deadline``, RendezvousTimeoutError(``late``)."""
    state, raw = rdzv.load()
    while True:
        action = decide(state, clock(), deadline)
        if action is Action.FINISH:
            return state, raw
        if action is Action.ERROR_TIMEOUT:
            raise RendezvousTimeoutError(late)
        new = apply(action, state, node, clock(), settings)
        state, raw, _ = rdzv.commit(state, raw, new)


def count_failure(rdzv: StateBackend, failed_round: int, node: str) -> int | None:
    """Count a failure restart of the job for ``failed_round`` (once however many nodes
    report it); return the job's total, or None when the job had gone on from that
    round before ``node`` reported it (:func:`~relaunch.rendezvous._ops.went_on`:
    nothing is counted)."""
    state, raw = rdzv.load()
    while True:
        if failed_round > state.failed_round and went_on(state, failed_round, node):
            return None
        new = record_failure(state, failed_round)
        if new is state:
            return state.restarts
        state, raw, written = rdzv.commit(state, raw, new)
        if written:
            return state.restarts


def mark_inprocess(
    rdzv: StateBackend,
    node: str,
    round_: int | None,
    settings: RendezvousSettings,
    clock: Callable[[], float],
) -> None:
    """Record that ``node``'s workers restart in-process, while it is a participant of
    round ``round_``."""
    state, raw = rdzv.load()
    while node in state.participants and node not in state.inprocess:
        if round_ is not None and state.round != round_:
            return
        new = apply(Action.MARK_INPROCESS, state, node, clock(), settings)
        state, raw, _ = rdzv.commit(state, raw, new)


def leave(
    queue: RequestQueue,
    node: str,
    settings: RendezvousSettings,
    clock: Callable[[], float],
    stop_beating: Callable[[], None],
) -> None:
    """Drop every trace of ``node`` from the state (within ``close_timeout``): stop its
    heartbeats (``stop_beating``), date its heartbeat so that it is alive until then,
    delete the keys of its last round, ask, and delete its heartbeat key, its last call.

    A leave request in the queue (nodes leaving together, at a job's end, cost one
    write of the state per batch, not one each); the state itself only where the
    queue said to read it, or its ack does not confirm the leave (an applier of an
    older version refused the request): a fallback for every node of a slow mass
    leave would cost O(N^2) (16,384 nodes: 11 MB read by each). The node must not be
    taken for dead before its leave lands (a dead participant reopens the round for
    the others), but it does not beat while it waits: at 16,384 nodes, the beats of the
    waiting nodes (and each one's cut into its wait for the ack) kept the store's host
    too busy to apply their leaves, which then took 40 s and more."""
    deadline = clock() + settings.close_timeout

    def decide(state: RendezvousState, now: float, until: float) -> Action:
        return decide_leave(state, node, now, until)

    late = f"node {node} could not leave in time"
    try:
        stop_beating()
        queue.backend.liveness.leaving(node, deadline)
        if queue.spent is not None:  # its keep-alive's last job (kept where refused)
            queue.spent.forget(queue.store)
        ack = queue.request(node, lambda: clock() > deadline, leave=True)
        if ack is None and clock() > deadline:
            # Its request stays queued (a later batch applies it) and its heartbeat
            # dies with the deadline: no read of the state, which past the deadline could
            # only say "too late". Each node of a slow mass leave reading it cost O(N^2):
            # at 16,384 simulated nodes, 430 KB each, the nodes' processes ran out of memory.
            raise RendezvousTimeoutError(late)
        if ack is None or not ack.left:
            _drive(queue.backend, node, settings, clock, decide, deadline, late)
    finally:
        with contextlib.suppress(StoreConnectionError):
            queue.backend.liveness.forget(node)


def wait_for_others(
    rdzv: StateBackend,
    node: str,
    settings: RendezvousSettings,
    clock: Callable[[], float],
    known: Iterable[str] = (),
) -> None:
    """Wait (up to ``close_timeout``) until every other node left or died, and made
    its last call: the node hosting the store closes it afterwards, and no node
    restarting is stranded. ``known``: nodes that this node saw in the state (those
    that left before it, or in its own batch of leaves, are out of it already)."""
    deadline = clock() + settings.close_timeout
    state, raw = rdzv.load()
    seen = set(known)
    while True:
        now = clock()
        new, dead = rdzv.remove_dead(state, now)
        if dead:
            state, raw, _ = rdzv.commit(state, raw, new)
            continue
        others = set(state.last_heartbeats) | set(state.participants) | state.wait_list
        others.discard(node)
        seen |= others
        if not others:
            # The last node to leave wrote the state, then sets ``epoch/<n>`` to wake
            # waiters, and the acks of its batch of requests with the handover of the
            # queue's next ticket: let those land before the server goes away.
            if state.epoch > 0:
                rdzv.wait_epoch(state.epoch - 1, max(deadline - now, 0.0))
            if state.applied > 0:
                with contextlib.suppress(StoreTimeoutError):
                    handover = f"{rdzv.prefix}ack/{state.applied + 1}"
                    rdzv.store.wait(
                        [handover], max(min(settings.dead_after, deadline - now), 0.001)
                    )
            seen.discard(node)
            _await_last_calls(rdzv, seen, settings, min(deadline - clock(), settings.dead_after))
            return
        if now >= deadline:
            raise RendezvousError(
                f"nodes {sorted(others)} still use the store this node hosts; closing it"
            )
        rdzv.wait_change(state, min(settings.keep_alive_interval, deadline - now))
        state, raw = rdzv.load()


def _await_last_calls(
    rdzv: StateBackend, nodes: set[str], settings: RendezvousSettings, seconds: float
) -> None:
    """Until each of ``nodes`` deleted its heartbeat (a leaving node's last call, after
    it read its ack) or let it go stale (a dead one: unchanged for the dead-node delay,
    or on a store with leases for as long as a live node's heartbeats are apart,
    :meth:`~relaunch.rendezvous._liveness.Liveness.beating`), for ``seconds`` at
    most: a node whose call met the closed server would retry its connection for
    seconds."""
    end = time.monotonic() + seconds
    stale = max(settings.dead_after, rdzv.liveness.beat_every)
    while nodes and time.monotonic() < end:
        # (credited in full: a node long dead is stale at the first read, and one whose
        # clock is behind is, at worst, not waited for)
        nodes = rdzv.liveness.beating(nodes, stale, credit=stale)
        if nodes:  # (a look reads every heartbeat still there: longer gaps for more)
            time.sleep(_LAST_CALL_POLL + len(nodes) * 1e-5)
