"""Fixed-membership rendezvous: ``--rdzv-backend=static`` and ``--standalone``.

Static: every node knows its rank (``--node-rank``) and the node count; node 0
hosts a TCP store at ``--master-addr:--master-port`` (or the endpoint). Each
round is a barrier of all nodes on that store: every node writes its own join
record (``round/<n>/node/<rank>``) and the round is complete when all of them are
there, so a node that restarts its workers makes the others restart too (they see
it waiting). ``--rdzv-conf`` keys: ``join_timeout`` (seconds, default 600) and
``secret_file`` (every record signed with the job's secret, as for the dynamic
backends: a node without it, or with another, cannot join). Standalone: one node,
no network at all. Once joined, a store that cannot be reached again within 5 s
(:data:`RECONNECT_TIMEOUT`) is lost: node 0 is gone, and the other nodes end. So node
0, at its end, keeps the store up until the others left (:data:`LEAVE_TIMEOUT` at
most): a node that learns from the store that the job ended (closed by a node that
gave up) reads the failures published there for its report.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from relaunch._endpoint import any_address, split_endpoint
from relaunch.errors import (
    ConfigError,
    RendezvousClosedError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreError,
    StoreTimeoutError,
)
from relaunch.rendezvous._settings import check_conf_keys, conf_seconds
from relaunch.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousParameters
from relaunch.store import Store
from relaunch.store.memory import MemoryStore
from relaunch.store.prefix import PrefixStore

__all__ = [
    "STATIC_CONF_KEYS",
    "StandaloneRendezvousHandler",
    "StaticRendezvousHandler",
    "create_static_handler",
]

log = logging.getLogger(__name__)

_CLOSED_KEY = "closed"
_LEFT_KEY = "left"
LEAVE_TIMEOUT = 10.0
"""Seconds node 0 waits at its end for the nodes still using its store to leave."""
STATIC_CONF_KEYS = ("join_timeout", "secret_file")
"""The ``--rdzv-conf`` keys the static backend reads (any other is refused)."""
SILENT_TIMEOUT = 30.0
"""Once joined, node 0's machine silent this long (its link down: no close arrives) is
gone; a shorter drop is ridden out, as the workers' collectives ride it out."""
RECONNECT_TIMEOUT = 5.0
"""Once joined, node 0's store that broke a connection and cannot be reached again
for this long is gone (node 0 is): a call fails then, whichever thread (the agent's
loop, the snapshot puller) met the break first. (The join itself waits up to
``join_timeout`` for node 0 to start.)"""


class StandaloneRendezvousHandler:
    """One node, one process: every round completes at once with rank 0 of 1."""

    def __init__(self, run_id: str | None = None) -> None:
        self._run_id = run_id or uuid.uuid4().hex
        self._round = 0
        self._closed = False
        self._failed_rounds: set[int] = set()
        self._store = MemoryStore()

    def get_backend(self) -> str:
        return "standalone"

    def next_rendezvous(self, while_waiting: Callable[[], None] | None = None) -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
        info = RendezvousInfo(
            store=PrefixStore(self._store, f"round/{self._round}/"),
            rank=0,
            world_size=1,
            round=self._round,
        )
        self._round += 1
        return info

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 1 if self._closed else 0

    def round_ended(self) -> bool:
        return False  # one node: no other can end its round

    def interrupt(self) -> None:
        self._closed = True

    def record_failure(self, failed_round: int) -> int:
        if failed_round not in self._failed_rounds:
            self._failed_rounds.add(failed_round)
        return len(self._failed_rounds)

    def restart_count(self) -> int:
        return len(self._failed_rounds)

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self, *, leave: bool = True) -> bool:
        self._store.close()
        return True


