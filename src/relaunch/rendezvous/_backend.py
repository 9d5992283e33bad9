"""The I/O around the pure state machine: the shared state in a Store.

Keys, under ``relaunch/rdzv/<run_id>/``:

``state``
    The JSON state. Every write is a compare-and-set against the bytes last read
    (they carry ``seq``, so the bytes are the fencing token: no lost update).
``epoch/<n>``
    Set after the write that raised the state's ``epoch`` to ``n``. A node
    waiting for a change waits on ``epoch/<epoch + 1>``: the store wakes it.
``req``, ``req/<t>``, ``ack/<t>``
    The join queue. A joining node takes ticket ``t`` (atomic add on ``req``) and
    writes its request at ``req/<t>``. The node holding the oldest unapplied
    ticket (the *head*) folds every pending request into the state in one
    compare-and-set, then sets ``ack/<t>`` for each, and ``ack/<next>`` to hand
    the head over. So N nodes joining at once cost O(N) store operations, not
    the O(N^2) of everyone retrying the same compare-and-set.
``round/<r>/``
    The prefix of the store handed out with round ``r``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from relaunch.errors import StoreTimeoutError
from relaunch.rendezvous._ops import needs_wake, place, remove_dead
from relaunch.rendezvous._settings import RendezvousSettings
from relaunch.rendezvous._state import RendezvousState, decode_state, encode_state
from relaunch.store import Store

__all__ = ["REQUEST_VERSION", "StateBackend", "key_prefix"]

logger = logging.getLogger(__name__)

REQUEST_VERSION = 1
"""Version of the join request JSON."""


def key_prefix(run_id: str) -> str:
    """Where the rendezvous of ``run_id`` keeps its keys."""
    return f"relaunch/rdzv/{run_id}/"


class StateBackend:
    """Reads and writes the shared state of one run in ``store``.

    ``clock`` returns wall-clock seconds (the time written into the state).
    """

    def __init__(
        self, store: Store, settings: RendezvousSettings, *, clock: Callable[[], float]
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self.prefix = key_prefix(settings.run_id)
        self.state_key = self.prefix + "state"

    def fresh(self) -> RendezvousState:
        return RendezvousState(run_id=self.settings.run_id)

    def epoch_key(self, epoch: int) -> str:
        return f"{self.prefix}epoch/{epoch}"

    def _decode(self, raw: bytes) -> RendezvousState:
        return decode_state(raw, key=self.state_key, run_id=self.settings.run_id)

    def load(self) -> tuple[RendezvousState, bytes | None]:
        """The current state and its bytes (``None``: no state yet, a fresh one)."""
        raw = self.store.get(self.state_key)
        if raw is None:
            return self.fresh(), None
        return self._decode(raw), raw

    def commit(
        self, old: RendezvousState, old_raw: bytes | None, new: RendezvousState
    ) -> tuple[RendezvousState, bytes | None, bool]:
        """Write ``new`` if the state is still ``old_raw``; return the state now and whether."""
        new.seq = old.seq + 1
        new.epoch = old.epoch + 1 if needs_wake(old, new) else old.epoch
        data = encode_state(new)
        current, written = self.store.compare_set(self.state_key, old_raw, data)
        if written:
            if new.epoch != old.epoch:
                self.store.set(self.epoch_key(new.epoch), b"1")
            return new, data, True
        if not current:
            return self.fresh(), None, False
        return self._decode(current), current, False

    def wait_change(self, state: RendezvousState, timeout: float) -> bool:
        """Wait until a write raised the epoch past ``state``'s; False after ``timeout``."""
        try:
            self.store.wait([self.epoch_key(state.epoch + 1)], max(timeout, 0.001))
        except StoreTimeoutError:
            return False
        return True

    def changed_since(self, state: RendezvousState) -> bool:
        """Whether a write that waiting nodes must see happened after ``state`` (one get)."""
        return self.store.get(self.epoch_key(state.epoch + 1)) is not None

    # -- the join queue -------------------------------------------------------------

    def request_join(self, node: str) -> tuple[RendezvousState, bytes | None]:
        """Queue the join request of ``node`` and return the first state that includes it."""
        ticket = self.store.add(self.prefix + "req", 1)
        request = {"version": REQUEST_VERSION, "run_id": self.settings.run_id, "node": node}
        self.store.set(f"{self.prefix}req/{ticket}", json.dumps(request).encode())
        take_over = False
        while True:
            state, raw = self.load()
            if state.applied >= ticket:
                return state, raw
            if take_over or state.applied + 1 == ticket:
                self._apply_requests(state, raw)
                take_over = False
                continue
            try:
                self.store.wait([f"{self.prefix}ack/{ticket}"], self.settings.heartbeat_timeout)
            except StoreTimeoutError:
                # The head may have died: apply the queue ourselves.
                take_over = True

    def _read_request(self, ticket: int) -> str | None:
        key = f"{self.prefix}req/{ticket}"
        raw = self.store.get(key)
        if raw is None:
            try:
                self.store.wait([key], self.settings.keep_alive_interval)
            except StoreTimeoutError:
                logger.warning("join request %s never written; skipped", key)
                return None
            raw = self.store.get(key)
        try:
            doc = json.loads(raw or b"")
            if not isinstance(doc, dict) or doc.get("version") != REQUEST_VERSION:
                raise ValueError("not a version 1 join request")
            if doc.get("run_id") != self.settings.run_id:
                raise ValueError(f"request of another run id {doc.get('run_id')!r}")
            node = doc.get("node")
            if not isinstance(node, str) or not node:
                raise ValueError("no node id")
        except ValueError as exc:
            logger.warning("join request %s refused: %s", key, exc)
            return None
        return node

    def _apply_requests(self, state: RendezvousState, raw: bytes | None) -> None:
        last = self.store.add(self.prefix + "req", 0)
        first = state.applied + 1
        nodes = [self._read_request(t) for t in range(first, last + 1)]
        now = self.clock()
        new, _ = remove_dead(state, now, self.settings)
        new = new.copy()
        for node in nodes:
            if node is not None:
                new = place(new, node, now, self.settings)
        new.applied = max(last, state.applied)
        _, _, written = self.commit(state, raw, new)
        if written:
            for ticket in range(first, last + 1):
                self.store.set(f"{self.prefix}ack/{ticket}", b"a")
            self.store.set(f"{self.prefix}ack/{last + 1}", b"h")
