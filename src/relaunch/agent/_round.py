"""What the agents of one round share through its store (the round's protocol).

Keys live under the round's own prefix, so no round sees another's:

- ``relaunch/worker_store``: ``{"addr", "port"}`` of the store the rank-0 node hosts
  for this round's workers;
- ``relaunch/failures/<group rank>``: a node's failed workers (versioned JSON of
  ProcessFailure records), for the one report every node prints;
- ``relaunch/exit_barrier/*``: nodes done with the round.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from relaunch._endpoint import any_address, quiet_port
from relaunch._json import loads as json_loads
from relaunch.agent._spec import StopRequest
from relaunch.errors import (
    FailureFormatError,
    ProcessFailure,
    RendezvousError,
    RendezvousStateError,
    StoreConnectionError,
    StoreError,
    StoreLostError,
    StoreTimeoutError,
)
from relaunch.events import Emit, ExitBarrierTimeout
from relaunch.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    ReplicatedStore,
    TieredMembership,
)
from relaunch.store.tcp import TCPStoreServer

if TYPE_CHECKING:
    from relaunch.agent._spec import WorkerSpec

__all__ = [
    "BarrierEnd",
    "WorkerStore",
    "barrier_note",
    "close_rendezvous",
    "depart_round",
    "exit_barrier",
    "finish_round",
    "gather_failures",
    "leave_rendezvous",
    "moved_on",
    "publish_failures",
    "publish_worker_store",
    "read_worker_store",
    "round_finishing",
    "store_lost_reason",
]

log = logging.getLogger(__name__)

_WORKER_STORE_KEY = "relaunch/worker_store"
_FAILURES_KEY = "relaunch/failures/"
_EXIT_COUNT_KEY = "relaunch/exit_barrier/count"
_EXIT_DONE_KEY = "relaunch/exit_barrier/done"


def publish_worker_store(info: RendezvousInfo, addr: str, port: int) -> None:
    """Rank 0 tells the others where this round's workers' store is."""
    info.store.set(_WORKER_STORE_KEY, json.dumps({"addr": addr, "port": port}).encode())


def moved_on(handler: RendezvousHandler) -> bool:
    """Whether the node's round is over: a newer round, nodes waiting, or closed."""
    return handler.num_nodes_waiting() > 0 or handler.is_closed()


_MOVED_ON_EVERY = 1.0
"""Seconds between the looks, while waiting for rank 0's address, at whether the round
moved on (its rank 0 lost before it said where, say)."""


def read_worker_store(
    info: RendezvousInfo, timeout: float, moved_on: Callable[[], bool] = lambda: False
) -> tuple[str, int] | None:
    """Wait for rank 0's worker store address; None once ``moved_on()`` says the round
    is over without it (asked every second while it is missing: rank 0 says where within
    milliseconds of the round, so a look is only made when something went wrong).
    Raises StoreTimeoutError after ``timeout`` s, RendezvousError on a corrupt record."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            info.store.wait([_WORKER_STORE_KEY], timeout=max(min(_MOVED_ON_EVERY, left), 0.001))
            break
        except StoreTimeoutError as exc:
            if moved_on():
                log.warning("rendezvous round %d ended before its rank 0 said where its "
                            "workers' store is (the node lost?): joining the next round",
                            info.round)  # fmt: skip
                return None
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(
                    f"rank 0 did not say where its workers' store is within {timeout:g} s "
                    f"({_WORKER_STORE_KEY!r} not set)"
                ) from exc
    raw = info.store.get(_WORKER_STORE_KEY)
    try:
        data = json_loads(raw or b"")
        return str(data["addr"]), int(data["port"])
    except (ValueError, KeyError, TypeError) as exc:
        raise RendezvousError(
            f"corrupt worker store address at {_WORKER_STORE_KEY!r}: {raw!r:.200}"
        ) from exc


def publish_failures(info: RendezvousInfo, failures: dict[int, ProcessFailure]) -> None:
    """Put this node's failures (by global rank) in the round store. Never raises."""
    if info.world_size <= 1:
        return
    record = {str(rank): f.to_json() for rank, f in failures.items()}
    try:
        info.store.set(
            f"{_FAILURES_KEY}{info.rank}",
            json.dumps({"version": 1, "failures": record}).encode(),
        )
    except StoreLostError:
        pass  # (the job ends with the line that says why)
    except StoreError as exc:
        log.warning("could not publish failures: %s", exc)