class StaticRendezvousHandler:
    """``nnodes`` fixed nodes; node 0 hosts the store; a round is a barrier of all of them."""

    def __init__(
        self,
        *,
        run_id: str,
        host: str,
        port: int,
        node_rank: int,
        num_nodes: int,
        timeout: float = 600.0,
        bind_host: str = "0.0.0.0",
        secret: bytes | None = None,
    ) -> None:
        from relaunch.store.tcp import TCPStoreClient, TCPStoreServer

        if not 0 <= node_rank < num_nodes:
            raise ConfigError(f"--node-rank: expected 0..{num_nodes - 1}, got {node_rank}")
        self._run_id = run_id
        self._rank = node_rank
        self._size = num_nodes
        self._timeout = timeout
        self._round = 0
        self._joined = False  # a round completed: every node uses the store
        self._shut = False
        self._interrupted = threading.Event()
        self._server: TCPStoreServer | None = None
        if node_rank == 0:
            self._server = TCPStoreServer(host=bind_host, port=port)
            self._server.start()
        client: Store = TCPStoreClient(
            host,
            port,
            timeout=timeout,
            reconnect_timeout=RECONNECT_TIMEOUT,
            silent_timeout=SILENT_TIMEOUT,
            prefix=f"static/{run_id}",
        )
        if secret is not None:
            from relaunch.store.signed import SignedStore

            client = SignedStore.over(client, secret)
        self._client = client

    def get_backend(self) -> str:
        return "static"

    def next_rendezvous(self, while_waiting: Callable[[], None] | None = None) -> RendezvousInfo:
        if self.is_closed():
            raise RendezvousClosedError(f"rendezvous {self._run_id!r} is closed")
        rnd = self._round
        self._round += 1
        store = PrefixStore(self._client, f"round/{rnd}/")
        store.add("joined", 1)  # what num_nodes_waiting counts
        # Each node writes its own record (signed with the job's secret, if any), so a
        # round completes only with every rank present, once each.
        store.set(f"node/{self._rank}", str(self._rank).encode())
        records = [f"node/{rank}" for rank in range(self._size)]
        deadline = time.monotonic() + self._timeout
        refused_seen: set[str] = set()
        while True:  # in slices, so that interrupt() is honoured
            if self._interrupted.is_set():
                raise RendezvousClosedError(f"rendezvous {self._run_id!r} interrupted")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousTimeoutError(
                    f"static rendezvous round {rnd}: not all {self._size} nodes joined within "
                    f"{self._timeout:.0f}s"
                )
            try:
                store.wait(records, timeout=min(1.0, left))
            except StoreTimeoutError:
                continue
            refused = self._refused_record(store, rnd)
            if refused is None:
                break
            if refused not in refused_seen:  # a stranger's record: wait for the real node's
                refused_seen.add(refused)
                log.warning("%s; waiting for the node of that rank", refused)
            self._interrupted.wait(0.2)
        self._joined = True
        return RendezvousInfo(store=store, rank=self._rank, world_size=self._size, round=rnd)

    def _refused_record(self, store: Store, rnd: int) -> str | None:
        """Why a join record of round ``rnd`` is refused (signed with another secret, or
        with none when the job has one), or None when all of them are valid.

        Node 0 hosts the store: a node that cannot verify node 0's record is the one
        without the job's secret, and ends with RendezvousStateError. A refused record
        of another rank is a stranger's, which the real node of that rank overwrites."""
        from relaunch.store.signed import is_signed

        for rank in range(self._size):
            key = f"node/{rank}"
            try:
                raw = store.get(key)
            except RendezvousStateError as exc:  # this job signs: unsigned or forged
                why = str(exc)
            else:
                if raw == str(rank).encode():
                    continue
                why = f"the record at key {key!r} is not rank {rank}'s: refused"
                if raw is not None and is_signed(raw):
                    why = (
                        f"the record at key {key!r} is signed with a job secret this node "
                        "does not have (--rdzv-conf secret_file): refused"
                    )
            why = f"static rendezvous round {rnd}: {why}"
            if rank == 0 and self._rank != 0:
                raise RendezvousStateError(
                    f"{why}; node 0 hosts this job's store: this node's secret is not the job's"
                )
            if rank == self._rank:  # a stranger overwrote ours
                store.set(key, str(rank).encode())
            return why
        return None

    def interrupt(self) -> None:
        self._interrupted.set()

    def is_closed(self) -> bool:
        return self._client.get(_CLOSED_KEY) is not None

    def set_closed(self) -> None:
        self._client.set(_CLOSED_KEY, b"1")

    def num_nodes_waiting(self) -> int:
        if self.is_closed():
            return 1
        # A counter (add, never signed): read it with add(0), never get.
        return max(0, self._client.add(f"round/{self._round}/joined", 0))

    def round_ended(self) -> bool:
        # A node joined the next round: it restarts, and the others must too.
        return self._client.add(f"round/{self._round}/joined", 0) > 0

    def record_failure(self, failed_round: int) -> int:
        marker = f"failed/{failed_round}"
        _, first = self._client.compare_set(marker, None, b"1")
        if first:
            total = self._client.add("restarts", 1)
            self._client.set(f"{marker}/total", str(total).encode())
            return total
        self._client.wait([f"{marker}/total"], timeout=self._timeout)
        return int(self._client.get(f"{marker}/total") or b"0")

    def restart_count(self) -> int:
        return self._client.add("restarts", 0)

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self, *, leave: bool = True) -> bool:
        if self._shut:
            return True
        self._shut = True
        if leave:
            self._say_left()
        self._client.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        return True

    def _say_left(self) -> None:
        """Count this node out; the store's host waits (``LEAVE_TIMEOUT`` at most) until
        every node did, so that none finds the store gone before its own leave."""
        try:  # a counter (add, never signed)
            left = self._client.add(_LEFT_KEY, 1) if self._joined else self._size
            deadline = time.monotonic() + LEAVE_TIMEOUT
            # (a node told to stop does not wait: the others learn of it as of a loss)
            while self._server is not None and left < self._size:
                if self._interrupted.is_set():
                    break
                if time.monotonic() >= deadline:
                    log.warning(
                        "static rendezvous: %d of %d nodes left; closing the store",
                        left, self._size,
                    )  # fmt: skip
                    break
                time.sleep(0.05)
                left = self._client.add(_LEFT_KEY, 0)
        except StoreError as exc:
            log.warning("static rendezvous: could not say this node left: %s", exc)


def create_static_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the static handler from the command line's rendezvous parameters."""
    if params.node_rank is None:
        raise ConfigError("--node-rank: required with --rdzv-backend=static")
    if params.min_nodes != params.max_nodes:
        raise ConfigError(
            f"--nnodes: the static backend needs a fixed node count, got "
            f"{params.min_nodes}:{params.max_nodes}"
        )
    check_conf_keys(params.conf, STATIC_CONF_KEYS)
    host, port = split_endpoint(params.endpoint, None)
    timeout = conf_seconds(params.conf, "join_timeout", 600.0)
    secret = None
    if "secret_file" in params.conf:
        from relaunch.store.signed import read_secret

        secret = read_secret(params.conf["secret_file"])
    bind = params.local_addr or any_address(host)  # ("::" takes IPv4 too)
    return StaticRendezvousHandler(
        run_id=params.run_id,
        host=host,
        port=port,
        node_rank=params.node_rank,
        num_nodes=params.max_nodes,
        timeout=timeout,
        bind_host=bind,
        secret=secret,
    )
