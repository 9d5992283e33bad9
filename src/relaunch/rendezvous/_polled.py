"""The state as the agent polls it: cached until a write that matters, kept through a
short corruption, retried once through a broken connection."""

from __future__ import annotations

import logging
import threading

from relaunch.errors import (
    RendezvousClosedError,
    RendezvousStateError,
    StoreConnectionError,
    StoreLostError,
)
from relaunch.rendezvous._backend import StateBackend
from relaunch.rendezvous._corrupt import CorruptWatch
from relaunch.rendezvous._epochs import EpochWatch
from relaunch.rendezvous._state import RendezvousState
from relaunch.store import has_leases

__all__ = ["PolledState", "load_through_corruption"]

logger = logging.getLogger(__name__)


class PolledState:
    """One cheap read per poll: the cached state while the epoch did not move. On a
    store with leases (etcd), the epoch is watched (:class:`EpochWatch`) and a poll
    reads the store only while the watch cannot vouch for it. :meth:`close` stops the
    watch."""

    def __init__(self, backend: StateBackend, corrupt: CorruptWatch, node: str) -> None:
        self._rdzv = backend
        self._corrupt = corrupt
        self._cached: RendezvousState | None = None
        self.seen: set[str] = set()
        """Every node a state read here named (the store's host waits for their last
        calls before it closes: those that left before it may still be making them)."""
        self._watch = (
            EpochWatch(backend.store, backend.epoch_key, node)
            if has_leases(backend.store)
            else None
        )

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()

    def forget(self) -> None:
        """Read the state afresh next time (a new round began)."""
        self._cached = None

    def get(self) -> RendezvousState:
        """The current state. Raises StoreError when the store is gone, and
        RendezvousStateError when the state stayed corrupt for ``dead_after``."""
        # A broken connection is retried once (the client's own reconnection retries
        # are bounded); a store still unreachable then is gone.
        try:
            try:
                state = self._read()
            except StoreLostError:
                raise  # (gone for good: nothing to retry)
            except StoreConnectionError as exc:
                logger.warning("rendezvous store read failed (%s); retrying", exc)
                state = self._read()
        except RendezvousStateError as exc:
            # The last valid state while the shared one is corrupt, for up to dead_after
            # (someone may fix it); then the error, as for a lost store.
            since = self._corrupt.seen(exc)
            if self._cached is None or self._corrupt.expired(since):
                raise
            return self._cached
        error = self._corrupt.error()  # (seen by the keep-alive thread, every beat)
        if error is not None:
            raise error
        return state

    def _read(self) -> RendezvousState:
        cached = self._cached
        if cached is not None and not self._changed(cached):
            return cached
        self._cached, _ = self._rdzv.load()
        self._corrupt.ok()
        self.seen = self.seen | self._cached.known()  # (a new set: read from other threads)
        return self._cached

    def _changed(self, state: RendezvousState) -> bool:
        # (a watch vouches for at most its wait's bound, 5 s, since its own read of the
        # store: a stream stuck silent costs at most that much delay, as a read of the
        # store every 5 s here would; a broken one is seen at once)
        if self._watch is not None:
            seen = self._watch.changed_since(state.epoch)
            if seen is not None:
                return seen
        return self._rdzv.changed_since(state)


def load_through_corruption(
    backend: StateBackend,
    corrupt: CorruptWatch,
    interrupted: threading.Event,
    *,
    patient: bool,
) -> tuple[RendezvousState, bytes | None]:
    """The state now. While it is corrupt (said once: ``corrupt``), a ``patient`` caller
    (a node that read a valid one and waits for a round) reads again every keep-alive
    interval for up to the dead-node delay, as the agent's polls go on with their last
    valid state; then, or at once when not patient, RendezvousStateError.
    RendezvousClosedError once ``interrupted`` is set."""
    while True:
        try:
            loaded = backend.load()
        except RendezvousStateError as exc:
            if corrupt.expired(corrupt.seen(exc)) or not patient:
                raise
            if interrupted.wait(backend.settings.keep_alive_interval):
                raise RendezvousClosedError("next_rendezvous interrupted") from exc
            continue
        corrupt.ok()
        return loaded