def gather_failures(
    info: RendezvousInfo, own: dict[int, ProcessFailure], wait: float = 2.0
) -> dict[int, ProcessFailure]:
    """Every node's published failures of the round, ours included: the job's report.

    Waits up to ``wait`` seconds for nodes whose workers fail at the same moment;
    a corrupt record is logged and skipped. Never raises.
    """
    found = dict(own)
    if info.world_size <= 1:
        return found
    deadline = time.monotonic() + wait
    pending = set(range(info.world_size)) - {info.rank}
    while pending:
        for rank in sorted(pending):
            try:
                raw = info.store.get(f"{_FAILURES_KEY}{rank}")
            except StoreError:
                return found
            if raw is None:
                continue
            pending.discard(rank)
            try:
                data = json_loads(raw)
                for grank, failure in data["failures"].items():
                    found.setdefault(int(grank), ProcessFailure.from_json(failure))
            except (ValueError, KeyError, TypeError, AttributeError, FailureFormatError) as exc:
                log.warning("node %s published a corrupt failure record: %s", rank, exc)
        if not pending or time.monotonic() >= deadline or (found and not own):
            break
        time.sleep(0.05)
    return found


class BarrierEnd(enum.Enum):
    """How a node's wait at the exit barrier ended."""

    PASSED = "passed"
    """Every node of the round arrived (the lost ones nobody replaced excepted)."""
    ROUND_ENDED = "round_ended"
    """Another node left the round before it arrived (a failure, a lost node): the job
    is not done, and this node runs its workers again in the next round."""
    CLOSED = "closed"
    """The job was closed meanwhile: another node gave up on it."""
    TIMED_OUT = "timed_out"
    """Not every node arrived within the timeout (or the store failed): the other nodes'
    outcome is unknown."""
    STOPPED = "stopped"
    """This agent was told to stop (a signal) while it waited: it stops now, not after
    the other nodes or the timeout."""


def exit_barrier(
    info: RendezvousInfo,
    timeout: float,
    vacant: Callable[[], int] = lambda: 0,
    over: Callable[[], BarrierEnd | None] = lambda: None,
) -> BarrierEnd:
    """Wait until every node of the round is done (``vacant()``: ranks of lost nodes
    that nobody replaced, which never arrive), or ``over()`` says why they never will
    (asked twice a second while some are missing). Never raises."""
    if info.world_size <= 1:
        return BarrierEnd.PASSED
    deadline = time.monotonic() + timeout
    try:
        count = info.store.add(_EXIT_COUNT_KEY, 1)
        while count < info.world_size - vacant():
            left = deadline - time.monotonic()
            try:
                info.store.wait([_EXIT_DONE_KEY], timeout=max(0.001, min(left, 0.5)))
                return BarrierEnd.PASSED
            except StoreTimeoutError:
                if left <= 0.5:
                    raise
            count = info.store.add(_EXIT_COUNT_KEY, 0)
            if count < info.world_size - vacant() and (end := over()) is not None:
                # (the last node may have arrived meanwhile, and rank 0 closed the job
                # after it passed: then this node passes too)
                count = info.store.add(_EXIT_COUNT_KEY, 0)
                if count < info.world_size - vacant():
                    return end
        info.store.set(_EXIT_DONE_KEY, b"1")
    except (StoreError, RendezvousError) as exc:
        log.warning("exit barrier: %s (other nodes may still be running)", exc)
        return BarrierEnd.TIMED_OUT
    return BarrierEnd.PASSED


def barrier_note(info: RendezvousInfo | None, timeout: float) -> str:
    """What to tell the user when not every node arrived at the exit barrier."""
    world_size = info.world_size if info is not None else 1
    return (
        f"this node's workers succeeded, but not every node of the round (world size "
        f"{world_size}) reached the exit barrier within {timeout:g} s: the other "
        "nodes' outcome is unknown"
    )


def round_finishing(info: RendezvousInfo | None) -> bool:
    """Whether a node of the round already waits at its exit barrier (its workers
    succeeded): the round cannot take in new nodes any more. Raises StoreError."""
    return info is not None and info.store.add(_EXIT_COUNT_KEY, 0) > 0


def finish_round(
    handler: RendezvousHandler,
    info: RendezvousInfo | None,
    timeout: float,
    emit: Emit,
    stop: StopRequest | None = None,
) -> BarrierEnd:
    """This node's workers succeeded: wait for the round's other nodes (the lost ones
    nobody replaced excepted); then the job is over: rank 0 closes the rendezvous, so
    spares still waiting in it learn that they are not needed. A node that leaves the
    round meanwhile (to restart it after a failure, or lost) ends the wait: the job
    goes on, this node with it; so does ``stop`` (a signal to this agent)."""
    if info is None:
        return BarrierEnd.PASSED
    tiers = handler if isinstance(handler, TieredMembership) else None

    def over() -> BarrierEnd | None:
        if stop is not None and stop.signum is not None:
            return BarrierEnd.STOPPED
        if handler.is_closed():
            return BarrierEnd.CLOSED
        return BarrierEnd.ROUND_ENDED if handler.round_ended() else None

    end = exit_barrier(
        info, timeout, vacant=lambda: len(tiers.vacancies()) if tiers else 0, over=over
    )
    if end is BarrierEnd.TIMED_OUT:
        emit(ExitBarrierTimeout(world_size=info.world_size))
    elif end is BarrierEnd.PASSED and info.rank == 0:
        try:
            handler.set_closed()
        except (RendezvousError, StoreError) as exc:
            log.warning("could not close the rendezvous after success: %s", exc)
    return end


