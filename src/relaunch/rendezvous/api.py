"""What the agent sees of a rendezvous: the handler protocol and its result."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from relaunch.store import Store

__all__ = [
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "ReplicatedStore",
    "SharedBoard",
    "TieredMembership",
]


@dataclass(frozen=True, kw_only=True)
class RendezvousParameters:
    """What the command line says about the rendezvous (validated by the CLI)."""

    backend: str
    """``"static"``, ``"c10d"`` or ``"etcd"``."""
    endpoint: str
    """``host:port`` (c10d, static), or comma-separated ``host:port`` list (etcd)."""
    run_id: str
    """The job id; nodes of another run id are refused."""
    min_nodes: int
    max_nodes: int
    local_addr: str | None = None
    """This node's address as others should reach it; avoids a DNS lookup."""
    node_rank: int | None = None
    """Only for ``static``: this node's fixed rank."""
    conf: Mapping[str, str] = field(default_factory=dict)
    """``--rdzv-conf key=value,...`` as given; each backend validates its keys."""


@dataclass(frozen=True, kw_only=True)
class RendezvousInfo:
    """The outcome of one completed rendezvous round, from this node's point of view."""

    store: Store
    """The round's store, with a key prefix of its own (agents use it for barriers)."""
    rank: int
    """This node's rank in the round (``GROUP_RANK`` of its workers), 0-based."""
    world_size: int
    """Number of nodes taking part in the round (``GROUP_WORLD_SIZE``)."""
    round: int
    """The round number; unique per job and increasing, the same on every node.

    The agent of rank 0 hosts a fresh store for the workers of each round and
    publishes its address in ``store``; so no round sees another's keys.
    """
    peers: frozenset[str] | None = None
    """With a per-job secret: the IP addresses of the round's nodes (the workers' store
    admits connections from these and loopback only); None: no such restriction."""
    admits: Callable[[str], bool] | None = None
    """With :attr:`peers`: whether an IP address is a node of the job now: one of
    :attr:`peers`, or one the state names when read again (at most once a second). For
    what a node serves beyond its round: its snapshots, which a node that joined after
    it may fetch (a spare that took a lost node's place)."""
    incarnation: int = 0
    """The incarnation this node's workers start at: 0, or, for a node that took the
    place of a lost one in a running round (tiered recovery), a number above every
    earlier incarnation of those ranks (``RELAUNCH_INPROCESS_INCARNATION``)."""
    earlier: tuple[Store, ...] = ()
    """The stores of the two rounds before this one, newest first, as their nodes left
    them (a node of this round reads where the last round's nodes serve their
    snapshots); () for the first round, or a backend whose rounds share no store."""


class RendezvousHandler(Protocol):
    """The interface the agent drives. Every backend (static, c10d, etcd) implements it.

    What only some backends can do is an optional capability, a protocol of its own
    that the agent checks for: :class:`TieredMembership` (rounds that go on when a node
    is lost) and :class:`SharedBoard` (a store the job's nodes share).
    """

    def get_backend(self) -> str:
        """The backend name: ``"static"``, ``"c10d"`` or ``"etcd"``."""
        ...

    def next_rendezvous(self, while_waiting: Callable[[], None] | None = None) -> RendezvousInfo:
        """Join the next round and block until it is complete.

        Raises RendezvousClosedError when the job is over, RendezvousTimeoutError
        past the join timeout, RendezvousGracefulExitError for a spare that is
        not needed, RendezvousStateError on a corrupt state. ``while_waiting`` is
        called in the caller's thread every few seconds while the node waits beside
        a running round (a spare, a node waiting to be admitted: it may get ready
        meanwhile); it must not block.
        """
        ...

    def is_closed(self) -> bool:
        """Whether the rendezvous has been closed for good."""
        ...

    def set_closed(self) -> None:
        """Close the rendezvous: no further round will complete."""
        ...

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join the next round (the agent restarts to admit them).

        Also > 0 when a newer round started without this node: the agent must stop
        its workers and call :meth:`next_rendezvous`. A closed rendezvous is not
        news here for the dynamic handler (0: its running workers end on their own,
        and the next :meth:`next_rendezvous` raises RendezvousClosedError); the
        static ones say 1. A caller that must not wait in a closed round asks
        :meth:`is_closed` as well. The agent calls it every monitor interval: keep
        it to one cheap read.
        """
        ...

    def round_ended(self) -> bool:
        """Whether this node's last round is over without it: another node left it to
        restart (after a failure), a lost node reopened it, or a newer round began.
        Nodes waiting to join do not end a round, nor does closing the rendezvous
        (:meth:`is_closed`). A node whose workers finished asks it while it waits for
        the others: it runs them again in the next round. One cheap read."""
        ...

    def record_failure(self, failed_round: int) -> int | None:
        """Count one failure restart of the job for ``failed_round``; return the job's total.

        Every agent whose workers failed in that round calls it; the restart is
        counted once per round however many nodes report it, so the restart
        budget is the job's, not each node's. None when the job had gone on from that
        round first (another node began the next one: a node joined, left or was lost;
        or the job dropped this node while it was silent): the failure follows from
        that, nothing is counted, and the node joins the next round.
        """
        ...

    def restart_count(self) -> int:
        """Failure restarts the job has spent so far (``TORCHELASTIC_RESTART_COUNT``)."""
        ...

    def get_run_id(self) -> str:
        """The job's run id (``--rdzv-id``)."""
        ...

    def interrupt(self) -> None:
        """Make a blocked :meth:`next_rendezvous` raise RendezvousClosedError soon.

        Called from the agent's signal handler: it must only set a flag or an event.
        """
        ...

    def shutdown(self, *, leave: bool = True) -> bool:
        """Leave the rendezvous and release resources (threads, connections). Idempotent.
        ``leave=False``: the store is known lost (the job ends saying so): the
        rendezvous is not left (no leave request, no wait for the others), what the
        handler holds is released (an embedded member still leaves its cluster, when
        its store was not given up)."""
        ...


