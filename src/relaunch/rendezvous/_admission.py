"""With a per-job secret: which addresses belong to the job's nodes now.

A round's servers admit the round's nodes (``RendezvousInfo.peers``). What a node
serves beyond its round outlives that list: a node whose workers finished, or whose
seat lapsed, still holds the newest snapshots of its ranks, and the nodes of the next
round that ask it for them may have joined after its last round (spares taking the
lost nodes' places). :class:`JobAddresses` answers for those: an address that the
round's list does not name is looked up in the state as it is now, which only the
job's nodes can write (every record signed with the secret).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from relaunch.errors import RelaunchError
from relaunch.rendezvous._backend import StateBackend
from relaunch.rendezvous._state import peer_addresses

__all__ = ["JobAddresses"]

log = logging.getLogger(__name__)

REREAD_AFTER = 1.0
"""Seconds between two reads of the state for addresses not known: a stranger that
connects again and again costs the store one read a second at most."""


class JobAddresses:
    """Called with an IP address: whether a node of the job has it, as the state says
    (read again when the address is not known: at once, or once :data:`REREAD_AFTER`
    has passed since the last read; a read begun after the call came answers it).
    Thread-safe; a failed read admits no one new."""

    def __init__(
        self,
        backend: StateBackend,
        known: frozenset[str],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._backend = backend
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._reading = threading.Lock()
        """Held through a read of the state, and the wait before it: a caller that
        waited for it sees what the read found (two spares connecting at once are both
        admitted by one read; strangers in a row cost one read a second)."""
        self._known = known
        self._read_at = -math.inf
        """When the last read began."""

    def __call__(self, address: str) -> bool:
        asked = self._clock()
        with self._lock:
            if address in self._known:
                return True
        with self._reading:  # (the others' answers for known hosts do not wait for it)
            with self._lock:
                if address in self._known or self._read_at >= asked:
                    return address in self._known  # (a read begun after the call answers it)
                wait = self._read_at + REREAD_AFTER - self._clock()
            if wait > 0:  # a node that joined just after the last read is not refused
                self._sleep(wait)
            with self._lock:
                self._read_at = self._clock()
            try:
                state, _ = self._backend.load()
            except RelaunchError as exc:  # a lost store, a corrupt or unsigned state
                log.info("cannot read the state to admit %s: %s", address, exc)
                return False
            found = frozenset().union(*(peer_addresses([n]) or () for n in state.known()))
            with self._lock:
                self._known |= found  # (IP literals only: a node named otherwise is left out)
                return address in self._known