def store_lost_reason(handler: RendezvousHandler, exc: BaseException) -> str:
    """The one line that ends a job whose rendezvous store cannot be reached (or whose
    state stayed corrupt: RendezvousStateError)."""
    if isinstance(exc, RendezvousStateError):
        return f"{exc} (for longer than this node can go on without it)"
    if isinstance(handler, ReplicatedStore):
        said = handler.store_lost_reason(exc)
        if said is not None:
            return said
    if handler.get_backend() == "c10d":
        return (
            f"the node hosting the c10d rendezvous store was lost, or this node's link to "
            f"it ({exc}); the job cannot go on without it (a job of --nnodes 3 or more "
            "runs it as an etcd cluster on three of its nodes, which survives it, and so "
            "does a smaller one with a spare under --rdzv-conf store_members=3; or use "
            "--rdzv-backend etcd)"
        )
    return f"the rendezvous store cannot be reached ({exc})"


class WorkerStore:
    """The store this node hosts for a round's workers (``MASTER_ADDR:MASTER_PORT``),
    when it is the round's rank 0: a fresh one each round; the other nodes read its
    address."""

    def __init__(self, spec: WorkerSpec, host: str) -> None:
        self._spec = spec
        self._host = host
        self._server: TCPStoreServer | None = None

    def open(
        self, info: RendezvousInfo, moved_on: Callable[[], bool] = lambda: False
    ) -> tuple[str, int] | None:
        """The round's store address; rank 0 closes the last round's server, starts one
        and publishes its address. None when ``moved_on()`` says the round is over
        before rank 0 said where (:func:`read_worker_store`)."""
        self.close()
        spec = self._spec
        if info.rank != 0:
            timeout = max(60.0, spec.exit_barrier_timeout)
            return read_worker_store(info, timeout=timeout, moved_on=moved_on)
        local = "127.0.0.1" if info.world_size == 1 else self._host
        addr = spec.master_addr or spec.local_addr or local
        bind = addr if addr.startswith("127.") else any_address(addr)  # (127.0.0.2 too)
        given = spec.master_port if info.world_size == 1 and spec.master_port else None
        server = _start_worker_store(bind, given, info.peers)
        if info.world_size > 1:
            try:
                publish_worker_store(info, addr, server.port)
            except BaseException:
                server.close()
                raise
        self._server = server
        return addr, server.port

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()


_PORT_TRIES = 3
_PROGRAM_PORTS = 2
"""The ports after ``MASTER_PORT`` that are free when it is chosen: programs written after
NVIDIA's examples host stores of their own at ``MASTER_PORT + 1`` and ``+ 2``."""


def _start_worker_store(
    bind: str, given: int | None, peers: frozenset[str] | None
) -> TCPStoreServer:
    """The workers' store server, started: at the port the user gave, else at a port
    outside the ephemeral range with the next two free (:func:`quiet_port`), and at
    another such port when a process took the chosen one meanwhile."""
    if given:
        return TCPStoreServer(host=bind, port=given, allowed=peers).start()
    for _ in range(_PORT_TRIES - 1):
        port = quiet_port(bind, spare=_PROGRAM_PORTS)
        try:
            return TCPStoreServer(host=bind, port=port, allowed=peers).start()
        except StoreConnectionError:
            log.info("port %d was taken before the workers' store bound it", port)
    port = quiet_port(bind, spare=_PROGRAM_PORTS)
    return TCPStoreServer(host=bind, port=port, allowed=peers).start()


def leave_rendezvous(handler: RendezvousHandler, *, store_lost: bool = False) -> None:
    """Shut the rendezvous handler down (its heartbeats, its store), whatever happened;
    once its store is known lost, without a call to it."""
    try:
        handler.shutdown(leave=not store_lost)
    except (RendezvousError, StoreError) as exc:
        log.warning("rendezvous shutdown failed: %s", exc)


def depart_round(handler: RendezvousHandler) -> None:
    """Before the workers stop for a signal: take this node out of its running round
    (``TieredMembership.depart``), so that the other nodes go on from it without
    spending a restart; a store that does not answer is said, and the workers stop."""
    if isinstance(handler, TieredMembership):
        try:
            handler.depart()
        except (RendezvousError, StoreError) as exc:
            log.warning("could not leave the running round before stopping: %s", exc)


def close_rendezvous(handler: RendezvousHandler) -> None:
    """Close the rendezvous after the job's last failure: the other nodes stop too (a
    store that does not answer is said, not raised: this node ends either way)."""
    try:
        handler.set_closed()
    except (RendezvousError, StoreError) as exc:
        log.warning("could not close the rendezvous: %s", exc)