@runtime_checkable
class TieredMembership(Protocol):
    """A backend whose running round outlives a lost node (tiered recovery): the dynamic
    backends (c10d, etcd). Without it a lost node restarts the round."""

    @property
    def max_nodes(self) -> int:
        """The most nodes a round takes (``--nnodes``'s upper bound): with more than one,
        the round's membership can change (a node joins, leaves or is lost)."""
        ...

    def vacancies(self) -> dict[int, int]:
        """Group ranks of this node's round that lost nodes left (tiered recovery: the
        round goes on), each with the incarnation its replacement starts at. Empty for
        backends without dynamic membership. Called with :meth:`num_nodes_waiting`:
        keep it to the same cheap read."""
        ...

    def replaced(self) -> dict[int, int]:
        """Group ranks of this node's round that a node took over from a lost one, with
        the incarnation its workers started at (so a node that did not see the vacancy
        still learns of the loss). Empty for backends without dynamic membership."""
        ...

    def depart(self) -> None:
        """This node stops while its workers run (the agent got a signal: a scale-down,
        a drained machine): take it out of its round as a lost node is, before its
        workers stop, so that the others go on (their workers' failures on its closed
        connections then spend no restart). Bounded by a few seconds; raises
        RendezvousError or StoreError."""
        ...

    def mark_inprocess(self) -> None:
        """Say that this node's workers restart in-process, so that losing a node of
        the round leaves a vacancy instead of restarting every node (a no-op for
        backends without dynamic membership)."""
        ...


@runtime_checkable
class SharedBoard(Protocol):
    """A backend with a store every node of the job reads: the dynamic backends. The
    agent publishes its status and its workers' imports there (for a spare's fork
    server)."""

    @property
    def node_id(self) -> str:
        """This node's name in the job (the status report's key)."""
        ...

    def set_program(self, program: str) -> None:
        """What this node runs (a node running another program under the job's id is
        refused); before the first round."""
        ...

    def publish_worker_modules(self, modules: bytes) -> None:
        """Publish what this node's workers import (versioned JSON made by the agent),
        for the fork server of a node that has no workers yet (a no-op without a
        shared store). Raises StoreError."""
        ...

    def worker_modules(self) -> bytes | None:
        """What another node published with :meth:`publish_worker_modules`, unchecked
        (None: nothing yet, or no shared store). Raises StoreError."""
        ...

    def publish_status(self, report: bytes) -> None:
        """Publish this node's status report where ``relaunch status`` reads it
        (a no-op for backends without a shared store). Raises StoreError."""
        ...


@runtime_checkable
class ReplicatedStore(Protocol):
    """A backend whose store may be replicated among the job's nodes (the embedded
    etcd members of c10d): its loss is then told member by member."""

    def store_endpoints(self) -> list[tuple[str, int]]:
        """The client endpoints of the store's members this node knows now (a reader
        that must not depend on the endpoint's node uses them); [] when not replicated."""
        ...

    def store_lost_reason(self, exc: BaseException) -> str | None:
        """The line that ends the job when the store cannot be reached (None: the
        backend's usual line)."""
        ...
