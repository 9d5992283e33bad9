"""While the shared rendezvous state is corrupt: say so once per content, and for how long.

Both the agent's reads and the keep-alive thread see a corrupt state; they share one
:class:`CorruptWatch`, so each distinct corruption is logged once (not once per poll
or per heartbeat), and the agent knows when it has gone on with its last valid state
for long enough (``grace``, the dead-node delay) to give up as for a lost store. A lock
makes "once" hold when both threads see the same corruption at the same moment.
"""

from __future__ import annotations

import logging
import threading
import time

from relaunch.errors import RendezvousStateError

__all__ = ["CorruptWatch"]

logger = logging.getLogger("relaunch.rendezvous.handler")


class CorruptWatch:
    def __init__(self, run_id: str, grace: float) -> None:
        self._run_id = run_id
        self._grace = grace
        self._lock = threading.Lock()
        self._current: tuple[str, float] | None = None
        """(the error, since when) while the state is corrupt."""

    def seen(self, exc: RendezvousStateError) -> float:
        """A read failed on ``exc``: log it if new; return since when it is corrupt."""
        message, now = str(exc), time.monotonic()
        with self._lock:
            current, new = self._current, False
            if current is None or current[0] != message:
                current = (message, current[1] if current is not None else now)
                self._current, new = current, True
        if new:
            logger.warning(
                "%s; this node goes on with the last valid state for up to %g s",
                message,
                self._grace,
            )
        return current[1]

    def ok(self) -> None:
        """A read decoded: the state is valid (again)."""
        with self._lock:
            was_corrupt, self._current = self._current is not None, None
        if was_corrupt:
            logger.warning("rendezvous %s: the state is valid again", self._run_id)

    def expired(self, since: float | None = None) -> bool:
        """Whether the state has been corrupt for longer than the grace."""
        current = self._current
        start = since if since is not None else (current[1] if current is not None else None)
        return start is not None and time.monotonic() - start > self._grace

    def error(self) -> RendezvousStateError | None:
        """The error to end with, once the grace is over."""
        current = self._current
        return RendezvousStateError(current[0]) if current is not None and self.expired() else None
